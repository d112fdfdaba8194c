"""FCFS continuous batching as vLLM v0 schedules by default (no chunked prefill).

Each step is either a prefill step or a decode step:
1. If nothing is swapped out, admit waiting requests in arrival order (recomputed requests
   first) with their whole prompt, while ``max_num_batched_tokens``, ``max_num_seqs`` and the
   free blocks (above the watermark) allow. If any was admitted, the step is prefill only.
2. Otherwise every running request decodes one token; when one cannot get a block, the most
   recently arrived running request is preempted (recompute by default).
3. If that preempted nobody, swapped requests come back in order while blocks last.
"""

from __future__ import annotations

from policies.base import POLICIES, Policy
from policies.budget import Budget, admit, schedule_running
from sim.plan import StepPlan
from sim.step_builder import StepBuilder


def swap_in_and_decode(step: StepBuilder, budget: Budget) -> None:
    """Bring swapped requests back in order and schedule their pending tokens this step."""
    for req in list(step.swapped):
        if budget.remaining_tokens < req.num_pending_tokens or budget.seats_left() <= 0:
            break
        if not step.swap_in(req):
            break
        if not step.schedule(req, req.num_pending_tokens):
            # swap_in checked room for the old blocks; a new block may still be missing.
            step.preempt(req)
            break


@POLICIES.register("fcfs")
class FCFSPolicy(Policy):
    # Admission can only get harder while a decode batch grows (free blocks shrink, seats and
    # budget stay), so a decode-only step repeats until an arrival, finish or KV shortage.
    supports_decode_jumps = True

    def schedule(self, step: StepBuilder) -> StepPlan:
        cfg = self.config
        budget = Budget(step, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        if not step.swapped and step.waiting:
            if admit(step, budget, step.waiting, chunked=cfg.chunked_prefill):
                return step.build()
        preempted = schedule_running(step, budget)
        if not preempted and step.swapped:
            swap_in_and_decode(step, budget)
        return step.build()
