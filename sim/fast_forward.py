"""Decode jumps: take many identical decode-only steps as one simulation event.

Between two events that can change a batch (an arrival anywhere in the cluster, a request
finishing, the KV pool running dry), a decode-only batch keeps its membership: every step
each member gains one token and its context grows by one. The executor gives the durations of
those steps in closed form, so K steps cost one numpy evaluation instead of K trips through the
policy. Timestamps inside the jump are the same cumulative sums the step-by-step loop would
compute, so results match ``step_mode=exact`` (tests assert it for every policy).

The jump ends at the first of:
- the step in which some member produces its last token (it finishes after that step);
- the last step whose new KV blocks still fit the free pool (the next would need a preemption);
- the last step that starts before the next external event (``horizon``): an arrival, which
  may change what the policy schedules or what a router sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.decode_run import DecodeRun, jump_block_steps, jump_new_blocks
from sim.plan import DecodeBlock, StepPlan
from sim.request import Request


def is_steady_decode(plan: StepPlan) -> bool:
    """Every row computes exactly its one pending token and samples, with no KV movement:
    the shape that repeats unchanged while nothing external happens."""
    if plan.swap_in or plan.swap_out or plan.recomputed or plan.swapped_out:
        return False
    if plan.decode_block is not None:
        return True
    return all(s.num_new_tokens == 1 and s.sample and s.start_position > 0
               for s in plan.scheduled)


@dataclass
class Jump:
    num_steps: int
    durations: np.ndarray  # [num_steps]
    ends: np.ndarray  # [num_steps] absolute end time of each step
    new_blocks: np.ndarray  # [num_steps] KV blocks newly allocated in each step
    # Decode-run jumps: the members (indices) that get the new blocks of steps 2..k, in the
    # order the step-by-step loop allocates them.
    block_members: np.ndarray | None = None


def _jump_length(durations_fn, plan: StepPlan, k_max: int, start: float,
                 horizon: float) -> tuple[int, np.ndarray, np.ndarray] | None:
    durations = durations_fn(plan, k_max)
    if durations is None:
        return None
    # Same sequential float additions as env.now += duration, step after step.
    ends = np.cumsum(np.concatenate(([start], durations)))[1:]
    # Step k (k >= 1) starts at ends[k-1]; it belongs to the jump only if that is strictly
    # before the horizon (at or after it, an arrival may be seen first).
    k = int(min(k_max, 1 + np.searchsorted(ends[:-1], horizon, side="left")))
    if k < 2:
        return None
    return k, durations[:k], ends[:k]


def plan_run_jump(plan: StepPlan, block: DecodeBlock, run: DecodeRun, durations_fn,
                  start: float, horizon: float, free_blocks: int,
                  max_steps: int = 1 << 16) -> Jump | None:
    """``plan_jump`` for a plan that is one decode block scheduling the whole decode run:
    the same jump, from the run's arrays (no per-row work)."""
    k_max = min(run.steps_left(), max_steps)
    if k_max < 2:
        return None
    ctx, nblk, bs = block.start_positions, run.nblk, run.block_size
    if jump_new_blocks(ctx, nblk, bs, k_max) > free_blocks:
        lo, hi = 1, k_max  # step 1's blocks are the plan's
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if jump_new_blocks(ctx, nblk, bs, mid) <= free_blocks:
                lo = mid
            else:
                hi = mid
        k_max = lo
        if k_max < 2:
            return None
    sized = _jump_length(durations_fn, plan, k_max, start, horizon)
    if sized is None:
        return None
    k, durations, ends = sized
    steps, members = jump_block_steps(ctx, nblk, bs, k)
    new_blocks = np.bincount(steps - 1, minlength=k)[:k]
    return Jump(k, durations, ends, new_blocks, members)


def plan_jump(plan: StepPlan, requests: list[Request], durations_fn, start: float,
              horizon: float, free_blocks: int, block_size: int,
              max_steps: int = 1 << 16) -> Jump | None:
    """Size a jump starting with ``plan`` at time ``start``; None if it would be one step."""
    remaining = min(r.max_output_len - r.num_output_tokens for r in requests)
    k_max = min(remaining, max_steps)
    if k_max < 2:
        return None
    ctx = np.fromiter((s.start_position for s in plan.scheduled), dtype=np.int64,
                      count=len(plan.scheduled))
    have = np.fromiter((len(s.block_table) for s in plan.scheduled), dtype=np.int64,
                       count=len(plan.scheduled))

    # KV: after k steps a member holds blocks for ctx + k tokens (the first step's blocks are
    # already allocated by the policy: the plan holds them). Cumulative new blocks beyond the
    # plan grow with k; take the largest k whose total fits the free pool.
    def extra_blocks(k: int) -> int:
        return int(np.sum(-(-(ctx + k) // block_size) - have))

    if extra_blocks(k_max) > free_blocks:
        lo, hi = 1, k_max  # extra_blocks(1) == 0 <= free_blocks
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if extra_blocks(mid) <= free_blocks:
                lo = mid
            else:
                hi = mid
        k_max = lo
        if k_max < 2:
            return None

    durations = durations_fn(plan, k_max)
    if durations is None:
        return None
    # Same sequential float additions as env.now += duration, step after step.
    ends = np.cumsum(np.concatenate(([start], durations)))[1:]
    # Step k (k >= 1) starts at ends[k-1]; it belongs to the jump only if that is strictly
    # before the horizon (at or after it, an arrival may be seen first).
    k = int(min(k_max, 1 + np.searchsorted(ends[:-1], horizon, side="left")))
    if k < 2:
        return None
    steps = np.arange(1, k + 1, dtype=np.int64)
    held = -(-(ctx[None, :] + steps[:, None]) // block_size)  # [k, rows]
    total_new = np.maximum(held - have[None, :], 0).sum(axis=1)  # beyond the plan's blocks
    new_blocks = np.diff(np.concatenate(([0], total_new)))
    return Jump(k, durations[:k], ends[:k], new_blocks)
