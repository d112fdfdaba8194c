"""The contract between a policy and an executor: plain data, ids and integers only.

A ``StepPlan`` says, for each scheduled request, where its new tokens start, how many there are,
which KV blocks hold its context, and whether the step samples a token for it; plus the block
copies that swap-out and swap-in need. Both executors (cost model and real) consume exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


class DecodeBlock:
    """Decode rows as columns (step_mode=fast): each row computes its one pending token over
    ``start_positions[i]`` cached tokens and samples. A plan holds one in place of that many
    ``ScheduledRequest`` rows (``StepPlan.scheduled`` turns it into them on demand), so a step
    over a large decoding batch costs no per-row Python object. Plain data: ids, integers and
    the block tables' lists (read only)."""

    __slots__ = ("request_ids", "_ctx0", "_offset", "block_tables", "ctx_sum", "ctx_max")

    def __init__(self, request_ids: list[int], ctx0: np.ndarray, offset: int,
                 block_tables: list[list[int]], ctx_sum: int, ctx_max: int) -> None:
        self.request_ids = request_ids
        self._ctx0 = ctx0  # never mutated in place: the start positions are ctx0 + offset
        self._offset = offset
        self.block_tables = block_tables
        self.ctx_sum = ctx_sum  # sum and max of the start positions
        self.ctx_max = ctx_max

    @classmethod
    def of_rows(cls, request_ids: list[int], start_positions: list[int],
                block_tables: list[list[int]]) -> DecodeBlock:
        return cls(request_ids, np.asarray(start_positions, dtype=np.int64), 0, block_tables,
                   sum(start_positions), max(start_positions, default=0))

    @classmethod
    def for_pricing(cls, num_rows: int, ctx_sum: int, ctx_max: int) -> DecodeBlock:
        """A block that only states its shape (rows, sum and max of the start positions):
        what ``step_shape`` reads to price a step (sim/array_core.py, which keeps no ids,
        contexts or block tables). Its rows cannot be expanded."""
        return cls(range(num_rows), None, 0, [], ctx_sum, ctx_max)  # type: ignore[arg-type]

    @property
    def start_positions(self) -> np.ndarray:
        return self._ctx0 + self._offset

    def __len__(self) -> int:
        return len(self.request_ids)

    def rows(self) -> list[ScheduledRequest]:
        return [ScheduledRequest(rid, start, 1, table, True) for rid, start, table in
                zip(self.request_ids, self.start_positions.tolist(), self.block_tables)]


class StepPlan:
    """``scheduled``: the rows (``ScheduledRequest``) in the policy's order. Internally the rows
    may be held as ``parts``: rows and ``DecodeBlock`` columns, in order; reading
    ``scheduled`` expands the blocks (once), so a consumer that wants rows gets exactly the
    rows the per-row path would have built."""

    __slots__ = ("_parts", "_num_blocks", "swap_out", "swap_in", "swaps", "recomputed",
                 "swapped_out", "admitted")

    def __init__(self, scheduled: list[ScheduledRequest] | None = None,
                 swap_out: list[tuple[int, int]] | None = None,
                 swap_in: list[tuple[int, int]] | None = None,
                 swaps: list[tuple[str, list[tuple[int, int]]]] | None = None,
                 recomputed: list[int] | None = None,
                 swapped_out: list[int] | None = None) -> None:
        self._parts: list[ScheduledRequest | DecodeBlock] = (
            [] if scheduled is None else scheduled)
        self._num_blocks = 0
        # (gpu_block, cpu_block) copies to make before the step runs (device -> host)
        self.swap_out = [] if swap_out is None else swap_out
        # (cpu_block, gpu_block) copies to make before the step runs (host -> device)
        self.swap_in = [] if swap_in is None else swap_in
        # The same copies grouped per request, in the order the builder made them: ("out",
        # pairs) or ("in", pairs). A block one swap frees may be reused by a later one in the
        # same step (swap in, then swap the same request out again), so an executor that
        # really copies must follow this order; ``swap_out``/``swap_in`` alone lose it.
        # With an offload tier the list also holds its copies, in the same order: ("store",
        # [(gpu_block, offload_block)]) keeps an evicted block's content before the step
        # overwrites it, ("load", [(offload_block, gpu_block)]) brings a cache hit back.
        self.swaps = [] if swaps is None else swaps
        # Requests preempted by recompute while building this plan (informational).
        self.recomputed = [] if recomputed is None else recomputed
        # Requests whose KV was swapped out while building this plan (informational).
        self.swapped_out = [] if swapped_out is None else swapped_out
        # Requests admitted from the waiting queue into this plan (a row of one token at a
        # later position is then an admission from a cached prefix, not a decode).
        self.admitted: list[int] = []

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        if self._num_blocks:
            rows: list[ScheduledRequest] = []
            for part in self._parts:
                if isinstance(part, DecodeBlock):
                    rows.extend(part.rows())
                else:
                    rows.append(part)
            self._parts, self._num_blocks = rows, 0
        return self._parts  # type: ignore[return-value]

    @property
    def parts(self) -> list[ScheduledRequest | DecodeBlock]:
        """Rows and decode blocks in order (read only)."""
        return self._parts

    @property
    def num_blocks(self) -> int:
        """How many ``DecodeBlock`` parts the plan holds (0 once ``scheduled`` expanded them)."""
        return self._num_blocks

    @property
    def num_rows(self) -> int:
        if not self._num_blocks:
            return len(self._parts)
        return sum(len(p) if isinstance(p, DecodeBlock) else 1 for p in self._parts)

    def add_row(self, row: ScheduledRequest) -> None:
        self._parts.append(row)

    def add_block(self, block: DecodeBlock) -> None:
        self._parts.append(block)
        self._num_blocks += 1

    @property
    def decode_block(self) -> DecodeBlock | None:
        """The plan's only content when it is a single decode block (a steady decode step)."""
        if self._num_blocks == 1 and len(self._parts) == 1:
            return self._parts[0]  # type: ignore[return-value]
        return None

    @property
    def num_offload_loads(self) -> int:
        """Blocks this step loads from the offload tier (host -> device, before it runs)."""
        swaps = self.swaps
        return sum(len(pairs) for d, pairs in swaps if d == "load") if swaps else 0

    @property
    def is_empty(self) -> bool:
        return not (self._parts or self.swap_out or self.swap_in)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) if isinstance(p, DecodeBlock) else p.num_new_tokens
                   for p in self._parts)

    @property
    def num_decode_tokens(self) -> int:
        return sum(len(p) if isinstance(p, DecodeBlock) else p.is_decode for p in self._parts)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self._parts
                   if not isinstance(s, DecodeBlock) and not s.is_decode)

    @property
    def num_sampled(self) -> int:
        return sum(len(p) if isinstance(p, DecodeBlock) else p.sample for p in self._parts)

    def __repr__(self) -> str:
        return (f"StepPlan(scheduled={self.scheduled!r}, swap_out={self.swap_out!r}, "
                f"swap_in={self.swap_in!r}, recomputed={self.recomputed!r}, "
                f"swapped_out={self.swapped_out!r})")


@dataclass(slots=True)
class StepResult:
    duration: float  # seconds of (simulated or measured) time the step takes
    # One sampled token id per scheduled row with ``sample`` set, in plan order; None from a
    # cost model, which does not produce tokens.
    sampled_token_ids: list[int] | None = None
