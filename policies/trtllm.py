"""TensorRT-LLM's in-flight batching: its capacity scheduler and micro-batch scheduler.

Every step (one iteration of TensorRT-LLM's executor loop) goes through the requests in
arrival order within ``max_num_batched_tokens`` (TensorRT-LLM's ``max_num_tokens``, 8,192 by
default) and ``max_num_seqs`` (``max_batch_size``, 2,048):
1. every running request gets its next tokens: a decode token, or a prompt's next chunk;
2. then waiting requests are admitted in arrival order with their whole prompt, strictly in
   order: the first that does not fit (tokens, seats or KV) stops admission. With
   ``policy.enable_chunked_prefill=true`` (TensorRT-LLM's ``enable_chunked_context``) the last one
   admitted may start with a partial chunk; its later chunks come in step 1.
Prompts and decodes share a step (in-flight batching), where vLLM v0 runs prefill-only steps.

What may be admitted is the capacity scheduler's (``capacity_scheduler_policy``):
- ``guaranteed_no_evict`` (TensorRT-LLM's default): a request is admitted only if the KV pool
  holds its whole length (prompt + maximum output) beside what those running will need by
  their end; it holds that length from admission (``StepBuilder.reserve``), so a running
  request never needs a block it cannot get and nobody is ever paused. ``kv_blocks_used``
  counts the reserved blocks as used.
- ``max_utilization``: a request is admitted if its prompt's blocks fit now; when a running
  request cannot get the block for its next token, the one admitted last is paused: its KV is
  freed and it is computed again later (``preemption_mode=recompute``; TensorRT-LLM has no
  swap to host memory).

Not modelled: TensorRT-LLM rounds a context chunk to whole KV blocks (here a chunk takes what
the budget leaves) and may reuse a paused request's KV blocks when they were not overwritten
(here a paused request recomputes, unless prefix caching finds its blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, ClassVar

from policies.base import POLICIES, Policy, PolicyConfig
from policies.budget import (
    Budget,
    admission_rule,
    admit,
    counted_room,
    grant_chunks,
    latest_arrival_victim,
    no_victim,
    preempted_on_counts,
    schedule_running,
)
from sim.errors import require
from sim.plan import StepPlan
from sim.step_builder import StepBuilder

CAPACITY_POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(frozen=True)
class TensorRTLLMConfig(PolicyConfig):
    name: str = "trtllm"
    max_num_seqs: int = 2048
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    kv_watermark: float = 0.0
    capacity_scheduler_policy: str = "guaranteed_no_evict"
    recompute_only: ClassVar[str | None] = (
        "TensorRT-LLM pauses a request by freeing its KV (recompute); it has no swap")
    no_watermark: ClassVar[str | None] = "TensorRT-LLM keeps no watermark of free blocks"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.capacity_scheduler_policy in CAPACITY_POLICIES,
                "policy.capacity_scheduler_policy",
                f"must be one of {', '.join(CAPACITY_POLICIES)}, got "
                f"{self.capacity_scheduler_policy!r}")


@POLICIES.register("trtllm")
class TensorRTLLMPolicy(Policy):
    # With nothing admitted a decode-only step repeats until an arrival, finish or KV
    # shortage: seats and tokens stay, and free blocks only shrink as the batch grows (or,
    # with whole lengths held, stay) while nothing finishes.
    supports_decode_jumps = True
    implements_chunked_prefill = True
    # Its PyTorch backend's overlap scheduler (on by default) prepares the next batch while
    # this one runs.
    host_overlap_default = True
    # ``chunk_plan`` and ``decode_preemptions`` below: guaranteed_no_evict (nobody is ever
    # paused), and max_utilization (the latest arrivals paused; one paused comes back at the
    # queue's head, so a prompt mid-prefill is always the latest arrival running).
    array_core = True
    # ``schedule_running`` over the running requests in arrival order, then admission.
    grants_in_arrival_order = True

    config_class = TensorRTLLMConfig
    config: TensorRTLLMConfig

    @property
    def reserves_full_length(self) -> bool:  # type: ignore[override]
        """``guaranteed_no_evict`` holds every request's whole length (a decode replica
        reserves that much for a transfer)."""
        return self.config.capacity_scheduler_policy == "guaranteed_no_evict"

    @property
    def grants_decodes_first(self) -> bool:  # type: ignore[override]
        """Without chunked prefill every prompt is admitted whole, so no chunk is ever left
        for a later step and each step's decodes come first, also with pipeline stages
        (sim/array_pipeline.py). With it, a prompt admitted before a request that now decodes
        takes its next chunk first in arrival order."""
        return not self.config.enable_chunked_prefill

    def decode_preemptions(self, needs: Sequence[int], held: Sequence[int], free: int) -> int:
        """The array core's step when the pool cannot hold every decode's new block
        (max_utilization; sim/array_core.py): ``schedule_running`` with
        ``latest_arrival_victim`` on counts. Every running request in arrival order,
        ``needs[r]`` its new blocks, ``held[r]`` what it holds; returns how many of the
        latest arrivals it pauses (``preempted_on_counts``). The step then decodes the rest
        and admits nobody."""
        return preempted_on_counts(needs, held, free)

    def chunk_plan(self, decode_tokens: int, partials: Sequence[int], waiting: Iterable[int],
                   num_waiting: int, seats: int, room: tuple[int, int, int] | None = None,
                   lengths: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
        """The array core's step (sim/array_core.py) under guaranteed_no_evict: ``schedule``'s
        decisions on plain numbers. The running requests in arrival order are those with one
        pending token (``decode_tokens`` of them: decodes, and prompts one token from done),
        then the prompts mid-prefill (``partials``: their pending tokens; with chunked
        prefill only the last request admitted can be left with part of its prompt, and
        while it is nobody after it is admitted). Each gets its pending tokens up to what the
        budget has left; then the waiting requests (their pending prefill tokens in queue
        order, ``num_waiting`` of them) are admitted strictly in order while the budget and
        the ``seats`` last, with their whole prompts (or, with chunked prefill, the last
        with a partial chunk). Where the pool can bind, ``room`` = (free blocks, watermark,
        block size): under guaranteed_no_evict with ``lengths``, their whole lengths (prompt
        + maximum output - 1) in the same order, each admitted only if the pool holds its
        whole length, which it reserves; under max_utilization each admitted only if its
        pending prefill's blocks fit now (``counted_room``). Returns the partials' chunks
        (fewer entries once the budget is spent) and the admitted ones' (the first ``len`` of
        the queue). tests/test_array_core.py checks it against ``schedule``."""
        cfg = self.config
        chunks, remaining = grant_chunks(partials, cfg.max_num_batched_tokens - decode_tokens)
        if not num_waiting:
            return chunks, []
        candidates: Iterable[Any] = waiting
        pending_of = place = None
        if room is not None and self.reserves_full_length:
            if lengths is None:
                raise ValueError("trtllm's chunk_plan admits on whole lengths where the pool "
                                 "can bind: pass lengths")
            # (pending tokens, whole length) each: the whole length's blocks must fit.
            candidates, pending_of = zip(waiting, lengths), itemgetter(0)
            place = counted_room(room, itemgetter(1))
        elif room is not None:  # max_utilization: its pending prefill's blocks fit now
            place = counted_room(room)
        admitted = admission_rule(candidates, pending_of, remaining, seats,
                                  cfg.max_num_batched_tokens,
                                  chunked=cfg.enable_chunked_prefill, place=place)
        return chunks, [n for _, n in admitted]

    def schedule(self, step: StepBuilder) -> StepPlan:
        cfg = self.config
        budget = Budget(step, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        no_evict = self.reserves_full_length
        # max_utilization pauses the one admitted last: the latest arrival running.
        preempted = schedule_running(step, budget,
                                     no_victim if no_evict else latest_arrival_victim)
        if not preempted and step.waiting:
            # After a pause, admitting would hand the paused request's blocks to a newcomer.
            admit(step, budget, step.waiting, chunked=cfg.enable_chunked_prefill,
                  reserve_full=no_evict)
        return step.build()
