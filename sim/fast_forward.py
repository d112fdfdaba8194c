"""Decode jumps: take many identical decode-only steps as one simulation event.

Between two events that can change a batch (an arrival anywhere in the cluster, a request
finishing, the KV pool running dry), a decode-only batch keeps its membership: every step
each member gains one token and its context grows by one. The executor gives the durations of
those steps in closed form, so K steps cost one numpy evaluation instead of K trips through the
policy. Timestamps inside the jump are the same cumulative sums the step-by-step loop would
compute, so results match ``step_mode=exact`` (tests assert it for every policy).

The jump ends at the first of:
- the step in which some member produces its last token (it finishes after that step), unless
  the jump may run past finishes (below);
- the last step whose new KV blocks still fit the free pool (the next would need a preemption);
  with prefix caching on while requests wait, the last whose new blocks evict no cached
  content (an eviction can change what a waiting request's cache hit costs, and so whether
  the policy admits it: ``KVBlockManager.free_without_eviction``);
- the last step that starts before the next external event (``horizon``): an arrival, which
  may change what the policy schedules or what a router sees, or a deadline of the policy's
  own (``Policy.next_decision_time``: SJF's aging) if that comes first.

**Past finishes.** When the plan is the whole decode run, every running request is a member
and nothing waits or is swapped out, a policy that states ``Policy.supports_decode_jumps``
plans the same run minus the finished members after a finish (no one can take the freed
seat or blocks). The jump then goes on through
finishes: it is priced one step at a time as far as the horizon
(``Executor.decode_step_pricer``), or, for batches without a plain-float price, as stretches
of equal membership (``Executor.decode_stretch_durations``), and the replica stops at the end
of each step in which members finish, to finish them at
their exact time (so routers, callbacks and ``requests.csv`` see what step-by-step
simulation shows), without planning or pricing anything there.

**Pricing.** A jump of the decode run is priced one step at a time, as far as the horizon,
wherever the executor has a plain-float price for the batch (``Executor.decode_step_pricer``);
otherwise, and for a plan of single rows, in one array call (``Executor.decode_durations``,
sized on a first estimate).

**Lazy decode.** A replica in a cluster need not stop where another replica's step ends or
where a request arrives that the router sends elsewhere: only what reaches it can change its
plan. A co-located replica is reached by the requests routed to it; a disaggregated decode
replica by the transfers reserved on it at a handoff (``Replica.reserve_transfer``) and
arriving at it (``Replica.accept_transferred``). Its count changes only at its own finishes
and those arrivals, and a router that reads its KV use or cache first has the steps begun take
their blocks (``Replica.kv_usage``, ``Replica.cached_prefix_tokens``). In a closed loop its
jumps end at its first finish (which brings a turn), and a co-located replica's before the
next arrival known when they start. It sleeps through its jump as a chain of
step ends (``sim/clock.py``: ``ChainEnvironment``, ``StepChain``): each step end takes its
event id when the step before it ends and comes before any event at that instant with a later
id, as the step's timeout would, so at every instant the replica's steps that have ended are
those stepping shows (ties to the last bit included), and its stops and end wake it in
stepping's order. A request routed to it ends the jump with the step in progress, as does an
arriving transfer. A reservation first takes the new blocks of the steps that have started
(each took them as it started), then reserves: it gets the block ids, and sees the free count,
of stepping. The jump goes on while its later steps' blocks fit what is left free (the batch
is the same, and free blocks only shrink, as they do in any jump: the policy plans the same
step while its blocks fit, ``Policy.supports_decode_jumps``), ends before the first step whose
blocks do not, and ends with the step in progress if the reservation fails (its finishes must
then reserve for the transfers that wait). The jump is priced as far as the N-th next arrival
for N co-located replicas (``UpcomingArrivals``), or a decode replica's next transfer arrival
or a few arrivals ahead (``Disaggregated.lazy_decode_horizon``): any end is exact.
(Pipelined replicas repeat micro-batches instead, up to every arrival and, on the decode side,
``Disaggregated.decode_horizon``.)
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate

import numpy as np

from sim.decode_run import DecodeRun, jump_block_steps, jump_new_blocks
from sim.plan import StepPlan
from sim.request import Request

# The most steps one jump takes (a bound on pricing ahead, not a result: a longer stretch
# simply takes two jumps).
MAX_JUMP_STEPS = 1 << 16
# Reductions without numpy's Python wrappers (``a.min()``), which cost as much on a batch.
_min, _max = np.minimum.reduce, np.maximum.reduce


def is_steady_decode(plan: StepPlan) -> bool:
    """Every row computes exactly its one pending token and samples, with no KV movement:
    the shape that repeats unchanged while nothing external happens."""
    if plan.swap_in or plan.swap_out or plan.recomputed or plan.swapped_out or plan.admitted:
        return False
    if plan.num_blocks:
        # The whole decode run alone; a block next to other rows is stepped singly (it is
        # never expanded here: that would dissolve the run).
        return plan.decode_block is not None
    return all(s.num_new_tokens == 1 and s.sample and s.start_position > 0
               for s in plan.scheduled)


class Jump:
    """A planned decode jump (see the module docstring); attributes below."""

    __slots__ = (
        "batch_sizes",
        "block_members",
        "block_owners",
        "block_step_array",
        "block_steps",
        "durations",
        "ends",
        "finishing",
        "freed",
        "groups",
        "last_members",
        "num_steps",
        "stops",
    )

    def __init__(self, num_steps: int, durations: np.ndarray, ends: np.ndarray,
                 block_step_array: np.ndarray, block_members: np.ndarray | None = None,
                 stops: list[int] | None = None, batch_sizes: list[int] | None = None,
                 freed: list[int] | None = None, block_steps: list[int] | None = None,
                 block_owners: list[int] | None = None, finishing: list[int] | None = None,
                 last_members: list[int] | None = None,
                 groups: list[tuple[int, list[int]]] | None = None) -> None:
        self.num_steps = num_steps
        self.durations = durations  # [num_steps]
        self.ends = ends  # [num_steps] absolute end time of each step
        # The step (1-based, ascending) of each new KV block of steps 2..k (the blocks each
        # step allocates: ``new_blocks``).
        self.block_step_array = block_step_array
        # The rows (indices into the plan's rows or the run's members) that get the new KV
        # blocks of steps 2..k, in the order the step-by-step loop allocates them (step by
        # step, rows in order), so a jump hands out exactly the block ids single steps would.
        self.block_members = block_members
        # A decode-run jump past finishes: the jump steps (1-based, ascending, before the
        # last) at whose end some members finish while the others go on; the batch size of
        # each step; and (filled in at the stops) the blocks freed at each of them.
        self.stops = [] if stops is None else stops
        self.batch_sizes = batch_sizes
        self.freed = [] if freed is None else freed
        # The step of each of ``block_members``' new blocks (ascending; a list, searched with
        # bisect at every stop), to allocate them stretch by stretch, and (filled in when the
        # jump starts) the request ids of their owners.
        self.block_steps = block_steps
        self.block_owners = [] if block_owners is None else block_owners
        # A decode-run jump: the members (run indices, ascending) that finish in it, and those
        # of them that finish in its last step.
        self.finishing = [] if finishing is None else finishing
        self.last_members = [] if last_members is None else last_members
        # The stops with the members (run indices, ascending) that finish at each, in step
        # order.
        self.groups = [] if groups is None else groups

    def new_blocks(self) -> np.ndarray:
        """[num_steps] KV blocks newly allocated in each step (for ``steps.csv``)."""
        k = self.num_steps
        return np.bincount(self.block_step_array - 1, minlength=k)[:k]

    def truncate(self, k: int) -> None:
        """Keep only the first ``k`` steps (1 <= k <= num_steps): the jump that planning with
        a horizon just after step k's start gives (step durations do not depend on how many
        steps are planned). Stops before step k stay; members whose last step is step k
        finish at the jump's end; nobody else finishes. Blocks and owners already known keep
        their allocation order (a prefix of it). ``freed`` holds only stops already passed,
        which are before k."""
        if k >= self.num_steps:
            return
        if k < 1:
            raise ValueError(f"a jump keeps at least one step, got {k}")
        self.num_steps = k
        self.durations = self.durations[:k]
        self.ends = self.ends[:k]
        n = int(self.block_step_array.searchsorted(k, side="right"))
        self.block_step_array = self.block_step_array[:n]
        if self.block_members is not None:
            self.block_members = self.block_members[:n]
        if self.block_steps is not None:
            self.block_steps = self.block_steps[:n]
        if self.block_owners:
            self.block_owners = self.block_owners[:n]
        if self.batch_sizes is not None:
            self.batch_sizes = self.batch_sizes[:k]
        kept = [(s, members) for s, members in self.groups if s < k]
        last = [members for s, members in self.groups if s == k]
        self.groups = kept
        self.stops = [s for s, _ in kept]
        self.last_members = last[0] if last else []
        self.finishing = sorted([m for _, members in kept for m in members]
                                + self.last_members)


class UpcomingArrivals:
    """The workload's requests in arrival order, read a few ahead of the arrival process, so
    that lazy replicas (module docstring) can price their jumps a few arrivals ahead. The
    workload is a lazy, seeded stream: reading a request early changes nothing else."""

    def __init__(self, requests: Iterable[Request]) -> None:
        self._it: Iterator[Request] = iter(requests)
        self._ahead: deque[Request] = deque()
        # The time of the arrival the arrival process waits for (inf before and after).
        self.next_time = math.inf

    def pop(self) -> Request | None:
        """The next request (its time becomes ``next_time``), or None when none is left."""
        req = self._ahead.popleft() if self._ahead else next(self._it, None)
        self.next_time = math.inf if req is None else req.arrival_time
        return req

    def time(self, i: int) -> float:
        """The time of upcoming arrival ``i`` (0: ``next_time``), inf past the last."""
        if i == 0:
            return self.next_time
        ahead = self._ahead
        while len(ahead) < i:
            req = next(self._it, None)
            if req is None:
                return math.inf
            ahead.append(req)
        return ahead[i - 1].arrival_time


def _price_until(price, start: float, length: int, horizon: float,
                 d_est: float = 0.0) -> tuple[list[float], list[float]] | None:
    """Durations and end times of up to ``length`` steps from ``start``, priced by
    ``price(m)`` only as far as the horizon needs. Most jumps end at the next arrival, a few
    steps away: price a few steps first (or as many as ``d_est``, a recent step time, says
    reach the horizon, with a quarter to spare), then, if the horizon is further, as many as
    can start before it. Step durations rarely shrink as contexts grow, so about
    (horizon - start) / first duration + 1 steps start before it; a jump that falls short
    only ends earlier (the next one goes on). Plain lists: a stretch is a few steps, and a
    list is cheaper to extend, search and add up than an array is to build."""
    m = min(length, 8 if d_est <= 0 or math.isinf(horizon) else
            int((horizon - start) / d_est * 1.25) + 2)
    stretch = _priced_stretch(price, m, start)
    if stretch is None:
        return None
    durations, ends = stretch
    if m < length and ends[-1] < horizon:
        d1 = durations[0]
        m = length if d1 <= 0 or math.isinf(horizon) else (
            min(length, int((horizon - start) / d1) + 2))
        if m > len(durations):
            stretch = _priced_stretch(price, m, start)
            if stretch is None:
                return None
            durations, ends = stretch
    return durations, ends


def _priced_stretch(price, m: int, start: float) -> tuple[list[float], list[float]] | None:
    """``price(m)``'s durations and their end times from ``start``, or None."""
    priced = price(m)
    if priced is None:
        return None
    durations = priced.tolist()
    # Same sequential float additions as env.now += duration, step after step (and as
    # np.cumsum, which adds left to right).
    ends = list(accumulate(durations, initial=start))
    del ends[0]
    return durations, ends


def _steps_before(ends: list[float], horizon: float) -> int:
    """How many steps of a jump with these end times (ascending) start strictly before the
    horizon (a step starting at or after it may see an arrival first). Step 1 always
    belongs."""
    return min(len(ends), 1 + bisect.bisect_left(ends, horizon, 0, len(ends) - 1))


def _jump_length(durations_fn, plan: StepPlan, k_max: int, start: float,
                 horizon: float) -> tuple[int, np.ndarray, np.ndarray] | None:
    priced = _price_until(lambda m: durations_fn(plan, m), start, k_max, horizon)
    if priced is None:
        return None
    durations, ends = priced
    k = _steps_before(ends, horizon)
    if k < 2:
        return None
    return k, np.array(durations[:k]), np.array(ends[:k])


def plan_run_jump(plan: StepPlan, run: DecodeRun, run_step: int, durations_fn,
                  start: float, horizon: float, free_blocks: int,
                  max_steps: int = MAX_JUMP_STEPS, stretch_durations_fn=None,
                  step_pricer=None) -> Jump | None:
    """``plan_jump`` for a plan that is one decode block scheduling the whole decode run
    ``run`` at its step ``run_step``: the same jump, from the run's arrays (no per-row work).
    With ``stretch_durations_fn`` (``Executor.decode_stretch_durations``) the jump may run past
    finishes (module docstring); the caller passes it only when that is safe. ``step_pricer``
    (``Executor.decode_step_pricer``), if given, prices its steps one at a time."""
    # Run step s computes each member's token ctx0 + s + 1; this plan is run step
    # ``run_step``, so jump step j (1-based) first needs a new block when
    # run_step + j - 1 >= bound.
    first = run.bound - (run_step - 1)
    if stretch_durations_fn is not None:
        return _run_jump_past_finishes(run_step, run, first, stretch_durations_fn, start,
                                       horizon, free_blocks, max_steps, step_pricer)
    k_max = min(run.steps_left(), max_steps)
    if k_max < 2:
        return None
    price = None if step_pricer is None else step_pricer(len(run))
    if price is not None:
        # Contexts (new token included) of jump step j: ctx0 + run_step + j per member.
        n = len(run)
        price = _stepwise(price, run.ctx0_sum + n * (run_step + 1), n,
                          run.ctx0_max + run_step + 1)
    jump = _sized_jump(plan, first, run.block_size, durations_fn, k_max, start, horizon,
                       free_blocks, price)
    if jump is not None:  # members finish only in its last step
        jump.finishing = jump.last_members = (
            run.end <= run_step + jump.num_steps).nonzero()[0].tolist()
    return jump


def _kv_cap(first: np.ndarray, bs: int, k_max: int, free_blocks: int,
            last: np.ndarray | None = None) -> int:
    """The largest k <= k_max whose steps 2..k get their new blocks from the free pool."""
    if len(first) * (k_max // bs + 1) <= free_blocks or (
            jump_new_blocks(first, bs, k_max, last) <= free_blocks):
        return k_max
    lo, hi = 1, k_max  # step 1's blocks are the plan's
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if jump_new_blocks(first, bs, mid, last) <= free_blocks:
            lo = mid
        else:
            hi = mid
    return lo


class _Stretches:
    """The stretches of equal membership of a decode-run jump past finishes, priced on
    demand into one list of step durations and one of end times (global jump steps 1, 2,
    ...). A step's price does not depend on how many steps are priced with it, so pricing
    many stretches in one call (``Executor.decode_stretch_durations``) gives the floats
    pricing them one at a time gives, and the end times are the same sequential additions
    from the jump's start."""

    def __init__(self, run: DecodeRun, last: np.ndarray, s0: int, k_max: int,
                 price, start: float) -> None:
        self.run, self.last, self.s0, self.k_max, self.price = run, last, s0, k_max, price
        self.n = len(last)
        self.first_finish = int(_min(last))
        self.start = start
        self.durations: list[float] = []
        self.ends: list[float] = []
        # Members sorted by last step (stable: ascending index among equals) and their ctx0
        # in that order: made only when a stretch after the first is needed.
        self.order: list[int] | None = None
        self.last_sorted: list[int] = []
        self.ctx_sorted: list[int] = []

    def sort(self) -> None:
        order = self.last.argsort(kind="stable")
        self.last_sorted = self.last[order].tolist()
        self.ctx_sorted = self.run.ctx0[order].tolist()
        self.order = order.tolist()

    def members_after(self, i: int) -> tuple[int, int]:
        """Sum and maximum of ctx0 over the members left once the first ``i`` in finishing
        order are gone: the run's own, less the few gone (a maximum is looked for again only
        if its member left)."""
        run = self.run
        if not i:
            return run.ctx0_sum, run.ctx0_max
        gone = self.ctx_sorted[:i]
        mx = run.ctx0_max
        if mx in gone:
            mx = max(self.ctx_sorted[i:])
        return run.ctx0_sum - sum(gone), mx

    def at(self, j: int) -> tuple[int, int]:
        """(members gone before jump step ``j``, the last step of ``j``'s stretch, uncapped)."""
        if j <= self.first_finish:
            return 0, self.first_finish
        if self.order is None:
            self.sort()
        i = bisect.bisect_left(self.last_sorted, j)
        return i, self.last_sorted[i] if i < self.n else self.k_max

    def price_to(self, b: int) -> bool:
        """Price jump steps up to ``b`` (at most ``k_max``); False if the executor cannot."""
        s0, n = self.s0, self.n
        j = len(self.durations) + 1
        b = min(b, self.k_max)
        if j > b:
            return True
        parts = []
        while j <= b:
            i, f = self.at(j)
            f = min(f, b)
            nd = n - i
            ctx, mx = self.members_after(i)
            # Context (new token included) in step j: ctx0 + s0 + j per member.
            parts.append((nd, ctx + nd * (s0 + j), mx + s0 + j, f - j + 1))
            j = f + 1
        priced = self.price(parts)
        if priced is None:
            return False
        self.durations += priced
        # Same sequential float additions as env.now += duration, step after step (and as
        # np.cumsum, which adds left to right).
        ends = list(accumulate(priced, initial=self.ends[-1] if self.ends else self.start))
        del ends[0]
        self.ends += ends
        return True

    def price_steps(self, pricer_for, horizon: float) -> bool:
        """Price jump steps one at a time, ``pricer_for(rows)(ctx, mx)`` each
        (``Executor.decode_step_pricer``), up to the first that ends at or after the horizon,
        or ``k_max``: every step priced starts before the horizon, and none past it is. False
        (nothing priced) if some stretch's batch has no such pricer."""
        s0, n, k = self.s0, self.n, self.k_max
        durations, ends = self.durations, self.ends
        t = self.start
        j = 1
        while True:
            i, f = self.at(j)
            nd = n - i
            price = pricer_for(nd)
            if price is None:
                durations.clear()
                ends.clear()
                return False
            ctx, mx = self.members_after(i)
            # Steps j..f have one membership: contexts (new token included) ctx0 + s0 + j.
            f = min(f, k)
            c, x = ctx + nd * (s0 + j), mx + s0 + j
            while True:
                d = price(c, x)
                t += d  # the same sequential additions as env.now += duration
                durations.append(d)
                ends.append(t)
                if t >= horizon or j == k:
                    return True
                j += 1
                if j > f:
                    break
                c += nd
                x += 1


def _price_jump_stretches(st: _Stretches, run: DecodeRun, horizon: float,
                          k_max: int) -> int | None:
    """Price a jump past finishes stretch by stretch with ``Executor.decode_stretch_durations``
    (where no per-step pricer serves); returns how many steps are priced, None if the
    executor cannot price them."""
    start = st.start
    inf = math.isinf(horizon)
    # How far the jump goes is decided stretch by stretch, as _price_until decides it for
    # each (a first estimate, then as many steps as can start before the horizon); the
    # steps are priced ahead in one call, as many as the last jump's step time says reach
    # the horizon, and at least the first stretch's first estimate (a step's price does not
    # depend on it: only the number of calls does; one call per jump in 99.7% of them).
    d_prev = run.last_jump_step_time
    if not st.price_to(k_max if inf else 8 if d_prev <= 0 else
                       max(min(st.first_finish, 8), int((horizon - start) / d_prev * 1.15) + 3)):
        return None
    durations, ends = st.durations, st.ends
    t = start
    j0 = 1  # the stretch starts at jump step j0
    d_last = 0.0
    p = 0  # steps priced for the jump
    while j0 <= k_max:
        f = min(st.at(j0)[1], k_max)  # the stretch ends with step f
        length = f - j0 + 1
        # The last stretch's step time estimates this one's (it has fewer rows).
        m = min(length, 8 if d_last <= 0 or inf else
                int((horizon - t) / d_last * 1.25) + 2)
        if j0 - 1 + m > len(durations) and not st.price_to(max(j0 - 1 + m, 2 * len(ends))):
            return None
        if m < length and ends[j0 - 2 + m] < horizon:
            d1 = durations[j0 - 1]
            m2 = length if d1 <= 0 or inf else min(length, int((horizon - t) / d1) + 2)
            if m2 > m:
                m = m2
                if j0 - 1 + m > len(durations) and not st.price_to(
                        max(j0 - 1 + m, 2 * len(ends))):
                    return None
        p = j0 - 1 + m
        d_last = durations[p - 1]
        if ends[p - 1] >= horizon or m < length or f >= k_max:
            break
        t = ends[p - 1]
        j0 = f + 1
    run.last_jump_step_time = d_last
    return p


def _run_jump_past_finishes(s0: int, run: DecodeRun, first: np.ndarray,
                            stretch_durations_fn, start: float, horizon: float,
                            free_blocks: int, max_steps: int,
                            step_pricer=None) -> Jump | None:
    last = run.end - s0  # the jump step in which each member samples its last token (>= 1)
    bs = run.block_size
    # Blocks freed by finishing members go to the back of the free queue and the jump's
    # blocks come from its front, so as long as they fit the blocks free now, the jump hands
    # out exactly the blocks step-by-step allocation would (stretch by stretch, so the pool's
    # peak use is the same too).
    k_max = _kv_cap(first, bs, min(int(_max(last)), max_steps), free_blocks, last)
    if k_max < 2:
        return None
    st = _Stretches(run, last, s0, k_max, stretch_durations_fn, start)
    if step_pricer is not None and st.price_steps(step_pricer, horizon):
        # Every step that starts before the horizon, priced and no more.
        p = len(st.durations)
        run.last_jump_step_time = st.durations[-1]
    else:
        p = _price_jump_stretches(st, run, horizon, k_max)
        if p is None:
            return None
    durations, ends = st.durations, st.ends
    # Steps that start strictly before the horizon (_steps_before over the priced ones).
    k = min(p, 1 + bisect.bisect_left(ends, horizon, 0, p - 1))
    if k < 2:
        return None
    steps, members = jump_block_steps(first, bs, k, last)
    durations_k, ends_k = np.array(durations[:k]), np.array(ends[:k])
    first_finish = st.first_finish
    if k <= first_finish:  # nobody finishes before the last step: a plain jump
        done = (last == k).nonzero()[0].tolist() if k == first_finish else []
        return Jump(k, durations_k, ends_k, steps, members, finishing=done,
                    last_members=done)
    # Who finishes where, from the members sorted by last step (ascending index among
    # equals, the order they finish in): the stops before the last step, the batch size of
    # every step (the members whose last step is it or later), and the last step's members.
    if st.order is None:
        st.sort()
    last_sorted = st.last_sorted
    cnt = bisect.bisect_right(last_sorted, k)
    order = st.order[:cnt]  # type: ignore[index]
    groups: list[tuple[int, list[int]]] = []
    sizes: list[int] = []
    size, prev, g = st.n, 0, 0
    while g < cnt:
        f = last_sorted[g]
        h = bisect.bisect_right(last_sorted, f, g, cnt)
        if f == k:
            break
        sizes += [size] * (f - prev)
        size -= h - g
        prev = f
        groups.append((f, order[g:h]))
        g = h
    sizes += [size] * (k - prev)
    jump = Jump(k, durations_k, ends_k, steps, members, [f for f, _ in groups], sizes,
                block_steps=steps.tolist(), finishing=sorted(order),
                last_members=order[g:cnt], groups=groups)
    return jump


def _stepwise(price: Callable[[int, int], float], ctx: int, nd: int, mx: int,
              ) -> Callable[[float, float, int], tuple[list[float], list[float]]]:
    """Price a plain jump's steps one at a time (``Executor.decode_step_pricer``): step 1's
    contexts total ``ctx`` (the longest ``mx``), each step adds ``nd`` and 1. The returned
    function gives the durations and end times from ``start`` of the steps up to the first
    that ends at or after ``horizon``, or ``k`` steps."""

    def steps(start: float, horizon: float, k: int) -> tuple[list[float], list[float]]:
        durations: list[float] = []
        ends: list[float] = []
        t = start
        c, x = ctx, mx
        for _ in range(k):
            d = price(c, x)
            t += d  # the same sequential additions as env.now += duration
            durations.append(d)
            ends.append(t)
            if t >= horizon:
                break
            c += nd
            x += 1
        return durations, ends
    return steps


def _sized_jump(plan: StepPlan, first: np.ndarray, bs: int, durations_fn, k_max: int,
                start: float, horizon: float, free_blocks: int,
                stepwise=None) -> Jump | None:
    """The jump for rows that first need a new KV block in steps ``first`` (1-based);
    ``stepwise`` (``_stepwise``), if given, prices its steps one at a time."""
    if stepwise is not None:
        # Priced as far as the horizon first: the free blocks then cap only the steps that
        # start before it (the largest k that fits is the same, found over fewer steps).
        durations, ends = stepwise(start, horizon, k_max)
        k = _kv_cap(first, bs, _steps_before(ends, horizon), free_blocks)
        sized = None if k < 2 else (k, np.array(durations[:k]), np.array(ends[:k]))
    else:
        k_max = _kv_cap(first, bs, k_max, free_blocks)
        if k_max < 2:
            return None
        sized = _jump_length(durations_fn, plan, k_max, start, horizon)
    if sized is None:
        return None
    k, durations, ends = sized
    steps, members = jump_block_steps(first, bs, k)
    return Jump(k, durations, ends, steps, members)


def plan_jump(plan: StepPlan, requests: list[Request], durations_fn, start: float,
              horizon: float, free_blocks: int, block_size: int,
              max_steps: int = MAX_JUMP_STEPS,
              order_steps: Callable[[list[Request], int], int] | None = None) -> Jump | None:
    """Size a jump starting with ``plan`` at time ``start``; None if it would be one step.
    ``order_steps(requests, limit)``: how many steps keep the rows in their order
    (``Policy.decode_order_steps``; default: all)."""
    remaining = min(r.max_output_len - r.num_output_tokens for r in requests)
    k_max = min(remaining, max_steps)
    if k_max < 2:
        return None
    if order_steps is not None:
        # Every step's new blocks go to the rows in this order, and the last step's
        # finishers finish in it: the jump ends before a step whose order differs.
        k_max = order_steps(requests, k_max)
        if k_max < 2:
            return None
    ctx = np.fromiter((s.start_position for s in plan.scheduled), dtype=np.int64,
                      count=len(plan.scheduled))
    have = np.fromiter((len(s.block_table) for s in plan.scheduled), dtype=np.int64,
                       count=len(plan.scheduled))

    # KV: jump step j computes each row's token ctx + j; a row first needs a new block in
    # step have x block_size - ctx + 1 (step 1's blocks are the plan's), then every
    # block_size steps. Take the largest k whose new blocks fit the free pool.
    first = have * block_size - ctx + 1
    return _sized_jump(plan, first, block_size, durations_fn, k_max, start, horizon,
                       free_blocks)

