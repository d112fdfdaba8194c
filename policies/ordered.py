"""FCFS's step structure with the waiting queue in a policy's own order (SJF, priority).

The order lives in a ``WaitingHeap`` fed by ``on_arrival`` and by the policy's own
preemptions (``requeue``), so no step sorts the whole waiting queue. Admission stays strict:
it stops at the first request in order that does not fit, as vLLM's priority scheduler does,
so a big request at the head is never bypassed forever by smaller ones behind it; a
subclass that sets ``strict_order = False`` lets later ones that fit go ahead of one that
does not (on both engines: the admission rule is the same). With
``preemptive`` the head of the queue may displace running requests the subclass allows
(``may_preempt``), most preemptible first, but only when that makes it fit.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from itertools import takewhile
from typing import Any, ClassVar

from policies.base import PolicyConfig
from policies.budget import (
    Budget,
    VictimPicker,
    admission_rule,
    admit,
    counted_room,
    preempt_for,
    victim_from_end,
)
from policies.fcfs import FCFSPolicy
from policies.queues import WaitingHeap
from sim.request import Request, RequestStatus
from sim.step_builder import StepBuilder


def _pending(req: Request) -> int:
    return req.num_pending_tokens


class OrderedPolicy(FCFSPolicy):
    # No fast-path flags of its own (Policy.__init_subclass__): each ordered policy states
    # its own. On the array core it admits through ``indexed_admissions`` (its own order),
    # and its rows and victims follow ``decode_run_key``, as its hooks below order them.
    core_follows_hooks = True
    #: Admission stops at the first request in ``waiting_key`` order that does not fit
    #: (True), or skips it and goes on with the next (False: head-of-line bypass).
    strict_order: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.queue = WaitingHeap(self.waiting_key)

    # ---- what a subclass defines ----------------------------------------------------------
    @abstractmethod
    def waiting_key(self, req: Request) -> Any:
        """Admission order: smallest first."""

    @abstractmethod
    def running_key(self, req: Request) -> Any:
        """Running order: smallest gets its tokens first; the largest is preempted first."""

    def may_preempt(self, candidate: Request, victim: Request) -> bool:
        """Whether waiting ``candidate`` may displace running ``victim`` (if preemptive).
        Monotone in ``running_key``: if it allows a victim, it allows every running request
        with a larger key (the victims are walked largest first, up to the first refused)."""
        return False

    def index(self, req: Request) -> None:
        """``req`` (again) waits: put it in the policy's index."""
        self.queue.push(req)

    def candidates(self, now: float, in_order: Iterator[Request]) -> Iterator[Request]:
        """The admission sequence at simulated time ``now``; ``in_order`` walks
        ``self.queue``."""
        return in_order

    def may_preempt_to_admit(self, priorities: Sequence[int]) -> bool:
        return bool(getattr(self.config, "preemptive", False))

    # ---- FCFS hooks -----------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        self.index(req)

    def on_handoff(self, req: Request) -> None:
        self.unindex(req)

    def unindex(self, req: Request) -> None:
        """``req`` left this replica: drop it from the policy's index."""
        self.queue.discard(req)

    def requeue(self, preempted: list[Request]) -> None:
        for req in preempted:
            if req.status is RequestStatus.PREEMPTED:  # recomputed: waiting again
                self.index(req)

    def admit_waiting(self, step: StepBuilder, budget: Budget) -> list[Request]:
        with self.queue.ordered() as in_order:
            candidates = self.candidates(step.now, in_order)
            if getattr(self.config, "preemptive", False):
                candidates = self._making_room(step, budget, candidates)
            with closing(candidates) as c:  # type: ignore[type-var]
                return admit(step, budget, c, strict_order=self.strict_order)

    def indexed_admissions(self, now: float, seats: int,
                           room: tuple[int, int, int] | None = None) -> list[Request]:
        """The array core's admission (sim/array_core.py): the waiting requests (indexed by
        ``on_arrival`` and ``requeue``) that a step planned at ``now`` admits with ``seats``
        free seats, in admission order, each moved to RUNNING: ``admit_waiting`` over the
        same order (``candidates``), with its KV part on counts where the pool can bind
        (``room``: ``counted_room``). It runs only where admitting preempts nobody
        (``may_preempt_to_admit``)."""
        budget = self.config.max_num_batched_tokens
        fits = None if room is None else counted_room(room)

        def place(req: Request, n: int, pending: int) -> bool:
            if fits is not None and not fits(req, n, pending):
                return False
            # Admitted: no longer waiting, so a later pass of ``candidates`` skips it, as
            # ``step.schedule`` makes it skip a request ``admit`` took.
            req.transition(RequestStatus.RUNNING)
            return True

        with self.queue.ordered() as in_order, closing(  # type: ignore[type-var]
                self.candidates(now, in_order)) as c:
            admitted = admission_rule(c, _pending, budget, seats, budget,
                                      strict_order=self.strict_order, place=place)
        return [req for req, _ in admitted]

    def order_fixed_while_decoding(self) -> bool:
        """True if decoding cannot change the running order (the keys of running requests
        keep their relative order as they generate tokens): the running set is then taken in
        the decode run's order instead of sorted every step."""
        return False

    def running_order(self, step: StepBuilder) -> Sequence[Request]:
        if self.order_fixed_while_decoding():
            in_order = step.decode_run_order()
            if in_order is not None:
                return in_order
        return sorted(step.running, key=self.running_key)

    def decode_run_key(self) -> Callable[[Request], Any]:
        return self.running_key

    def victim_picker(self, step: StepBuilder, order: Sequence[Request]) -> VictimPicker:
        return victim_from_end(order)

    def swapped_order(self, step: StepBuilder) -> Sequence[Request]:
        return sorted(step.swapped, key=self.running_key)

    # ---- internals ------------------------------------------------------------------------
    def _making_room(self, step: StepBuilder, budget: Budget,
                     candidates: Iterator[Request]) -> Iterator[Request]:
        """``candidates``, each first making room for itself by preemption (``preemptive``)."""
        for req in candidates:
            def victims(req: Request = req) -> Iterator[Request]:
                # Most preemptible first, while allowed (``may_preempt`` is monotone).
                return takewhile(lambda v: self.may_preempt(req, v),
                                 reversed(self.running_order(step)))
            self.requeue(preempt_for(step, budget, req, victims))
            yield req
