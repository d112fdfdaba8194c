"""Events at exact clock values.

The fast path computes when a stretch of steps ends as a sum of step durations, and the
step-by-step loop reaches the same instant by adding one duration at a time. simpy schedules a
timeout at ``now + delay``; for the two paths to order events identically (an arrival at the
very instant a step ends, a transfer landing on a step boundary), the fast path's event must
fire at that sum to the last bit, not an ulp beside it."""

from __future__ import annotations

import heapq
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
    if t < env._now:
        raise ValueError(f"advance({t!r}) is before the clock ({env._now!r})")
    env._now = t
    return True
