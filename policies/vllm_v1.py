"""vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``), with
its ``scheduling_policy`` ``fcfs`` (the default) or ``priority``.

There are no prefill and decode phases: one token budget per step
(``max_num_batched_tokens``) is shared by every request, as ``num_computed_tokens`` catching
up with the request's tokens. Each step:
1. running requests first, in order: each gets all its pending tokens (one for a decode, the
   rest of its prompt for a prefill) up to what the budget has left, so chunked prefill is
   always on; when its new blocks do not fit, a running request is preempted by recompute
   (its blocks freed, back in the waiting queue) and if that is the request itself, the loop
   stops. ``fcfs``: the last running request not yet scheduled, put back at the queue's
   head. ``priority``: the running request with the largest (``priority``, arrival time),
   even one already scheduled in this step (its tokens are given back);
2. only if nobody was preempted: waiting requests in queue order (``priority``: by
   (``priority``, arrival time), lower first), while the budget lasts and
   ``max_num_seqs`` leaves a seat. Each first takes the blocks of its prompt the prefix cache
   holds (``StepBuilder.pending_tokens``), then asks for blocks for the tokens it computes
   in this step only (no watermark, nothing reserved ahead); the first that does not fit
   ends admission.
Prefix caching is on by default (``kv.enable_prefix_caching: null``), preemption is by
recompute only (v1 has no swap space), and the limits default to vLLM's for the API server
(``EngineArgs.get_batch_defaults``): 8,192 batched tokens and 1,024 sequences on GPUs with
at least 70 GiB that are not A100s, 2,048 and 256 elsewhere.

vLLM keeps its running list in admission order (a recomputed request rejoins at the end);
here the running set is in arrival order, which is the same until a recomputed request is
admitted again.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, ClassVar

from policies.base import POLICIES, Policy, PolicyConfig
from policies.budget import (
    Budget,
    admission_rule,
    counted_room,
    grant_chunks,
    latest_arrival_victim,
    preempted_by_key_on_counts,
    preempted_on_counts,
    schedule_running,
)
from sim.errors import require
from sim.plan import StepPlan
from sim.request import Request
from sim.step_builder import StepBuilder

# EngineArgs.get_batch_defaults (OPENAI_API_SERVER): large-memory GPUs other than A100s.
_LARGE_GPU_GIB = 70
SCHEDULING_POLICIES = ("fcfs", "priority")


def _priority_key(req: Request) -> tuple[int, float, int]:
    return (req.priority, req.arrival_time, req.request_id)


def lowest_priority_victim(step: StepBuilder, requester: Request) -> Request | None:
    """vLLM v1's victim under ``scheduling_policy=priority``: the running request with the
    largest (priority, arrival time), scheduled in this step or not (not one still in a
    pipeline's micro-batch)."""
    candidates = [r for r in step.running if not step.is_scheduled(r) or step.granted(r)]
    return max(candidates, key=_priority_key, default=None)


@dataclass(frozen=True)
class VLLMV1Config(PolicyConfig):
    name: str = "vllm_v1"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    kv_watermark: float = 0.0
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs | priority
    always_chunks: ClassVar[str | None] = "vLLM v1 always chunks prefills"
    recompute_only: ClassVar[str | None] = "vLLM v1 preempts by recompute only"
    no_watermark: ClassVar[str | None] = "vLLM v1 admits without a watermark"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.scheduling_policy in SCHEDULING_POLICIES, "policy.scheduling_policy",
                f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")


@POLICIES.register("vllm_v1")
class VLLMV1Policy(Policy):
    # A decode-only step means no waiting request got a chunk: no seat, no budget left after
    # the decodes, or no room for a chunk's blocks; the decodes only take seats' blocks, so
    # that holds until an arrival, a finish or a KV shortage (tests/test_fast_forward.py).
    supports_decode_jumps = True
    implements_chunked_prefill = True
    prefix_caching_default = True
    # Asynchronous scheduling: the next step is scheduled while this one runs.
    host_overlap_default = True
    # A prompt takes blocks chunk by chunk (``admit_waiting``'s ``place``).
    holds_whole_prompt = False
    # ``chunk_plan`` and ``decode_preemptions`` below (with the priority scheduling policy,
    # ``waiting_by_priority``: ``decode_victims``).
    array_core = True
    # ``schedule_running`` over the running requests in arrival order, then admission.
    grants_in_arrival_order = True

    config_class = VLLMV1Config
    config: VLLMV1Config

    @classmethod
    def engine_defaults(cls, hardware: Any) -> dict[str, Any]:
        large = (hardware.memory_gib >= _LARGE_GPU_GIB
                 and "a100" not in f"{hardware.name} {hardware.display_name}".lower())
        return ({"max_num_batched_tokens": 8192, "max_num_seqs": 1024} if large
                else {"max_num_batched_tokens": 2048, "max_num_seqs": 256})

    def schedule(self, step: StepBuilder) -> StepPlan:
        cfg = self.config
        budget = Budget(step, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        victim = (lowest_priority_victim if cfg.scheduling_policy == "priority"
                  else latest_arrival_victim)
        # (A request that preempts itself ends the running loop, as in vLLM.)
        if schedule_running(step, budget, victim, self_preemption_ends=True):
            # Preempted someone: no admissions.
            return step.build()
        if step.waiting and budget.remaining_tokens > 0:
            self.admit_waiting(step, budget)
        return step.build()

    def waiting_by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def chunk_plan(self, decode_tokens: int, partials: Sequence[int], waiting: Iterable[int],
                   num_waiting: int, seats: int, room: tuple[int, int, int] | None = None,
                   cached_blocks: Callable[[], int] | None = None,
                   ) -> tuple[list[int], list[int]]:
        """The array core's step (sim/array_core.py): ``schedule``'s decisions on plain
        numbers, where no running request is preempted. The running requests in arrival order are
        those with one pending token (``decode_tokens`` of them: decodes, and prompts one
        token from done), then the prompts mid-prefill (``partials``: their pending tokens):
        only the last request admitted can be left with part of its prompt (it took what the
        budget had left), and while it is, nobody after it is admitted. Each gets its
        pending tokens up to what the budget has left; then the waiting requests (their
        pending prefill tokens in queue order, ``num_waiting`` of them) are admitted in
        order while the budget and the ``seats`` last, the last one possibly with a partial
        chunk. Returns the partials' chunks (fewer entries once the budget is spent) and the
        admitted ones' (the first ``len`` of the queue). tests/test_array_core.py checks it
        against ``schedule``. (With ``scheduling_policy=priority`` the queue is in priority
        order, ``waiting_by_priority``, and a prompt mid-prefill may have arrived before a
        request that decodes: the core then runs it only where the grants are the same; its
        victims go by priority too, ``decode_victims``.)

        Where the pool can bind, ``room`` = (free blocks, 0, block size), free once every
        running request has the blocks of its pending tokens (admission comes only after
        the partials got all of theirs: one cut short spends the budget): each admitted
        request takes the blocks of its chunk only, and the first whose chunk does not fit
        ends admission (``counted_room``). A step whose running requests' blocks do not
        fit preempts instead (``decode_preemptions``) and admits nobody. With the prefix
        cache on, a request recomputed may find its own blocks still cached: ``waiting``
        then gives its pending tokens after the hit (``StepBuilder.pending_tokens``), and
        ``cached_blocks()`` the hit's blocks as it is placed, which its admission takes
        too."""
        chunks, remaining = grant_chunks(partials,
                                         self.config.max_num_batched_tokens - decode_tokens)
        if not num_waiting or remaining <= 0:
            return chunks, []
        admitted = admission_rule(waiting, None, remaining, seats,
                                  self.config.max_num_batched_tokens, chunked=True,
                                  place=None if room is None
                                  else counted_room(room, chunk_only=True,
                                                    cached_blocks=cached_blocks))
        return chunks, [n for _, n in admitted]

    def decode_preemptions(self, needs: Sequence[int], held: Sequence[int], free: int) -> int:
        """The array core's step (sim/array_core.py) when the running requests' new blocks
        do not fit: ``schedule_running`` with ``latest_arrival_victim`` on counts. Every
        running request in arrival order (the decodes, then the prompt mid-prefill: it was
        admitted last, and everyone running arrived before everyone waiting), ``needs[r]``
        the new blocks of its grant (a decode's next token; a prompt's chunk, up to what the
        budget leaves after the decodes, 0 where it leaves none), ``held[r]`` the blocks of
        its computed tokens; returns how many of the latest arrivals it preempts
        (``preempted_on_counts``): the prompt mid-prefill first, so the step carries no
        chunk, and it admits nobody."""
        return preempted_on_counts(needs, held, free)

    def decode_victims(self, needs: Sequence[int], held: Sequence[int], free: int,
                       keys: Sequence[tuple[int, float, int]]) -> tuple[list[int], int, int]:
        """``decode_preemptions`` under ``scheduling_policy=priority``: ``schedule_running``
        with ``lowest_priority_victim`` on counts (``preempted_by_key_on_counts``), ``keys``
        each running request's (priority, arrival time, id). Returns the victims in the
        order preempted, how many leading requests the loop reached (a request that
        preempted itself ended it: those after it get nothing this step) and the fewest
        blocks free along the way."""
        return preempted_by_key_on_counts(needs, held, free, keys)

    def admit_waiting(self, step: StepBuilder, budget: Budget) -> list[Request]:
        """Queue order; each admitted with its pending tokens (after its cache hit) up to the
        budget left, holding blocks for those only; the first that does not fit stops it."""
        # A snapshot of the part that can matter (admitting removes requests from the queue).
        seats = max(budget.seats_left(), 0)
        candidates = (heapq.nsmallest(seats, step.waiting, key=_priority_key)
                      if self.config.scheduling_policy == "priority"
                      else list(islice(step.waiting, seats)))

        def place(req: Request, n: int, pending: int) -> bool:
            return step.schedule(req, n)

        return [req for req, _ in admission_rule(
            candidates, step.pending_tokens, budget.remaining_tokens, budget.seats_left(),
            budget.max_num_batched_tokens, chunked=True, place=place,
            budget_now=lambda: (budget.remaining_tokens, budget.seats_left()))]
