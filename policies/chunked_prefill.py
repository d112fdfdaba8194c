"""Chunked prefill with stall-free batching (Sarathi-Serve; vLLM's chunked prefill).

Every step, in this order, within ``max_num_batched_tokens`` (default 512) tokens:
1. every running request whose prompt is done gets its decode token (arrival order; on memory
   pressure the latest-arrived running request is preempted, as in ``fcfs``);
2. running requests mid-prefill continue with their next chunk, oldest first;
3. if nothing was preempted, swapped requests resume (a swapped prefill may resume chunked);
4. if nothing was preempted and nothing is swapped out, waiting requests are admitted in
   arrival order, the last one possibly with a partial chunk (admitting right after a
   preemption would only hand the victim's blocks to a newcomer and preempt again).
So a long prompt never stalls the decodes: it is spread over as many steps as it needs.

Memory at admission is vLLM v0's (``block_manager.can_allocate`` / ``allocate``, which its
chunked scheduler uses too) and Sarathi-Serve's: a prompt (or a recomputed request's prompt +
generated tokens) is admitted only if the blocks of all of it fit above the watermark, and it
holds them all from its first chunk (``policies/budget.admit``). Its later chunks never need a
block, so a prefill is never preempted for its own growth; a swap-out moves every block it
holds, filled or not, as vLLM swaps the whole block table.

``max_num_partial_prefills`` (vLLM's name and default, 1) is how many prompts may be
mid-prefill at once. With 1, the oldest prompt takes all the tokens the decodes left. With
k > 1, as vLLM v0 does, those tokens are split evenly between up to k prompts wanting them, so
a short prompt is not queued behind a long one's chunks; a prompt that fits whole in its
share always starts. With pipeline stages, a prompt whose chunk is in a micro-batch still in
the pipeline counts among the k if chunks of it remain after that one
(``StepBuilder.num_pending_after_step``) and wants none of this step's tokens; a request
decoding in flight is no prompt mid-prefill.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import POLICIES, Policy, PolicyConfig
from policies.budget import (
    Budget,
    admission_rule,
    admit,
    counted_room,
    grant_chunks,
    preempted_on_counts,
    prefill_share,
    resume_swapped,
    schedule_running,
)
from sim.errors import require
from sim.plan import StepPlan
from sim.step_builder import StepBuilder


@dataclass(frozen=True)
class ChunkedPrefillConfig(PolicyConfig):
    name: str = "chunked_prefill"
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    always_chunks: ClassVar[str | None] = "Sarathi-Serve's step structure chunks prefills"

    def __post_init__(self) -> None:
        super().__post_init__()
        # Stall-free needs room for a decode token of every running request in every step.
        require(self.max_num_seqs <= self.max_num_batched_tokens, "policy.max_num_seqs",
                f"{self.max_num_seqs} exceeds policy.max_num_batched_tokens="
                f"{self.max_num_batched_tokens}: a step could not hold every decode")
        require(self.max_num_partial_prefills >= 1, "policy.max_num_partial_prefills",
                f"must be >= 1, got {self.max_num_partial_prefills}")


@POLICIES.register("chunked_prefill")
class ChunkedPrefillPolicy(Policy):
    # With no prefill chunk to place (nothing waiting that fits), a decode-only step repeats
    # until an arrival, finish or KV shortage: decode jumps are safe.
    supports_decode_jumps = True
    implements_chunked_prefill = True
    array_core = True
    grants_decodes_first = True

    config_class = ChunkedPrefillConfig
    config: ChunkedPrefillConfig

    def schedule(self, step: StepBuilder) -> StepPlan:
        cfg = self.config
        budget = Budget(step, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        decodes, prefills = step.split_running()
        preempted = schedule_running(step, budget, order=decodes)
        if preempted:
            return step.build()
        k = cfg.max_num_partial_prefills
        # The prompts that want this step's tokens: mid-prefill ones (but those in a
        # micro-batch still in the pipeline) and the waiting ones.
        wanting = sum(1 for r in prefills if not step.is_scheduled(r)) + len(step.waiting)
        share = prefill_share(budget.remaining_tokens, k, wanting)
        preempted = schedule_running(step, budget, order=prefills, max_chunk=share)
        if preempted:
            return step.build()
        if step.swapped:
            resume_swapped(step, budget, chunked=True)
        if not step.swapped and step.waiting:
            open_partials = step.num_pending_after_step()
            admit(step, budget, step.waiting, chunked=True, max_partial=max(0, k - open_partials),
                  max_chunk=share)
        return step.build()

    def decode_preemptions(self, needs: Sequence[int], held: Sequence[int], free: int) -> int:
        """The array core's step when the pool cannot hold every decode's new block
        (sim/array_core.py): ``schedule``'s decode loop (``schedule_running`` over the
        decodes, ``latest_arrival_victim`` over every running request) on counts. Every
        running request in arrival order, ``needs[r]`` its new blocks (0 mid-prefill: it
        holds its whole prompt's), ``held[r]`` what it holds; returns how many of the latest
        arrivals it preempts (``preempted_on_counts``). The step then decodes the rest and
        carries no chunk."""
        return preempted_on_counts(needs, held, free)

    def chunk_plan(self, decode_tokens: int, partials: Sequence[int], waiting: Iterable[int],
                   num_waiting: int, seats: int, room: tuple[int, int, int] | None = None,
                   in_flight_partials: int = 0) -> tuple[list[int], list[int]]:
        """The array core's step (sim/array_core.py) when its decodes preempt nobody and
        nothing is swapped out: ``schedule``'s decisions on plain numbers. Given the step's
        ``decode_tokens`` (every running request with one pending token), the pending
        prefill tokens of the running requests mid-prefill (``partials``, more than one
        each, in arrival order), the waiting requests' pending prefill tokens in queue order
        (``waiting``, ``num_waiting`` of them), the free seats and, where the pool can bind,
        the ``room`` admission counts blocks in (``counted_room``), returns the chunks the
        partials get (in order; fewer entries once the budget is spent) and the chunks of
        the waiting requests admitted (the first ``len`` of the queue).
        ``in_flight_partials``: with pipeline stages, the prompts in a micro-batch in flight
        that stay mid-prefill once it lands (they count among ``max_num_partial_prefills``;
        ``partials`` are those not in flight). tests/test_array_core.py and
        tests/test_array_pipeline.py check it against ``schedule``."""
        cfg = self.config
        remaining = cfg.max_num_batched_tokens - decode_tokens
        k = cfg.max_num_partial_prefills
        share = prefill_share(remaining, k, len(partials) + num_waiting)
        chunks, remaining = grant_chunks(partials, remaining, share)
        if not num_waiting:  # (most steps: a prompt mid-prefill, nobody waiting)
            return chunks, []
        # Partials left unfinished: those cut short, and those the budget did not reach.
        open_partials = (sum(n < p for n, p in zip(chunks, partials))
                         + len(partials) - len(chunks) + in_flight_partials)
        admitted = admission_rule(waiting, None, remaining, seats, cfg.max_num_batched_tokens,
                                  chunked=True, max_partial=max(0, k - open_partials),
                                  max_chunk=share,
                                  place=None if room is None else counted_room(room))
        return chunks, [n for _, n in admitted]
