"""The contract between a policy and an executor: plain data, ids and integers only.

A ``StepPlan`` says, for each scheduled request, where its new tokens start, how many there are,
which KV blocks hold its context, and whether the step samples a token for it; plus the block
copies that swap-out and swap-in need. Both executors (cost model and real) consume exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    request_id: int
    start_position: int  # = num_computed_tokens before the step
    num_new_tokens: int  # query tokens this step computes
    block_table: list[int]  # GPU block ids in logical order (the manager's list: read only)
    sample: bool  # the step ends this request's catch-up and samples one token

    @property
    def context_len(self) -> int:
        """Tokens attended to by the last query token (cached + new)."""
        return self.start_position + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One query token over a non-empty cache: how attention kernels classify a row."""
        return self.num_new_tokens == 1 and self.start_position > 0


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # (gpu_block, cpu_block) copies to make before the step runs (device -> host)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (cpu_block, gpu_block) copies to make before the step runs (host -> device)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The same copies grouped per request, in the order the builder made them: ("out", pairs)
    # or ("in", pairs). A block one swap frees may be reused by a later one in the same step
    # (swap in, then swap the same request out again), so an executor that really copies
    # must follow this order; ``swap_out``/``swap_in`` alone lose it.
    swaps: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    # Requests preempted by recompute while building this plan (informational).
    recomputed: list[int] = field(default_factory=list)
    # Requests whose KV was swapped out while building this plan (informational).
    swapped_out: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.scheduled if s.sample)


@dataclass(slots=True)
class StepResult:
    duration: float  # seconds of (simulated or measured) time the step takes
    # One sampled token id per scheduled row with ``sample`` set, in plan order; None from a
    # cost model, which does not produce tokens.
    sampled_token_ids: list[int] | None = None
