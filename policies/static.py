"""Static batching, FasterTransformer-style: the baseline continuous batching is measured against.

When nothing runs, a batch is formed from the waiting queue in arrival order: up to
``max_batch_size`` requests (null: ``max_num_seqs``), each admitted only if the KV pool can
hold its whole prompt + maximum output, which is reserved up front (``StepBuilder.reserve``),
so a batch never preempts. Its prompts are prefilled in prefill-only steps of at most
``max_num_batched_tokens`` tokens (the batch stays open for more while it stops on that budget
alone), then the batch decodes until its longest request has finished; only then is the next
batch formed. Requests arriving meanwhile wait.

Memory of finished requests: FasterTransformer allocates one KV buffer per batch, so a finished
request's slots stay reserved until the whole batch ends. Here the replica frees a finished
request's blocks at once (it frees every finished request), but this policy admits nothing
until the batch has ended, so that memory is just as idle: only ``kv_blocks_used`` in
steps.csv reads lower than FasterTransformer's buffer would. Two simplifications favour
static batching: prompts are not padded to the batch's longest, and finished requests'
rows cost no compute in the remaining decode steps (FasterTransformer computes them, masked).

On a disaggregated decode replica requests arrive already RUNNING, their KV transferred into
blocks reserved for their whole length (``reserves_full_length``: the replica reserves
prompt + maximum output when the transfer starts). They are batched the same way: a request
transferred while a batch decodes holds its blocks but waits, and when the batch has ended the
next one is formed from those waiting, in arrival order, up to the batch size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice, repeat
from operator import itemgetter

from policies.base import POLICIES, Policy, PolicyConfig
from policies.budget import (
    Budget,
    admission_rule,
    admit,
    counted_room,
    no_victim,
    schedule_running,
)
from sim.errors import require
from sim.kv_manager import blocks_for
from sim.plan import StepPlan
from sim.step_builder import StepBuilder


@dataclass(frozen=True)
class StaticConfig(PolicyConfig):
    name: str = "static"
    max_batch_size: int | None = None  # B; null: max_num_seqs

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_batch_size is None or self.max_batch_size >= 1,
                "policy.max_batch_size", f"must be >= 1 or null, got {self.max_batch_size}")

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or self.max_num_seqs


@POLICIES.register("static")
class StaticBatchingPolicy(Policy):
    # Inside a batch nothing is admitted and KV is reserved up front: decode-only steps repeat
    # until a member finishes.
    supports_decode_jumps = True
    reserves_full_length = True
    # ``head_admissions`` below (sim/array_core.py): one replica or co-located ones.
    array_core = True

    config_class = StaticConfig
    config: StaticConfig

    def __init__(self, config: StaticConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.forming = False  # a batch is being formed: more prefill-only steps may follow
        # Ids of the current batch's requests. Only a decode replica (disaggregation) runs
        # requests outside it: those transferred while the batch decodes.
        self.batch: set[int] = set()

    def schedule(self, step: StepBuilder) -> StepPlan:
        budget = Budget(step, self.config.max_num_batched_tokens, self.config.batch_size)
        running, batch = step.running, self.batch
        members = [r for r in running if r.request_id in batch]
        if not members and not step.swapped:
            self.forming = True  # the last batch has ended
            # Transferred requests (decode replica) that waited for it form the next one.
            members = list(islice(running, self.config.batch_size))
            self.batch = batch = {r.request_id for r in members}
        if self.forming:
            admitted = admit(step, budget, step.waiting, reserve_full=True)
            if admitted:
                batch.update(r.request_id for r in admitted)
                self.forming = self._stopped_on_tokens_only(step, budget)
                return step.build()
            self.forming = False
        # The whole running set when every request belongs to the batch (as the shared
        # decode run needs), else only the batch.
        order = running if len(members) == len(running) else members
        schedule_running(step, budget, no_victim, order)
        return step.build()

    def array_core_refusal(self) -> str | None:
        if self.config.batch_size > self.config.max_num_seqs:
            return ("policy.max_batch_size > policy.max_num_seqs (the core seats at most "
                    "max_num_seqs)")
        return None

    def head_admissions(self, pending: Iterable[int], seats: int,
                        room: tuple[int, int, int] | None = None,
                        lengths: Iterable[int] | None = None) -> tuple[int, int]:
        """The array core's admission (sim/array_core.py) on plain numbers, for a replica
        whose requests all come from its own queue: how many requests from the head of the
        queue the next step admits, and their tokens. ``pending``: the waiting prompts in
        queue order; ``seats``: free places under ``max_num_seqs`` (all of them once the
        last batch has ended); where the pool can bind, ``room`` = (free blocks, watermark,
        block size) and ``lengths`` the waiting requests' whole lengths (prompt + maximum
        output - 1), each admitted only if the pool holds it. None while a batch decodes;
        ``schedule``'s rule otherwise (``admit`` with ``reserve_full``, then the batch stays
        open if only the token budget kept the next one out). tests/test_array_core.py checks
        it against ``schedule``."""
        cfg = self.config
        members = cfg.max_num_seqs - seats
        if not members:
            self.forming = True  # the last batch has ended
        if not self.forming:
            return 0, 0
        seats = cfg.batch_size - members
        # The candidates that can matter: the batch's free seats, and the one after them.
        head = list(islice(zip(pending, repeat(0) if lengths is None else lengths),
                           max(seats, 0) + 1))
        free = None if room is None else room[0]
        place = None
        if room is not None:  # a whole length's blocks, the watermark aside
            place = counted_room((free, 0, room[2]), itemgetter(1))
        admitted = admission_rule(head, itemgetter(0), cfg.max_num_batched_tokens, seats,
                                  cfg.max_num_batched_tokens, place=place)
        k = len(admitted)
        if room is not None:
            free -= sum(blocks_for(length, room[2]) for (_, length), _ in admitted)
        self.forming = bool(k) and k < len(head) and seats > k and (
            room is None or blocks_for(head[k][1], room[2]) <= free)
        return k, sum(n for _, n in admitted)

    @staticmethod
    def _stopped_on_tokens_only(step: StepBuilder, budget: Budget) -> bool:
        """The next waiting request has a seat and its reservation fits: only this step's
        token budget kept it out, so the batch stays open for the next step."""
        if not step.waiting or budget.seats_left() <= 0:
            return False
        head = step.waiting[0]
        return step.can_allocate(head, step.held_length(head) - head.num_computed_tokens)
