"""Chunked prefill with stall-free batching (Sarathi-Serve; vLLM's chunked prefill).

Every step, in this order, within ``max_num_batched_tokens`` (default 512) tokens:
1. every running request whose prompt is done gets its decode token (arrival order; on memory
   pressure the latest-arrived running request is preempted, as in ``fcfs``);
2. running requests mid-prefill continue with the next chunk, oldest first;
3. if nothing was preempted, swapped requests resume (a swapped prefill may resume chunked);
4. if nothing was preempted and nothing is swapped out, waiting requests are admitted in
   arrival order, the last one possibly with a partial chunk (admitting right after a
   preemption would only hand the victim's blocks to a newcomer and preempt again).
So a long prompt never stalls the decodes: it is spread over as many steps as it needs.
``max_num_partial_prefills`` (vLLM's name; null: no limit) caps how many requests may be
mid-prefill at once; a prompt that fits whole in the step is always allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import POLICIES, Policy, PolicyConfig
from policies.budget import Budget, admit, resume_swapped, schedule_running
from sim.errors import require
from sim.plan import StepPlan
from sim.step_builder import StepBuilder


@dataclass(frozen=True)
class ChunkedPrefillConfig(PolicyConfig):
    name: str = "chunked_prefill"
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    max_num_partial_prefills: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.chunked_prefill, "policy.chunked_prefill",
                "must be true for the chunked_prefill policy")
        # Stall-free needs room for a decode token of every running request in every step.
        require(self.max_num_seqs <= self.max_num_batched_tokens, "policy.max_num_seqs",
                f"{self.max_num_seqs} exceeds policy.max_num_batched_tokens="
                f"{self.max_num_batched_tokens}: a step could not hold every decode")
        require(self.max_num_partial_prefills is None or self.max_num_partial_prefills >= 1,
                "policy.max_num_partial_prefills",
                f"must be >= 1 or null, got {self.max_num_partial_prefills}")


@POLICIES.register("chunked_prefill")
class ChunkedPrefillPolicy(Policy):
    config_class = ChunkedPrefillConfig
    config: ChunkedPrefillConfig

    def schedule(self, step: StepBuilder) -> StepPlan:
        cfg = self.config
        budget = Budget(step, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        decodes = [r for r in step.running if r.num_pending_tokens == 1]
        prefills = [r for r in step.running if r.num_pending_tokens > 1]
        preempted = schedule_running(step, budget, order=decodes)
        preempted += schedule_running(step, budget, order=prefills)
        if preempted:
            return step.build()
        if step.swapped:
            resume_swapped(step, budget, chunked=True)
        if not step.swapped and step.waiting:
            limit = cfg.max_num_partial_prefills
            if limit is not None:
                # Requests that will still be mid-prefill after this step.
                open_partials = sum(1 for r in step.running
                                    if r.num_pending_tokens > step.granted(r))
                limit = max(0, limit - open_partials)
            admit(step, budget, step.waiting, chunked=True, max_partial=limit)
        return step.build()
