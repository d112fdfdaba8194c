"""What a policy sees and may do while it builds one step.

A policy reads the replica's queues through read-only views, and the KV pool through a
read-only ``KVView`` (``step.kv``), and acts only through the methods below, which are the
single home of request state transitions and KV operations:

    pending_tokens(req) tokens req still needs computed, less what the prefix cache holds
    split_running()    the running requests that decode and those mid-prefill
    remaining_outputs(decodes) their remaining output tokens (fast: one array)
    schedule(req, n)   grant n new tokens (allocates slots; moves a waiting request to running;
                       with prefix caching a request admitted within its ``pending_tokens``
                       starts with the cached blocks of its prompt)
    reserve(req, n)    hold slots for a scheduled request's first n tokens now (static batching)
    preempt(req)       free its GPU KV by swap or by recompute (the replica's preemption mode)
    swap_in(req)       bring a swapped request's KV back so it can run again
    build()            the StepPlan handed to the executor

Between steps, a cluster moves a request from a prefill replica to a decode replica through
the four handoff methods at the end (``release_for_handoff``, ``reserve_transfer``,
``accept_transferred``, ``free_handed_off``). In transit the request stays RUNNING and holds KV
blocks, but sits in no replica's running set, so no policy can schedule or preempt it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sim.decode_run import DecodeRun, is_decoding
from sim.kv_manager import KVIntegrityError, KVView, blocks_for
from sim.plan import DecodeBlock, ScheduledRequest, StepPlan
from sim.prefix_cache import own_block_keys, shared_block_hashes
from sim.request import Request, RequestStatus, full_length

if TYPE_CHECKING:
    from sim.kv_manager import KVBlockManager

T = TypeVar("T")


class ReadOnly(Sequence, Generic[T]):
    """A read-only window on a live list or deque (no copy per step)."""

    __slots__ = ("_items",)

    def __init__(self, items: list[T] | deque[T]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[override]
        return self._items[i]

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


class PreemptionMode(str, Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


def _arrival_key(r: Request) -> tuple[float, int]:
    return (r.arrival_time, r.request_id)


_arrival_time = attrgetter("arrival_time")


class ReplicaQueues:
    """The replica's request sets. ``running`` is kept in arrival order, so its last element
    is the latest arrival: vLLM's default preemption victim."""

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()

    def add_running(self, req: Request) -> None:
        running = self.running
        # Most admissions are the latest arrival: append (where insort would put it) without
        # a binary search of key tuples.
        if not running:
            running.append(req)
            return
        last, t = running[-1], req.arrival_time
        if last.arrival_time < t or (last.arrival_time == t and last.request_id < req.request_id):
            running.append(req)
        else:
            bisect.insort(running, req, key=_arrival_key)

    def remove_running(self, req: Request) -> None:
        running = self.running
        # Search on the arrival time alone (a C-level key, no tuple per probe), then step
        # over requests that arrived at the same time.
        t = req.arrival_time
        i = bisect.bisect_left(running, t, key=_arrival_time)
        n = len(running)
        if i < n and running[i] is not req and running[i].arrival_time == t:
            # Ties on the arrival time (traces in whole milliseconds): the full key.
            i = bisect.bisect_left(running, _arrival_key(req), lo=i, key=_arrival_key)
        if i == n or running[i] is not req:
            raise ValueError(f"request {req.request_id} is not running")
        del running[i]


def _num_blocks(hits: tuple[list[int], list[int]]) -> int:
    """How many blocks a cache hit covers: its GPU blocks and the offloaded ones after them."""
    return len(hits[0]) + len(hits[1])


def watermark_blocks(kv_watermark: float, num_gpu_blocks: int) -> int:
    """The blocks admission keeps free (vLLM v0's watermark: a fraction of the pool)."""
    return int(kv_watermark * num_gpu_blocks)


class StepBuilder:
    """Built once per replica and reset every step; see the module docstring."""

    def __init__(self, queues: ReplicaQueues, kv: KVBlockManager,
                 preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
                 kv_watermark: float = 0.0, hands_off: bool = False) -> None:
        self._q = queues
        self._kv = kv
        #: A prefill replica of a disaggregated deployment: its requests leave after their
        #: first token, so they never hold more than their prompt here (``held_length``).
        self.hands_off = hands_off
        #: What a policy reads of the pool; it changes the pool only through this builder.
        self.kv = KVView(kv)
        # Requests holding blocks here while in no queue (disaggregation: a prefill replica's
        # handed-off requests until their KV has left, a decode replica's reserved transfers
        # until they arrive), for check_holders.
        self._in_transit: set[Any] = set()
        self.preemption_mode = PreemptionMode(preemption_mode)
        self.watermark_blocks = watermark_blocks(kv_watermark, kv.num_gpu_blocks)
        self.waiting: ReadOnly[Request] = ReadOnly(queues.waiting)
        self.running: ReadOnly[Request] = ReadOnly(queues.running)
        self.swapped: ReadOnly[Request] = ReadOnly(queues.swapped)
        self.now = 0.0
        self.num_swap_fallbacks = 0  # swap asked, CPU pool full, recomputed instead
        # The decoding requests as one block (sim/decode_run.py); None: per-row only.
        self.run: DecodeRun | None = None
        self._run_view: ReadOnly[Request] | None = None
        self._step_index = 0
        self.run_block_step = 0  # the run's step when its block was last put in a plan
        self.reset(0.0)

    def enable_decode_run(self, order_key: Callable[[Request], Any] | None = None) -> None:
        """Keep the decoding requests as a persistent decode run (step_mode=fast with a
        closed-form executor), in arrival order or by ``order_key`` (the policy's running
        order, ``Policy.decode_run_key``). Plans then hold a ``DecodeBlock`` where the whole
        run decodes."""
        self.run = DecodeRun(self._kv.block_size, order_key)
        # Requests whose KV arrived from a prefill replica (disaggregation) since the last
        # step: they join the run when the next step starts, as decode rows would after
        # their first step.
        self._transferred: list[Request] = []
        self._run_view = ReadOnly(self.run.members)
        # An empty run kept for the next one to leave with a micro-batch (``detach_run``).
        self._spare_run: DecodeRun | None = None

    def reset(self, now: float, in_flight: set[int] | None = None,
              repeated_steps: int = 0, idled: bool = False,
              mid_prefill: set[int] | None = None) -> None:
        """Start a new step at ``now``. ``in_flight``: ids of running requests that are part
        of a micro-batch still in the pipeline (pipeline parallelism); they count as already
        scheduled, so the shared loops skip them and never pick them as victims.
        ``mid_prefill``: those of them whose chunk in flight leaves prompt tokens to compute
        (they are still mid-prefill once it lands: ``num_pending_after_step``).
        ``repeated_steps``: steps the replica took since the last plan by repeating it
        without asking the policy (a decode jump's steps after its first; a pipelined
        replica's repeated micro-batches, and the instants it found every running request
        in flight). ``idled``: the replica held no request at all since the last plan."""
        self.now = now
        #: Decode-only steps taken since the policy's last plan by repeating that plan (a
        #: decode jump, sim/fast_forward.py, plans its first step and repeats it): 0 where
        #: every step was planned. A policy whose own state moves with every step it plans
        #: (SGLang's ``new_token_ratio``) catches up on them here.
        self.repeated_steps = repeated_steps
        #: The replica held no request at all since the policy's last plan (it waited for
        #: one): an engine whose loop keeps polling went idle meanwhile (SGLang starts its
        #: ``new_token_ratio`` over then).
        self.idled = idled
        if self.run is not None and self._transferred:
            self._join_transferred()
        self._step_index += 1
        self._plan = StepPlan()
        self.scheduled_requests: list[Request] = []  # parallel to plan.scheduled
        self._granted: dict[int, int] = {}  # request id -> tokens granted this step
        self._in_flight: set[int] = in_flight or set()
        self._mid_prefill: set[int] = mid_prefill or set()
        self.num_scheduled_tokens = 0
        self._hit_memo: dict[Any, tuple[int, tuple[list[int], list[int]] | None]] = {}
        if self._kv.num_offload_blocks:  # the tier's copies go into this step's plan
            self._kv.copy_log = self._plan.swaps

    # ---- queries ------------------------------------------------------------------------
    def is_scheduled(self, req: Request) -> bool:
        """True if ``req`` is in this step, or in a micro-batch still in the pipeline."""
        rid = req.request_id
        if req._run is not None and req._run.scheduled_at == self._step_index:
            return True
        return rid in self._granted or rid in self._in_flight

    def granted(self, req: Request) -> int:
        """Tokens granted to ``req`` in this step so far (0 if not scheduled)."""
        if req._run is not None and req._run.scheduled_at == self._step_index:
            return 1
        return self._granted.get(req.request_id, 0)

    @property
    def num_running(self) -> int:
        """``len(step.running)``, without the view."""
        return len(self._q.running)

    @property
    def num_scheduled(self) -> int:
        return len(self.scheduled_requests)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        hits = self._hits(req, num_new_tokens) if self._kv.enable_prefix_caching else None
        if hits:  # the cached blocks come first; those now free leave the free queue
            kv = self._kv
            gpu = hits[0]  # the offloaded ones are loaded into new blocks
            return (blocks_for(_num_blocks(hits) * kv.block_size + num_new_tokens, kv.block_size)
                    - len(gpu) + kv.num_free_among(gpu))
        return self._kv.blocks_needed(req.request_id, req.num_computed_tokens + num_new_tokens)

    # ---- prefix caching -------------------------------------------------------------------
    def pending_tokens(self, req: Request) -> int:
        """Tokens ``req`` must still compute before it samples again: its own
        ``num_pending_tokens``, less the prompt tokens the prefix cache holds when it waits
        with nothing computed (whole blocks from the first, never its last token: vLLM v1's
        ``get_computed_blocks``). A policy that sizes admissions by this admits cache hits at
        their real cost; a grant within it starts from the cached blocks. A policy that reads
        the request's own count gets no hits and runs as without a cache."""
        n = req.num_pending_tokens
        if not self._kv.enable_prefix_caching:  # the common case: one attribute read
            return n
        hits = self._hits(req)
        return n - _num_blocks(hits) * self._kv.block_size if hits else n

    def _hits(self, req: Request, num_new_tokens: int = 0,
              ) -> tuple[list[int], list[int]] | None:
        """The cached blocks ``req`` would start with if admitted now with
        ``num_new_tokens`` tokens: (GPU blocks, offload tier blocks that continue them), or
        None for none (or when the grant does not fit within its ``pending_tokens``)."""
        kv = self._kv
        if (not kv.enable_prefix_caching or req.status is RequestStatus.RUNNING
                or req.status is RequestStatus.SWAPPED or req.num_computed_tokens):
            return None
        rid = req.request_id
        memo = self._hit_memo.get(rid)
        if memo is not None and memo[0] == kv.epoch:
            hits = memo[1]
        else:
            keys = self._keys(req)
            gpu = kv.match(keys)
            offloaded = (kv.match_offloaded(keys[len(gpu):]) if kv.num_offload_blocks
                         else [])
            hits = (gpu, offloaded) if gpu or offloaded else None
            self._hit_memo[rid] = (kv.epoch, hits)
        if hits and num_new_tokens > req.num_pending_tokens - _num_blocks(hits) * kv.block_size:
            return None
        return hits

    def _keys(self, req: Request) -> list:
        """Content keys of the blocks a cache hit may cover: whole blocks, never the one
        holding the last token to compute (sim/prefix_cache.py)."""
        size = self._kv.block_size
        limit = (req.num_pending_tokens - 1) // size
        shared = self.shared_keys(req)[:limit]
        if req.num_recomputes and len(shared) < limit:  # its own blocks, kept by preemption
            rid = req.request_id
            return [*shared, *own_block_keys(rid, len(shared), limit)]
        return shared

    def shared_keys(self, req: Request) -> list[int]:
        """The hashes of ``req``'s full blocks inside its shared prefix (memoized)."""
        if req.prefix is None:
            return []
        size = self._kv.block_size
        memo = req._block_keys
        if memo is None or memo[0] != size:
            memo = req._block_keys = (size, shared_block_hashes(req.prefix, size))
        return memo[1]

    def register_computed(self, req: Request) -> None:
        """Make the computed blocks of ``req``'s shared prefix findable: after a step that
        computed prompt tokens, and when its KV comes back (swap in) or arrives (transfer)."""
        kv = self._kv
        if not kv.enable_prefix_caching or req.prefix is None:
            return
        shared = self.shared_keys(req)
        upto = min(req.num_computed_tokens // kv.block_size, len(shared))
        if upto > kv.num_registered(req.request_id):
            kv.register(req.request_id, shared, upto)

    def register_finished(self, req: Request) -> None:
        """A finished request whose answer a later prompt repeats (``output_key``): its
        computed full blocks become findable as its prompt's spans followed by the answer's
        (before they are freed)."""
        kv = self._kv
        if not kv.enable_prefix_caching or req.output_key is None:
            return
        spans = (*(req.prefix or ()), (req.output_key, req.num_output_tokens))
        keys = shared_block_hashes(spans, kv.block_size)
        upto = min(req.num_computed_tokens // kv.block_size, len(keys))
        if upto > kv.num_registered(req.request_id):
            kv.register(req.request_id, keys, upto)

    def _register_before_recompute(self, req: Request) -> None:
        """A request preempted by recompute leaves its computed blocks cached: when it is
        admitted again they are a hit (its own tokens included) unless evicted meanwhile."""
        kv = self._kv
        size = kv.block_size
        full = req.num_computed_tokens // size
        shared = self.shared_keys(req)[:full]
        rid = req.request_id
        keys = [*shared, *own_block_keys(rid, len(shared), full)]
        kv.register(rid, keys, full)

    def can_allocate(self, req: Request, num_new_tokens: int, use_watermark: bool = False) -> bool:
        wm = self.watermark_blocks if use_watermark else 0
        return self._kv.can_allocate(self.blocks_needed(req, num_new_tokens), wm)

    # ---- actions ------------------------------------------------------------------------
    def schedule(self, req: Request, num_new_tokens: int) -> bool:
        """Grant ``num_new_tokens`` to ``req`` this step. Returns False (and changes nothing)
        if the KV pool cannot hold them: the policy may preempt someone and retry."""
        rid = req.request_id
        if rid in self._in_flight:
            raise ValueError(f"request {rid} is in a micro-batch still in the pipeline")
        if req._run is not None:
            self.dissolve_run()
        if rid in self._granted:
            raise ValueError(f"request {rid} is already scheduled in this step")
        pending = req.num_pending_tokens
        if not 1 <= num_new_tokens <= pending:
            raise ValueError(
                f"request {rid}: cannot grant {num_new_tokens} tokens, {pending} pending"
            )
        status = req.status
        if status is RequestStatus.SWAPPED:
            raise ValueError(f"request {rid} is swapped out; swap_in first")
        computed = req.num_computed_tokens  # not a run member (any run was dissolved above)
        kv = self._kv
        queried = (kv.enable_prefix_caching and status is not RequestStatus.RUNNING
                   and not computed)
        local = 0  # prompt tokens found in GPU blocks (vLLM's prefix_cache_hits)
        if queried:
            hits = self._hits(req, num_new_tokens)
            if hits:
                if self.blocks_needed(req, num_new_tokens) > kv.num_free_blocks:
                    return False
                gpu, offloaded = hits
                if gpu:
                    kv.attach(rid, gpu)
                if offloaded:  # fits: blocks_needed counted the blocks it loads into
                    kv.load(rid, offloaded, self._keys(req))
                local = len(gpu) * kv.block_size
                computed = req.num_computed_tokens = _num_blocks(hits) * kv.block_size
                pending -= computed
        if kv.allocate_slots(rid, computed + num_new_tokens) is None:
            return False
        if queried:
            kv.prefix_queries += pending + computed
            kv.prefix_hits += local
            req.num_cached_tokens = computed
        if status is not RequestStatus.RUNNING:  # admitted from the waiting queue
            self._plan.admitted.append(rid)
            self._remove_waiting(req)
            req.transition(RequestStatus.RUNNING)
            self._q.add_running(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.now
        # allocate_slots made sure the table exists (it holds at least one token now).
        self._plan.add_row(ScheduledRequest(
            rid, computed, num_new_tokens, kv.block_tables[rid], num_new_tokens == pending,
        ))
        self.scheduled_requests.append(req)
        self._granted[rid] = num_new_tokens
        self.num_scheduled_tokens += num_new_tokens
        return True

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make a request scheduled in this step hold KV slots for its first ``num_tokens``
        tokens now, beyond what the step computes (static batching reserves prompt + maximum
        output up front, so its decodes never need a block). Only a request already scheduled
        in this step may reserve, so a reservation can never leak on a waiting request.
        Returns False (and changes nothing) if the pool cannot hold them."""
        rid = req.request_id
        if req._run is not None:
            self.dissolve_run()
        if rid not in self._granted:
            raise ValueError(f"request {rid} must be scheduled in this step before it reserves")
        return self._kv.allocate_slots(rid, num_tokens) is not None

    def preempt(self, req: Request, mode: PreemptionMode | None = None, *,
                to_front: bool = True) -> PreemptionMode:
        """Take a running request off the GPU. Swap falls back to recompute (and is counted)
        when the CPU pool cannot hold its blocks. Returns the mode actually used. A request
        recomputed goes back to the head of the waiting queue (vLLM), or with
        ``to_front=False`` to its tail (SGLang's retraction)."""
        rid = req.request_id
        if rid in self._in_flight:
            raise ValueError(f"request {rid} is in a micro-batch still in the pipeline; "
                             f"it cannot be preempted until that batch completes")
        if req._run is not None:
            self.dissolve_run()
        if req.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {rid} is {req.status.name}, only RUNNING can be preempted")
        if rid in self._granted:
            self._unschedule(req)
        mode = PreemptionMode(mode or self.preemption_mode)
        self._q.remove_running(req)
        req.num_preemptions += 1
        if mode is PreemptionMode.SWAP:
            pairs = self._kv.swap_out(rid)
            if pairs is not None:
                req.transition(RequestStatus.SWAPPED)
                req.num_swaps += 1
                self._q.swapped.append(req)
                self._plan.swap_out.extend(pairs)
                self._plan.swaps.append(("out", pairs))
                self._plan.swapped_out.append(rid)
                return PreemptionMode.SWAP
            self.num_swap_fallbacks += 1
        if self._kv.enable_prefix_caching:
            self._register_before_recompute(req)
        self._kv.free(rid)
        req.num_computed_tokens = 0
        req.num_recomputes += 1
        req.transition(RequestStatus.PREEMPTED)
        if to_front:  # vLLM: recomputed requests go first
            self._q.waiting.appendleft(req)
        else:
            self._q.waiting.append(req)
        self._plan.recomputed.append(rid)
        return PreemptionMode.RECOMPUTE

    def swap_in(self, req: Request, use_watermark: bool = True) -> bool:
        """Copy a swapped request's blocks back; it becomes RUNNING (not yet scheduled)."""
        rid = req.request_id
        if req.status is not RequestStatus.SWAPPED:
            raise ValueError(f"request {rid} is {req.status.name}, not SWAPPED")
        wm = self.watermark_blocks if use_watermark else 0
        if not self._kv.can_swap_in(rid, wm):
            return False
        pairs = self._kv.swap_in(rid)
        assert pairs is not None
        self._q.swapped.remove(req)
        req.transition(RequestStatus.RUNNING)
        self._q.add_running(req)
        self._plan.swap_in.extend(pairs)
        self._plan.swaps.append(("in", pairs))
        self.register_computed(req)  # its prefix is back in GPU blocks (copied first)
        return True

    def build(self) -> StepPlan:
        # The plan is final: copies made after it (a transfer's blocks reserved between
        # steps) are not this step's, and are counted only.
        self._kv.copy_log = None
        return self._plan

    # ---- the decode run: every decoding request in one block ------------------------------
    def split_running(self) -> tuple[Sequence[Request], list[Request]]:
        """The running requests with exactly one pending token (decodes) and those with more
        (prefills), each in arrival order. With a decode run, the decodes are the run's
        members (a view ``schedule_decode_run`` schedules as one block)."""
        running = self._q.running
        run = self.run
        if run is not None and not self._granted and not self._in_flight:
            if not run.complete:
                run.rebuild(running, self._kv.block_tables)
            if len(run) == len(running):
                return self._run_view, []  # type: ignore[return-value]
            others = [r for r in running if r._run is None]
            # A non-member with one pending token is a prompt (of one token, or one token
            # from done): the decodes are then not the run alone.
            if all(r.num_pending_tokens > 1 for r in others):
                return self._run_view, others  # type: ignore[return-value]
        return ([r for r in running if r.num_pending_tokens == 1],
                [r for r in running if r.num_pending_tokens > 1])

    def remaining_outputs(self, decodes: Sequence[Request]) -> Sequence[int]:
        """The output tokens each of ``decodes`` (``split_running``'s first part) may still
        sample (``max_output_len - num_output_tokens``), in order: the decode run's as one
        array where ``decodes`` is the run (a policy that sums them over a large batch at
        every step reads no request)."""
        run = self.run
        if run is not None and decodes is self._run_view:
            return run.end - run.steps
        return [r.max_output_len - r.num_output_tokens for r in decodes]

    def decode_run_order(self) -> list[Request] | None:
        """The running requests in the decode run's order (a copy), when the run is complete,
        kept in a policy's order (``Policy.decode_run_key``) and holds every running request;
        else None. A policy whose order decoding cannot change may take this for its sorted
        running set (the run was sorted by its key, and joins keep it so)."""
        run = self.run
        if (run is None or run.key is None or not run.complete
                or len(run) != len(self._q.running)):
            return None
        return list(run.members)

    def num_pending_after_step(self) -> int:
        """Running requests that will still have tokens pending after this step (those not
        scheduled, or granted less than they have pending). A request in a micro-batch
        still in the pipeline has its grant there, and that batch lands before this step's:
        it counts only if its chunk leaves prompt tokens to compute (``reset``'s
        ``mid_prefill``), never for its decode token."""
        granted, in_flight, mid_prefill = self._granted, self._in_flight, self._mid_prefill
        n = 0
        run = self.run
        for r in self._q.running:
            rid = r.request_id
            if rid in in_flight:
                if rid in mid_prefill:
                    n += 1
            # Members of this builder's run are counted below.
            elif ((r._run is None or r._run is not run)
                    and r.num_pending_tokens > granted.get(rid, 0)):
                n += 1
        if run is not None and run.members and run.scheduled_at != self._step_index:
            n += len(run)
        return n

    def schedule_decode_run(self, order: Sequence[Request], max_tokens: int) -> bool:
        """Grant one token to every request of ``order`` as one ``DecodeBlock``, when
        ``order`` is the decode run (``split_running``'s decodes, or ``running`` when every
        running request decodes; for a run kept in a policy's order, a list of every running
        request in the run's order), nothing of it is scheduled yet, ``max_tokens`` holds them
        and the pool holds their new blocks. Exactly what ``schedule(req, 1)`` in order would
        do then (the same blocks, in the same order). False (nothing changes) otherwise: the
        caller goes row by row. ``running`` whose requests after the run's members are not
        members (a prompt mid-prefill, admitted last) gets the block for its members: the
        caller goes on with the rest (``after_decode_run``)."""
        run = self.run
        if run is None:
            return False
        in_flight = self._in_flight
        keyed = run.key is not None
        free: list[Request] | None = None
        if in_flight:
            # A pipelined replica: the run holds the decoding requests not in flight, and
            # ``order`` lists those in flight too (they count as scheduled). Its part not in
            # flight must be the run: every running request not in flight (``running``, for
            # a run in arrival order), or the run's members in its order (a list).
            if isinstance(order, list):
                free = [r for r in order if r.request_id not in in_flight]
            elif order is not self.running or keyed:
                return False
        elif not keyed and order is not self._run_view and order is not self.running:
            return False
        if not run.complete:
            if self._granted:
                return False
            run.rebuild(self._not_in_flight(), self._kv.block_tables)
        n = len(run)
        if in_flight:
            if free is None:
                if n != len(self._q.running) - len(in_flight):
                    return False
            elif free != run.members and (  # the same requests, compared by identity
                    not keyed or self._granted or run.scheduled_at == self._step_index
                    or not run.reorder(free)):
                return False
        elif keyed:
            if n != len(self._q.running) or not isinstance(order, list):
                return False
            if order != run.members:  # the same requests, compared by identity
                # Members' keys moved past each other as they decoded (an SJF prediction
                # used up): the run takes the policy's new order.
                if (self._granted or run.scheduled_at == self._step_index
                        or not run.reorder(order)):
                    return False
        elif order is self.running and n != len(self._q.running):
            running = self._q.running
            if n > len(running) or any(r._run is not None for r in running[n:]):
                return False
        if n == 0:
            return True
        if n > max_tokens or run.scheduled_at == self._step_index:
            return False
        need = run.members_needing_blocks()
        if need is not None:
            if len(need) > self._kv.num_free_blocks:
                return False
            ids = run.ids
            self._kv.grow([ids[i] for i in need.tolist()])
            run.add_block_each(need)
        s = run.steps
        self._plan.add_block(DecodeBlock(list(run.ids), run.ctx0, s, list(run.tables),
                                         run.ctx0_sum + n * s, run.ctx0_max + s))
        self.run_block_step = s
        self.scheduled_requests.extend(run.members)
        run.scheduled_at = self._step_index  # its members count as granted one token each
        self.num_scheduled_tokens += n
        return True

    def after_decode_run(self, order: Sequence[Request]) -> Sequence[Request]:
        """The requests of ``order`` that a granted ``schedule_decode_run`` left to the
        caller, in order: those of ``running`` after the run's members (none for any other
        ``order``)."""
        if order is not self.running or self._in_flight:
            return ()
        return self._q.running[len(self.run):]  # type: ignore[arg-type]

    def _not_in_flight(self) -> Sequence[Request]:
        """The running requests not in a micro-batch still in the pipeline."""
        in_flight = self._in_flight
        if not in_flight:
            return self._q.running
        return [r for r in self._q.running if r.request_id not in in_flight]

    def detach_run(self, planned: bool = True) -> DecodeRun:
        """A pipelined replica's micro-batch holds the decode run's block: the run leaves
        with it (its members are in flight until the batch has run) and the builder keeps a
        new, empty run for the decoding requests not in flight. Returns the run that left,
        for ``attach_run`` once its step is applied. ``planned=False``: the replica repeats
        the run's last block without a plan (sim/cluster/pipeline.py)."""
        run = self.run
        if run is None or (planned and run.scheduled_at != self._step_index):
            raise ValueError("only a run whose block is in this step's plan can leave with it")
        fresh = self._spare_run
        if fresh is None:
            fresh = DecodeRun(self._kv.block_size, run.key)
        self._spare_run = None
        self.run = fresh
        self._run_view = ReadOnly(fresh.members)
        return run

    def attach_run(self, run: DecodeRun) -> None:
        """A run that left with a micro-batch (``detach_run``) has taken its step: its
        members left in it decode again beside the requests not in flight, in one run (the
        smaller joins the larger), or as plain requests if the builder's run was dissolved
        meanwhile (they join it when it is rebuilt)."""
        own = self.run
        if own is None:
            raise ValueError("this builder keeps no decode run")
        run.scheduled_at = -1
        if not own.complete:
            run.dissolve()
        elif len(run) > len(own):
            if own.members:
                run.absorb(own)
            else:  # the empty run serves the next micro-batch that leaves
                own.scheduled_at = -1
                self._spare_run = own
            self.run = run
            self._run_view = ReadOnly(run.members)
        else:
            own.absorb(run)

    @property
    def run_in_plan(self) -> bool:
        """True if this step's plan schedules the decode run as one block (at run step
        ``run_block_step``), or did until someone expanded its rows."""
        run = self.run
        return run is not None and run.scheduled_at == self._step_index

    def dissolve_run(self) -> None:
        """A single-row operation touches a member: turn the run back into plain requests
        (and any block of it in this plan back into rows)."""
        run = self.run
        assert run is not None
        if run.scheduled_at == self._step_index:  # its block is in this plan
            self._plan.scheduled  # expands the blocks into rows  # noqa: B018
            self._granted.update(dict.fromkeys(run.ids, 1))
            run.scheduled_at = -1
        run.dissolve()

    def held_length(self, req: Request) -> int:
        """The KV tokens ``req`` holds here by its end: its whole length (prompt + maximum
        output, ``full_length``), or on a replica that hands requests off after their first
        token, its prompt (the first token needs no slot). What a policy that reserves whole
        lengths up front reserves."""
        return req.prompt_len if self.hands_off else full_length(req)

    # ---- handoff between replicas (disaggregation), called between steps ------------------
    def check_holders(self) -> None:
        """``check_integrity``'s second half (the block manager checks its own books): every
        running request holds GPU blocks for the tokens it has computed, every swapped one
        CPU blocks only, and no waiting request holds any, each in the status its queue
        implies; no request sits in two queues, and every block holder is in a queue or in
        transit (disaggregation). A policy that changed request state behind the builder's
        back fails here, at the step it did so, naming the request."""
        kv, size = self._kv, self._kv.block_size
        gpu, cpu = kv.block_tables, kv.cpu_tables
        q = self._q
        queued = [r.request_id for part in (q.running, q.swapped, q.waiting) for r in part]
        ids = set(queued)
        if len(ids) != len(queued):
            twice = sorted({i for i in queued if queued.count(i) > 1})
            raise KVIntegrityError(f"requests {twice} are in two queues (or one twice)")
        stray = (gpu.keys() | cpu.keys()) - ids - self._in_transit
        if stray:
            raise KVIntegrityError(f"requests {sorted(stray, key=str)} hold blocks but are in "
                                   "no queue and not in transit (finished, yet never freed?)")
        for req in self._q.running:
            held = len(gpu.get(req.request_id, ())) * size
            if req.status is not RequestStatus.RUNNING or held < req.num_computed_tokens:
                raise KVIntegrityError(
                    f"running request {req.request_id} is {req.status.name} and holds GPU "
                    f"slots for {held} of its {req.num_computed_tokens} computed tokens")
        for req in self._q.swapped:
            rid = req.request_id
            if req.status is not RequestStatus.SWAPPED or rid not in cpu or rid in gpu:
                raise KVIntegrityError(f"swapped request {rid} is {req.status.name} and holds "
                                       f"{'no ' if rid not in cpu else ''}CPU blocks"
                                       f"{' and GPU blocks' if rid in gpu else ''}")
        for req in self._q.waiting:
            rid = req.request_id
            if (req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                    or rid in gpu or rid in cpu):
                raise KVIntegrityError(f"waiting request {rid} is {req.status.name} and holds "
                                       f"{'blocks' if rid in gpu or rid in cpu else 'none'}")

    def release_for_handoff(self, req: Request) -> None:
        """Prefill side: take a RUNNING request out of the running set, keeping its blocks
        (they are the transfer's source until ``free_handed_off``)."""
        if req._run is not None:
            self.dissolve_run()
        if req.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {req.request_id} is {req.status.name}, not RUNNING")
        self._q.remove_running(req)
        self._in_transit.add(req.request_id)

    def free_handed_off(self, req: Request) -> None:
        """A request in transit lets go of its blocks here: on the prefill side the transfer
        is done (the source blocks); on the decode side it was aborted before its KV arrived
        (the blocks reserved for it)."""
        self._in_transit.discard(req.request_id)
        self._kv.free(req.request_id)

    def reserve_transfer(self, req: Request, num_tokens: int | None = None,
                         use_watermark: bool = True) -> bool:
        """Decode side: allocate blocks for the request's first ``num_tokens`` tokens (default:
        its computed tokens, the KV about to arrive), above the admission watermark unless
        ``use_watermark`` is False. False (nothing changes) when they do not fit."""
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        if n < req.num_computed_tokens:
            raise ValueError(f"request {req.request_id}: cannot reserve {n} tokens for "
                             f"{req.num_computed_tokens} transferred ones")
        wm = self.watermark_blocks if use_watermark else 0
        if not self._kv.can_allocate(self._kv.blocks_needed(req.request_id, n), wm):
            return False
        if self._kv.allocate_slots(req.request_id, n) is None:
            return False
        self._in_transit.add(req.request_id)
        return True

    def accept_transferred(self, req: Request) -> None:
        """Decode side: the KV has arrived in the reserved blocks; the request joins the
        running set (still RUNNING) and decodes from its next step."""
        if req.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {req.request_id} is {req.status.name}, not RUNNING")
        have = len(self._kv.block_table(req.request_id))
        if have * self._kv.block_size < req.num_computed_tokens:
            raise ValueError(f"request {req.request_id}: {have} reserved blocks cannot hold "
                             f"{req.num_computed_tokens} transferred tokens")
        self._in_transit.discard(req.request_id)
        self._q.add_running(req)
        self.register_computed(req)  # the prefix arrived with the rest of its KV
        if self.run is not None:
            self._transferred.append(req)

    def _join_transferred(self) -> None:
        run = self.run
        for req in self._transferred:
            if run.complete and req._run is None and is_decoding(req):
                run.join(req, self._kv.block_tables[req.request_id])
        self._transferred.clear()

    # ---- internals ----------------------------------------------------------------------
    def _remove_waiting(self, req: Request) -> None:
        w = self._q.waiting
        if w and w[0] is req:
            w.popleft()
        else:
            w.remove(req)

    def _unschedule(self, req: Request) -> None:
        if self._plan.num_blocks:
            self.dissolve_run()
        i = next(i for i, r in enumerate(self.scheduled_requests) if r is req)
        row = self._plan.scheduled.pop(i)
        del self.scheduled_requests[i]
        del self._granted[req.request_id]
        self.num_scheduled_tokens -= row.num_new_tokens
