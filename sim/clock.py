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

    For some pairs (a clock just below a power of two, a target far above it) no float delay
    lands on ``t``; the event then goes into the queue at ``t`` itself, with the priority and
    sequence number ``Environment.schedule`` would give a timeout (simpy has no public call
    that takes an absolute time)."""
    if t < env.now:
        raise ValueError(f"timeout_at({t!r}) is before the clock ({env.now!r})")
    d = exact_delay(env.now, t)
    if env.now + d == t:
        return env.timeout(d)
    ev = simpy.Event(env)
    ev._ok = True
    ev._value = None
    heapq.heappush(env._queue, (t, NORMAL, next(env._eid), ev))
    return ev
