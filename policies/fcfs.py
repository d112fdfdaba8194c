"""FCFS continuous batching as vLLM v0 schedules by default (no chunked prefill).

Each step is either a prefill step or a decode step:
1. If nothing is swapped out, admit waiting requests in arrival order (recomputed requests
   first) with their whole prompt, while ``max_num_batched_tokens``, ``max_num_seqs`` and the
   free blocks (above the watermark) allow. If any was admitted, the step is prefill only.
2. Otherwise every running request decodes one token; when one cannot get a block, the most
   recently arrived running request is preempted (recompute by default).
3. If that preempted nobody, swapped requests come back in order while blocks last.

``policy.enable_chunked_prefill=true`` is refused here and in every policy built on these steps
(``ConfigError``): in vLLM v0 the flag switches to a different step structure (decodes first,
then prompt chunks), which is ``policy=chunked_prefill``. The one chunked case left is a
recomputed request whose prompt + generated tokens exceed a whole step's budget: it
re-prefills in budget-sized chunks, holding all its blocks from admission.

Orderings (``sjf``, ``priority``) subclass this and override the five hooks below: which
waiting requests to admit and how (``admit_waiting``), the running order (``running_order``),
the memory-pressure victim (``victim_picker``), the order swapped requests come back in
(``swapped_order``) and what to do with those preempted (``requeue``). A subclass does not
inherit the fast-path flags (``Policy.FAST_PATH_FLAGS``): it states its own once
tests/test_fast_forward.py passes for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from policies.base import POLICIES, Policy
from policies.budget import (
    Budget,
    VictimPicker,
    admission_rule,
    admit,
    counted_room,
    latest_arrival_victim,
    preempted_on_counts,
    resume_swapped,
    schedule_running,
)
from sim.plan import StepPlan
from sim.request import Request
from sim.step_builder import StepBuilder


@POLICIES.register("fcfs")
class FCFSPolicy(Policy):
    # Admission can only get harder while a decode batch grows (free blocks shrink, seats and
    # budget stay), so a decode-only step repeats until an arrival, finish or KV shortage;
    # with nothing waiting or swapped out, a finish frees a seat and blocks nobody takes.
    supports_decode_jumps = True
    array_core = True
    #: The array core does not call these hooks: its rules on counts (``head_admissions`` or
    #: ``indexed_admissions``, ``decode_preemptions``, ``decode_run_key``, ``requeue``)
    #: follow them as the classes that define them here (FCFS, ``OrderedPolicy``) write
    #: them. A class stating ``array_core`` whose hook comes from elsewhere is refused.
    CORE_FOLLOWED_HOOKS: ClassVar[tuple[str, ...]] = (
        "schedule", "admit_waiting", "running_order", "victim_picker", "swapped_order",
        "requeue")
    #: Set in the body of a class whose definitions of those hooks the core follows.
    core_follows_hooks: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # resets the fast-path flags not restated
        if not cls.array_core:
            return
        for name in FCFSPolicy.CORE_FOLLOWED_HOOKS:
            owner = next(k for k in cls.__mro__ if name in k.__dict__)
            if not owner.__dict__.get("core_follows_hooks", False):
                raise TypeError(
                    f"{cls.__name__}: array_core = True, but its {name} ({owner.__name__}'s) "
                    f"is not what the array core's rules on counts follow (sim/array_core.py)")

    def schedule(self, step: StepBuilder) -> StepPlan:
        cfg = self.config
        budget = Budget(step, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        if not step.swapped and step.waiting:
            if self.admit_waiting(step, budget):
                return step.build()
        order = self.running_order(step)
        preempted = schedule_running(step, budget, self.victim_picker(step, order), order)
        self.requeue(preempted)
        if not preempted and step.swapped:
            resume_swapped(step, budget, self.swapped_order(step))
        return step.build()

    def head_admissions(self, pending: Iterable[int], seats: int,
                        room: tuple[int, int, int] | None = None) -> tuple[int, int]:
        """The array core's admission (sim/array_core.py): how many requests from the head
        of the waiting queue, whose pending prefill tokens ``pending`` gives in queue order,
        the next step admits, and their tokens; ``seats``: free places under
        ``max_num_seqs``. ``admit``'s rule (``admission_rule``) in a prefill-only step, with
        its KV part on counts where the pool can bind (``room``: ``counted_room``).
        tests/test_array_core.py checks the two agree."""
        budget = self.config.max_num_batched_tokens
        place = None if room is None else counted_room(room)
        admitted = admission_rule(pending, None, budget, seats, budget, place=place)
        return len(admitted), sum(n for _, n in admitted)

    def decode_preemptions(self, needs: Sequence[int], held: Sequence[int], free: int) -> int:
        """The array core's decode step when the pool cannot hold every row's new block
        (sim/array_core.py): ``schedule_running`` with its victim picker on counts. Rows in
        ``running_order`` (arrival order here; an ordered policy's ``running_key`` order,
        which ``decode_run_key`` gives the core), row r needing ``needs[r]`` new blocks and
        holding ``held[r]``, ``free`` blocks free; a row that finds too few preempts the
        last row not yet granted (possibly itself: ``latest_arrival_victim``, and
        ``victim_from_end`` over that order), so those preempted are always the last rows.
        Returns how many (tests/test_array_core.py checks it against ``schedule``)."""
        return preempted_on_counts(needs, held, free)

    # ---- hooks --------------------------------------------------------------------------
    def admit_waiting(self, step: StepBuilder, budget: Budget) -> list[Request]:
        """Admit from the waiting queue; returns those admitted."""
        return admit(step, budget, step.waiting)

    def running_order(self, step: StepBuilder) -> Sequence[Request]:
        """The order in which running requests get their tokens (most preemptible last)."""
        return step.running

    def victim_picker(self, step: StepBuilder, order: Sequence[Request]) -> VictimPicker:
        return latest_arrival_victim

    def swapped_order(self, step: StepBuilder) -> Sequence[Request]:
        return step.swapped

    def requeue(self, preempted: list[Request]) -> None:
        """Requests preempted by this policy; those recomputed are waiting again. FCFS needs
        nothing (they are at the head of ``step.waiting``); ordered policies re-index them."""
