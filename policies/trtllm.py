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

from dataclasses import dataclass
from typing import ClassVar

from policies.base import POLICIES, Policy, PolicyConfig
from policies.budget import (
    Budget,
    admit,
    latest_arrival_victim,
    no_victim,
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

    config_class = TensorRTLLMConfig
    config: TensorRTLLMConfig

    @property
    def reserves_full_length(self) -> bool:  # type: ignore[override]
        """``guaranteed_no_evict`` holds every request's whole length (a decode replica
        reserves that much for a transfer)."""
        return self.config.capacity_scheduler_policy == "guaranteed_no_evict"

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
