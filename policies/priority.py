"""Priority scheduling as vLLM's ``--scheduling-policy priority``: a LOWER ``priority`` value
is served EARLIER (class 0 first), ties by arrival time.

Admission in (priority, arrival) order; with ``preemptive`` (the default, as vLLM) a waiting
request that does not fit preempts running requests of strictly lower priority (higher value),
lowest priority and latest arrival first, when that makes it fit. Running requests decode in
priority order and the memory-pressure victim is the lowest-priority, latest-arrived one;
swapped requests resume in priority order. Steps otherwise as ``fcfs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import POLICIES, PolicyConfig
from policies.ordered import OrderedPolicy
from sim.request import Request


@dataclass(frozen=True)
class PriorityConfig(PolicyConfig):
    name: str = "priority"
    preemptive: bool = True  # a higher class may preempt a lower one


@POLICIES.register("priority")
class PriorityPolicy(OrderedPolicy):
    config_class = PriorityConfig
    config: PriorityConfig
    # Decode jumps, also past finishes: checked against exact mode in tests/test_fast_forward.py;
    # the array core: tests/test_array_core.py.
    supports_decode_jumps = True
    array_core = True

    def waiting_key(self, req: Request) -> tuple[int, float, int]:
        return (req.priority, req.arrival_time, req.request_id)

    running_key = waiting_key

    def order_fixed_while_decoding(self) -> bool:
        return True  # classes and arrival times do not move

    def may_preempt(self, candidate: Request, victim: Request) -> bool:
        return victim.priority > candidate.priority

    def may_preempt_to_admit(self, priorities: Sequence[int]) -> bool:
        # Only a strictly lower class can be displaced: one class alone never is.
        return self.config.preemptive and len(set(priorities)) > 1
