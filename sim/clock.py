"""Events at exact clock values.

The fast path computes when a stretch of steps ends as a sum of step durations, and the
step-by-step loop reaches the same instant by adding one duration at a time. simpy schedules a
timeout at ``now + delay``; for the two paths to order events identically (an arrival at the
very instant a step ends, a transfer landing on a step boundary), the fast path's event must
fire at that sum to the last bit, not an ulp beside it. ``ChainEnvironment`` goes one further
for a process that sleeps through many steps: each step end keeps the place in the event order
its own timeout would have had, without being an event."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import simpy
from simpy.events import NORMAL


def exact_delay(start: float, end: float) -> float:
    """A delay d with ``start + d == end`` in floating point where one exists (else the
    nearest try): stepping d by ulps corrects the rounding of ``end - start``."""
    d = end - start
    for _ in range(4):
        got = start + d
        if got == end:
            break
        d = math.nextafter(d, math.inf if got < end else -math.inf)
    return d


def timeout_at(env: simpy.Environment, t: float) -> simpy.Event:
    """An event that fires at exactly ``t`` (>= now), ordered as a timeout scheduled now.

    It goes into the queue at ``t`` itself, with the priority and sequence number
    ``Environment.schedule`` gives a timeout made now: where a float delay ``d`` with
    ``now + d == t`` exists, that is the very entry ``env.timeout(d)`` would make, and where
    none does (a clock just below a power of two, a target far above it) it is the instant
    the step-by-step loop reaches (simpy has no public call that takes an absolute time)."""
    if t < env.now:
        raise ValueError(f"timeout_at({t!r}) is before the clock ({env.now!r})")
    ev = simpy.Event(env)
    ev._ok = True
    ev._value = None
    heapq.heappush(env._queue, (t, NORMAL, next(env._eid), ev))
    return ev


def advance(env: simpy.Environment, t: float) -> bool:
    """Move the clock to ``t`` (>= now) from inside the running process, as if a timeout of
    that process fired there, when nothing is scheduled at or before ``t``: no other process
    can run before then, so none can see the difference, and events scheduled after this
    (by the caller, or by callbacks it runs) get the places they would get had it yielded.
    False (the clock stays) when something is scheduled by then: the caller yields a timeout,
    which orders it against those events as ever. Saves a simpy event per step on a replica
    nothing else interleaves with."""
    queue = env._queue
    if queue and queue[0][0] <= t:
        return False
    if getattr(env, "chain_next", math.inf) <= t:  # a chain's step ends by then
        return False
    if t < env._now:
        raise ValueError(f"advance({t!r}) is before the clock ({env._now!r})")
    env._now = t
    return True


class PacedEnvironment(simpy.Environment):
    """An environment whose clock follows one outside it (online mode paces it to the wall
    clock): ``advance`` always declines, so every step end is an event in the queue, which
    the pacer releases when the outside clock reaches it; no process moves the clock ahead
    of the requests still to come."""

    chain_next = -math.inf  # what ``advance`` reads: something is always due first

    def run_until(self, t: float) -> None:
        """Process every event scheduled at or before ``t`` and leave the clock at ``t``
        (or where it is, if that is later)."""
        if t > self._now:
            self.run(until=t)
        while self._queue and self._queue[0][0] <= self._now:
            self.step()


class StepChain:
    """The ends of a run of steps a process has planned and sleeps through, passed without
    running it (``ChainEnvironment``). ``ends``: the end instants of steps 1..n, ascending.
    ``passed``: how many of them have gone by; ``wake``: the step at whose end the owner
    resumes (1-based; it may be brought forward while the owner sleeps, ``cut``)."""

    __slots__ = ("eid", "ends", "event", "passed", "stale", "wake")

    def __init__(self, ends: list[float]) -> None:
        self.ends = ends
        self.passed = 0
        # The event id of the end of step passed + 1: the id the timeout of that step would
        # get, taken when the step before it ended (or when the owner last ran: ``stale``).
        self.eid = 0
        self.stale = True
        self.wake = 0
        self.event: simpy.Event | None = None

    def cut(self, k: int) -> None:
        """The owner is to resume at the end of step ``k`` at the latest (``passed`` < k)."""
        if k <= self.passed:
            raise ValueError(f"step {k} of a chain has ended already ({self.passed} have)")
        if self.wake > k:
            self.wake = k

    def resumed(self) -> None:
        """The owner runs again, at the end of step ``wake``."""
        self.passed = self.wake
        self.stale = True
        self.event = None


class ChainEnvironment(simpy.Environment):
    """A simpy environment in which a process can sleep through a run of steps whose ends it
    knows (``StepChain``) and still have each end take its place in the event order, as the
    timeout of each step would: every step end takes an event id when the step before it
    ends, and comes before any event at the same instant with a later id. So anyone who looks
    at the owner's state at an instant where one of its steps ends knows whether that end came
    first (``StepChain.passed``), exactly as stepping would order the two, without the owner
    running there. The owner resumes only at the end it waits for."""

    def __init__(self, initial_time: float = 0) -> None:
        super().__init__(initial_time)
        # The chains whose owner sleeps and whose wake is not in the event queue yet, and the
        # earliest of their next step ends (inf without any).
        self.chains: list[StepChain] = []
        self.chain_next = math.inf

    def wait_chain(self, chain: StepChain, k: int) -> simpy.Event | None:
        """An event at the end of step ``k`` of ``chain`` for its owner (the running process)
        to yield, or None where nothing else happens by then: the clock is moved there, as
        ``advance`` does."""
        if chain.stale:  # the next step is scheduled now, as a timeout would be
            chain.eid = next(self._eid)
            chain.stale = False
        t = chain.ends[k - 1]
        queue = self._queue
        if (not queue or queue[0][0] > t) and self.chain_next > t:
            chain.wake = k
            chain.resumed()
            self._now = t
            return None
        ev = simpy.Event(self)
        ev._ok = True
        ev._value = None
        chain.wake = k
        chain.event = ev
        if chain.passed == k - 1:
            heapq.heappush(queue, (t, NORMAL, chain.eid, ev))
        else:
            self.chains.append(chain)
            nxt = chain.ends[chain.passed]
            if nxt < self.chain_next:
                self.chain_next = nxt
        return ev

    def step(self) -> None:
        if self.chains:
            queue = self._queue
            if not queue or queue[0][0] >= self.chain_next:
                self._pass_ends()
        super().step()

    def _pass_ends(self) -> None:
        """Let every chain end that comes before the queue's next event go by, and put the
        wakes whose turn has come into the queue."""
        queue, chains, eids = self._queue, self.chains, self._eid
        while chains:
            top = queue[0] if queue else None
            t = top[0] if top is not None else math.inf
            for c in chains:
                w = c.ends[c.wake - 1]
                if w < t:
                    t = w
            # The ends before t wake no one: they go by together, and each chain's next end
            # takes its id at the last of its ends that went by, in the order those came (a
            # tie between two chains' last ends is taken one end at a time).
            moved: list[tuple[float, StepChain, int]] = []
            for c in chains:
                p = c.passed
                ends = c.ends
                if ends[p] < t:
                    j = bisect.bisect_left(ends, t, p, c.wake - 1)
                    moved.append((ends[j - 1], c, j))
            if moved:
                if len(moved) > 1:
                    moved.sort(key=lambda m: m[0])
                    if any(a[0] == b[0] for a, b in itertools.pairwise(moved)):
                        c = min((m[1] for m in moved), key=lambda c: (c.ends[c.passed], c.eid))
                        c.passed += 1
                        c.eid = next(eids)
                        continue
                for _, c, j in moved:
                    c.passed = j
                    c.eid = next(eids)
            # At t itself: the chains' ends there and the queue's next event, by id.
            first = None
            for c in chains:
                if c.ends[c.passed] == t and (first is None or c.eid < first.eid):
                    first = c
            if first is None or (top is not None and top[0] == t
                                 and (top[1], top[2]) < (NORMAL, first.eid)):
                break
            if first.passed == first.wake - 1:
                heapq.heappush(queue, (t, NORMAL, first.eid, first.event))
                chains.remove(first)
            else:
                first.passed += 1
                first.eid = next(eids)
        self.chain_next = min((c.ends[c.passed] for c in chains), default=math.inf)
