"""The decode run: a replica's decoding requests as one persistent block (step_mode=fast).

A request is *decoding* when it is RUNNING, has exactly one pending token and a non-empty cache:
scheduling it means computing that token and sampling the next, so its row is the same every
step but for the context, which grows by one. Between the events that change a batch
(arrivals, finishes, preemptions), the decoding requests form the same block of rows step after
step, and per-step Python work over them is what made the simulator slow.

The ``DecodeRun`` keeps them, in arrival order, with their counters stored *relative to the
run's step count* (``Request.num_computed_tokens`` reads ``_computed + run.steps``; see
``sim/request.py``) and their token times as slices of one array of run step end times. So a
step, or a jump of k steps, that schedules the whole run advances every member in O(1) Python:
``steps += k`` and k times appended. Per-member numbers a step needs (contexts, blocks held,
when each member finishes) are numpy arrays over the members.

Membership changes only through the StepBuilder and the replica (the single home of request
transitions): a request joins when a step leaves it decoding, leaves when it finishes, and any
single-row operation on a member (schedule, preempt...) first dissolves the run, turning every
member back into a plain request, so the per-row code paths see exactly what they always saw.
After a dissolve the run is *incomplete* (some decoding requests may be outside it) until it is
rebuilt from the running set. The replica uses a run only in fast mode (cost model, no
disaggregation handoff); exact mode and the real executor never see one. On a pipelined
replica the run holds the decoding requests not in flight, and a micro-batch takes it along
(``StepBuilder.detach_run``; sim/cluster/pipeline.py): several runs then exist at once,
each member counted by its own.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from sim.request import Request, RequestStatus

# The reductions themselves (``a.min()`` and the like go through numpy's Python wrappers
# first: on arrays of a batch's size the wrapper costs as much as the reduction).
_min, _max, _sum = np.minimum.reduce, np.maximum.reduce, np.add.reduce


def _arrival_key(r: Request) -> tuple[float, int]:
    return (r.arrival_time, r.request_id)


def is_decoding(req: Request) -> bool:
    """RUNNING with exactly one pending token over a non-empty cache, and a token sampled
    already: a decode row whose step computes no prompt token. (A prompt one token from done
    is a row of its own: the step that computes its last token may complete a block of its
    shared prefix, which the prefix cache then names, ``StepBuilder.register_computed``.)"""
    return (req.status is RequestStatus.RUNNING and req.num_computed_tokens > 0
            and req.num_pending_tokens == 1 and req.num_output_tokens > 0)


class DecodeRun:
    """See the module docstring. ``members`` is in arrival order (the running set's order),
    or in the order of ``key`` (a policy's own running order, e.g. SJF's) if given: the order
    the policy gives them their tokens, so the whole run can be granted as one block."""

    __slots__ = ("block_size", "key", "steps", "_times", "_base", "members", "ids", "tables",
                 "_cols", "next_bound", "ctx0_sum", "ctx0_max", "complete", "scheduled_at",
                 "last_jump_step_time")

    def __init__(self, block_size: int, key: Callable[[Request], Any] | None = None) -> None:
        self.block_size = block_size
        # A key that reads a member's progress (SJF's remaining work) may reorder members as
        # the run steps; the step builder checks the order against the policy's before it
        # grants the run as a block and puts the run in the policy's order when it changed
        # (``reorder``).
        self.key = key
        self.steps = 0  # run steps taken so far
        self._times = array("d")  # end times of run steps [_base, steps)
        self._base = 0
        self.members: list[Request] = []
        self.ids: list[int] = []
        self.tables: list[list[int]] = []  # the KV manager's live block tables
        # Per member: num_computed_tokens - steps (context = ctx0 + steps), the run step after
        # which it has sampled its last token (max_output_len - (num_output_tokens - steps)),
        # and the first run step whose token no longer fits its KV blocks (blocks x
        # block_size - ctx0: run step s computes token ctx0 + s + 1). The three are the rows
        # of one array (``ctx0``, ``end``, ``bound``), so a join or a leave is one array
        # operation, not three; a row is never changed in place but ``bound`` (plans keep
        # ``ctx0``).
        self._cols = np.empty((3, 0), dtype=np.int64)
        # At most min(bound): no allocation is needed before that run step. Only a lower
        # bound (blocks granted and members leaving only raise the minimum), made exact again
        # when a step finds nobody needing a block, so most steps skip a reduction.
        self.next_bound = 0
        self.ctx0_sum = 0  # sum and max of ctx0
        self.ctx0_max = 0
        # True when every decoding request of the running set is a member.
        self.complete = True
        # The builder's step (its reset count) in which the whole run was scheduled.
        self.scheduled_at = -1
        # The last step time of its last jump past finishes: how far the next one prices
        # ahead (only the number of pricing calls depends on it, never a result).
        self.last_jump_step_time = 0.0

    def __len__(self) -> int:
        return len(self.members)

    @property
    def ctx0(self) -> np.ndarray:
        return self._cols[0]

    @property
    def end(self) -> np.ndarray:
        return self._cols[1]

    @property
    def bound(self) -> np.ndarray:
        return self._cols[2]

    # ---- token times --------------------------------------------------------------------
    def time_at(self, step: int) -> float:
        """End time of run step ``step`` (0-based)."""
        return self._times[step - self._base]

    def times_since(self, step: int) -> array:
        """End times of run steps ``step .. steps - 1``."""
        return self._times[step - self._base:]

    # ---- membership ---------------------------------------------------------------------
    def join(self, req: Request, table: list[int]) -> None:
        """Add a decoding request (its live block table ``table``) in the run's order."""
        if req._run is not None:
            raise ValueError(f"request {req.request_id} is already in a decode run")
        key = self.key or _arrival_key
        i = bisect.bisect_right(self.members, key(req), key=key)
        self._adopt(req)
        self.members.insert(i, req)
        self.ids.insert(i, req.request_id)
        self.tables.insert(i, table)
        b = len(table) * self.block_size - req._computed
        self._cols = _insert(self._cols, i, (req._computed, req.max_output_len - req._outputs, b))
        if len(self.members) == 1:
            self.next_bound, self.ctx0_sum, self.ctx0_max = b, req._computed, req._computed
        else:
            self.next_bound = min(self.next_bound, b)
            self.ctx0_sum += req._computed
            self.ctx0_max = max(self.ctx0_max, req._computed)

    def _adopt(self, req: Request) -> None:
        """``req``'s counters and token times become relative to this run's steps."""
        s = self.steps
        req._computed -= s
        req._outputs -= s
        req._joined = s
        req._run = self

    def _columns(self, members: list[Request], tables: list[list[int]]) -> np.ndarray:
        """The ``_cols`` rows (ctx0, end, bound) of ``members``, adopted, holding ``tables``."""
        n = len(members)
        ctx0 = np.fromiter((r._computed for r in members), np.int64, n)
        end = np.fromiter((r.max_output_len - r._outputs for r in members), np.int64, n)
        nblk = np.fromiter((len(t) for t in tables), np.int64, n)
        return np.stack((ctx0, end, nblk * self.block_size - ctx0))

    def _release(self, req: Request) -> None:
        """``req`` stops being a member: its counters and token times become its own again."""
        s = self.steps
        req._sync_times()
        req._computed += s
        req._outputs += s
        req._run = None

    def remove_at(self, indices: np.ndarray | list[int]) -> list[Request]:
        """Take the members at ``indices`` (ascending) out of the run; returns them."""
        out = self.release(indices)
        self.drop(indices)
        return out

    def release(self, indices: list[int]) -> list[Request]:
        """Release the members at ``indices`` (ascending) but leave them in the arrays until
        ``drop``: a jump's members finish at its stops and leave all at once at its end."""
        out = [self.members[i] for i in indices]
        for req in out:
            self._release(req)
        return out

    def drop(self, indices: list[int]) -> None:
        """Take the members at ``indices`` (ascending), released already, out of the run."""
        for i in reversed(indices):
            del self.members[i], self.ids[i], self.tables[i]
        cols = self._cols
        if len(indices) == 1 and len(self.members):
            i = indices[0]
            c = int(cols[0, i])
            self._cols = np.concatenate((cols[:, :i], cols[:, i + 1:]), axis=1)
            # The sum moves by one member; the maximum only if it was that member (next_bound
            # stays a lower bound).
            self.ctx0_sum -= c
            if c == self.ctx0_max:
                self.ctx0_max = int(_max(self.ctx0))
        elif self.members:
            c = cols[0, indices].tolist()
            keep = np.empty(cols.shape[1], dtype=bool)
            keep.fill(True)
            keep[indices] = False
            self._cols = cols = cols[:, keep]
            # As for one member: a maximum moves only if it left.
            self.ctx0_sum -= sum(c)
            if self.ctx0_max in c:
                self.ctx0_max = int(_max(cols[0]))
        else:
            self._cols = cols[:, :0]
            self._summarize()
        self._trim()

    def dissolve(self) -> None:
        """Every member becomes a plain request again; the run is incomplete until rebuilt."""
        for req in self.members:
            self._release(req)
        self._forget_members()
        self.complete = False

    def rebuild(self, running: list[Request], tables: dict[int, list[int]]) -> None:
        """Make every decoding request of ``running`` (arrival order) a member, in the run's
        order."""
        self.dissolve()
        decoding = [req for req in running if is_decoding(req)]
        if self.key is not None:
            decoding.sort(key=self.key)  # the keys read each request's own counters
        for req in decoding:
            self._adopt(req)
            self.members.append(req)
            self.ids.append(req.request_id)
            self.tables.append(tables[req.request_id])
        self._cols = self._columns(self.members, self.tables)
        self._summarize()
        self.complete = True

    def absorb(self, other: DecodeRun) -> None:
        """Make every member of ``other`` (complete, with the same key) a member here, in
        the run's order, and leave ``other`` empty: a pipelined replica's micro-batch,
        applied, rejoins the decoding requests not in flight (``StepBuilder.attach_run``).
        Counters and token times carry over; a few members join one by one, more in one
        sort and one array build."""
        moved = other.members
        if not moved:
            return
        tables = other.tables
        for req in moved:
            other._release(req)
        if len(moved) <= _JOINED_ONE_BY_ONE < len(self.members):
            for req, table in zip(moved, tables):
                self.join(req, table)
            other._forget_members()
            return
        for req in moved:
            self._adopt(req)
        members = self.members + moved
        all_tables = self.tables + tables
        n = len(members)
        key = self.key or _arrival_key
        perm = sorted(range(n), key=lambda i: key(members[i]))
        self.members[:] = [members[i] for i in perm]
        self.ids[:] = [r.request_id for r in self.members]
        self.tables[:] = [all_tables[i] for i in perm]
        cols = np.concatenate((self._cols, self._columns(moved, tables)), axis=1)
        self._cols = cols[:, perm]
        self._summarize()
        other._forget_members()

    def _forget_members(self) -> None:
        """Empty the run of members already released (the lists stay the same objects:
        a builder's view reads ``members``)."""
        self.members.clear()
        self.ids.clear()
        self.tables.clear()
        self._cols = self._cols[:, :0]
        self._summarize()
        self._trim()

    def reorder(self, order: list[Request]) -> bool:
        """Put the members in ``order``, if it holds each of them once (False, nothing
        changes, otherwise): a run kept in a policy's order whose keys moved past each other
        as they decoded. Members stay members, with the same counters and arrays."""
        n = len(self.members)
        if len(order) != n or any(r._run is not self for r in order):
            return False
        pos = dict(zip(self.ids, range(n)))
        perm = [pos[r.request_id] for r in order]
        if len(set(perm)) != n:
            return False
        self.members[:] = order
        ids, tables = self.ids, self.tables
        self.ids[:] = [ids[i] for i in perm]
        self.tables[:] = [tables[i] for i in perm]
        self._cols = self._cols[:, perm]
        return True

    def _summarize(self) -> None:
        if len(self.ctx0):
            self.next_bound = int(_min(self.bound))
            self.ctx0_sum = int(_sum(self.ctx0))
            self.ctx0_max = int(_max(self.ctx0))
        else:
            self.next_bound = self.ctx0_sum = self.ctx0_max = 0

    # ---- steps --------------------------------------------------------------------------
    def members_needing_blocks(self) -> np.ndarray | None:
        """Indices of the members whose next token needs a new KV block (one each), or None
        when none does (checked in O(1) before ``next_bound``)."""
        if self.steps < self.next_bound:
            return None
        bound = self._cols[2]
        need = (bound <= self.steps).nonzero()[0]
        if not len(need):
            self.next_bound = int(_min(bound)) if len(bound) else self.steps + 1
            return None
        return need

    def add_blocks(self, counts: np.ndarray) -> None:
        """Members got ``counts`` new blocks each."""
        bound = self._cols[2]
        bound += counts * self.block_size

    def add_block_each(self, indices: np.ndarray) -> None:
        """The members at ``indices`` (distinct) got one new block each."""
        self._cols[2][indices] += self.block_size

    def advance(self, end_times: array | list[float] | np.ndarray) -> np.ndarray:
        """Take ``len(end_times)`` run steps ending at those times (every member computes and
        samples one token per step). Returns the indices of members that sampled their last
        token in the final step."""
        self.take_steps(end_times)
        return (self._cols[1] == self.steps).nonzero()[0]

    def take_steps(self, end_times: array | list[float] | np.ndarray) -> None:
        """``advance`` without looking for who finished (a jump knows it already)."""
        if isinstance(end_times, np.ndarray):
            self._times.frombytes(end_times.tobytes())
        else:
            self._times.extend(end_times)
        self.steps += len(end_times)

    def steps_left(self) -> int:
        """Run steps until the first member samples its last token."""
        return int(_min(self._cols[1])) - self.steps

    def _trim(self) -> None:
        """Drop end times no member needs any more (bounded memory on long runs)."""
        if not self.members:
            self._base = self.steps
            del self._times[:]
        elif len(self._times) > 1 << 16:
            keep = min(r._joined for r in self.members)
            if keep - self._base > len(self._times) // 2:
                del self._times[:keep - self._base]
                self._base = keep


# ``absorb`` moves up to this many members into a larger run one by one (a binary search
# and an array insert each), more in one sort.
_JOINED_ONE_BY_ONE = 4


def _insert(a: np.ndarray, i: int, column: tuple[int, ...]) -> np.ndarray:
    """``a`` with ``column`` inserted before column ``i``."""
    out = np.empty((a.shape[0], a.shape[1] + 1), dtype=a.dtype)
    out[:, :i] = a[:, :i]
    out[:, i] = column
    if i < a.shape[1]:
        out[:, i + 1:] = a[:, i:]
    return out


def _limits(first: np.ndarray, k: int, last: np.ndarray | None) -> np.ndarray | int:
    """The last jump step in which each member computes a token: ``k``, or its own last
    step (``last``) when it finishes inside the jump."""
    return k if last is None else np.minimum(last, k)


def jump_block_steps(first: np.ndarray, block_size: int, k: int,
                     last: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The new KV blocks of steps 2..k of a decode jump whose members first need a new block
    in steps ``first`` (1-based) and compute their last token in steps ``last`` (default:
    all of them in every step): (step, member) pairs in the order the step-by-step loop
    allocates them (step by step, members in order), as two arrays."""
    lim = _limits(first, k, last)
    if k <= block_size:  # each member needs at most one
        member = (first <= lim).nonzero()[0]
        step = first[member]
        order = step.argsort(kind="stable")
        return step[order], member[order]
    count = np.where(first <= lim, (lim - first) // block_size + 1, 0)
    total = int(_sum(count))
    if total == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    member = np.arange(len(first), dtype=np.int64).repeat(count)
    offset = np.arange(total, dtype=np.int64) - (count.cumsum() - count).repeat(count)
    step = first[member] + block_size * offset
    # By step, members in order within a step: ``member`` ascends, so a stable sort by step
    # keeps that order (a third faster than lexsort on both keys).
    order = step.argsort(kind="stable")
    return step[order], member[order]


def jump_new_blocks(first: np.ndarray, block_size: int, k: int,
                    last: np.ndarray | None = None) -> int:
    """Total new KV blocks steps 2..k of that jump need."""
    lim = _limits(first, k, last)
    return int(_sum(np.where(first <= lim, (lim - first) // block_size + 1, 0)))
