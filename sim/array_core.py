"""The array core: step_mode=fast for one replica (or for each of several behind a router
that reads only outstanding counts and KV usage: sim/array_cluster.py runs this loop per
replica on a ``Lane``; a replica with pipeline stages has its own loop,
sim/array_pipeline.py), with no simpy event and no block id in the loop, and no per-request
object for FCFS and chunked prefill (a policy with its own waiting order gets each request
as a ``Request``, which lives until the request leaves).

Where every request a policy may run at once fits the pool together (the ``max_num_seqs``
longest requests' blocks, above the watermark), nothing is ever preempted, swapped or refused
a block, and a run is a chain of steps that admit or continue prompts (prefill-only steps for
FCFS, mixed steps for chunked prefill) and decode stretches (every member gains one token per
step). Where the pool can bind, admission counts blocks above the watermark, and a decode
step whose new blocks do not fit is planned on its own: the policy's rule on counts
(``decode_preemptions``) says how many of the last rows in its running order it preempts
(vLLM v1's priority scheduling: which rows, ``decode_victims``, those after a request that
preempted itself sitting the step out)
(under chunked prefill: of every running request, mid-prefill ones included, each needing
its chunk's blocks where prompts take blocks chunk by chunk, vLLM v1's; the step then
carries no chunk), by recompute (waiting again, to re-prefill their prompt and sampled
tokens: the queue head, or an ordered policy's ``requeue``; with the prefix cache on, where
prompts take blocks chunk by chunk, after what is left of their own blocks, followed
through the free queue on counts) or by swap (back in the
order they left, or the policy's running order, as ``resume_swapped`` lets them, in a step
of their own; recomputed when the CPU pool is full); blocks in use only grow between such
steps, so a stretch runs to the last step whose blocks fit (or the policy's next decision
time: an aging deadline may reorder who fits). That chain is computed here on plain
numbers:

* the decoding batch sits in fixed slots; the finishing order comes from a heap keyed by
  (last decode step, arrival index), the running order's ties as the replica breaks them;
  the total and the longest context are a running sum and a lazy max-heap, since a member's
  context is its prompt plus the decode steps taken since it joined;
* decode steps are priced one at a time in plain floats (``Executor.decode_step_pricer``)
  up to the first step that ends at or after the next arrival, or, for batches without such
  a pricer, in arrays ahead of it (``decode_run_durations``); members finishing on the way
  leave at the end of their last step, as in decode jumps past finishes
  (sim/fast_forward.py); steps that carry prompts are priced by the executor on their plan;
* KV blocks are counted, not handed out: a member holds ceil(context / block size) blocks,
  a prompt mid-prefill all of its prompt's, and the blocks in use at any step follow in
  closed form from the members' contexts modulo the block size (``_BlockCount``);
* each request's token times are the end times of the decode steps it took part in, kept
  once per step (not per member) until its last member leaves.

The policy still decides: FCFS and static batching through ``head_admissions`` and chunked
prefill (vLLM v0 and v1, TensorRT-LLM) through ``chunk_plan`` (their rules on plain
numbers, over a queue kept here in arrival order, or in (priority, arrival) order for
vLLM v1's priority scheduling: ``waiting_by_priority``), SGLang through ``prefill_plan`` (a
prefill batch of chunks apart from the decodes, tried again after every decode batch while
requests wait; a decode batch whose blocks do not fit retracts requests by its
``decode_retractions``, to the queue's tail), and a policy with its own waiting order (SJF,
priority) through ``indexed_admissions``: each arrival becomes a ``Request`` handed to its
``on_arrival``, as the replica does, and lives until the request leaves; members finishing
in the same step leave in the policy's running order (``decode_run_key``), as the replica's
rows go. These
are the rules ``schedule`` uses, tested against it; only policy classes that set
``array_core = True`` themselves run here, and only where admitting preempts nobody
(``Policy.may_preempt_to_admit``).
The outputs (requests.csv, steps.csv, summary.json) are the replica loop's to 1e-9 relative
in the times (the same steps, priced by other paths: a duration's last bits may differ),
except ``num_decode_jumps`` (this core's stretches), ``step_engine`` and ``wall_time_s``.
``Simulation.run`` uses it when ``array_core_blocker`` and ``pool_blocker``
(sim/array_inputs.py) find nothing in the way and takes the replica loop otherwise.
tests/test_array_core.py checks it against step-by-step simulation and the replica loop.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from itertools import accumulate, cycle, islice
from typing import TYPE_CHECKING, Any

from sim.array_inputs import (
    INDEX_BITS,
    SLOT_BITS,
    ArrayCoreHost,
    WorkloadArrays,
    pool_can_bind,
    runs_guarded,
)
from sim.fast_forward import _price_until, _steps_before
from sim.kv_manager import blocks_added, blocks_for
from sim.metrics import MetricsCollector
from sim import stop as run_stop
from sim.errors import RunInterrupted
from sim.outputs import (
    FINISHED_REQUEST_LINE,
    REQUEST_COLUMNS,
    STEP_ROW_FORMAT,
    CsvSink,
    DecodeStepRows,
    interrupted_summary,
)
from sim.plan import DecodeBlock, ScheduledRequest, StepPlan
from sim.progress import Progress
from sim.request import Request, RequestStatus
from sim.result import SimulationResult
from sim.step_builder import watermark_blocks

if TYPE_CHECKING:
    from sim.policy import Policy


# Heap keys pack (step, arrival index, slot) into one int: slots and indices have these bits
# (SLOT_BITS, INDEX_BITS: sim/array_inputs.py, whose blockers keep runs within them).
_SLOT_BITS = SLOT_BITS
_INDEX_BITS = INDEX_BITS
_INDEX_MASK = (1 << _INDEX_BITS) - 1
# Contexts stored as offsets from the decode step count may be negative: shift them positive.
_CTX_OFFSET = 1 << 62
# Prefill-only steps priced and kept (the same prompts recur: one-prompt steps mostly).
_PREFILL_PRICES_KEPT = 1 << 16
# Decode step end times older than every member's admission are dropped past this many.
_TIMES_KEPT = 1 << 20
# The longest-context heap is rebuilt from the members past this many entries per seat
# (plus the extra): dead entries leave it only from the top.
_HEAP_PER_SEAT = 4
_HEAP_EXTRA = 64


class _BlockCount:
    """The KV blocks the members hold, in closed form: a member whose context at decode step
    count k is ``c + k`` holds ceil((c + k) / B) blocks; with c = B q + r (0 <= r < B) and
    k = B Q + R that is q + Q + (0 if r + R == 0, 1 if r + R <= B, else 2), so the sum needs
    only the members' sum of q and their count per residue r."""

    __slots__ = ("bs", "count", "members", "sum_q", "_suffix")

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.count = [0] * block_size
        self.sum_q = 0
        self.members = 0
        self._suffix: list[int] | None = None  # sums of count[i:] (i <= B), until a change

    def add(self, c: int, sign: int, i: int = -1) -> None:
        q, r = divmod(c, self.bs)
        self.count[r] += sign
        self.sum_q += sign * q
        self.members += sign
        self._suffix = None

    def at(self, k: int) -> int:
        bs = self.bs
        q, r = divmod(k, bs)
        n = self.members
        if r == 0:
            return self.sum_q + n * q + n - self.count[0]
        suffix = self._suffix
        if suffix is None:
            suffix = self._suffix = [*list(accumulate(reversed(self.count)))[::-1], 0]
        return self.sum_q + n * q + n + suffix[bs + 1 - r]


class _FullLengthCount:
    """The KV blocks the members hold where each holds its whole length (prompt + maximum
    output - 1) from admission on (``Policy.reserves_full_length``): constant while the
    membership stays, so no residue ever grows (``count`` stays zero)."""

    __slots__ = ("count", "full_blocks", "total")

    def __init__(self, block_size: int, full_blocks: Callable[[int], int]) -> None:
        self.count = [0] * block_size
        self.full_blocks = full_blocks  # request index -> its whole length's blocks
        self.total = 0

    def add(self, c: int, sign: int, i: int) -> None:
        self.total += sign * self.full_blocks(i)

    def at(self, k: int) -> int:
        return self.total


class LeftToReplicaLoop(Exception):
    """The array core gives a run up before its summary: the replica loop takes it from the
    start (``Simulation.run``), the message says why."""


class ExactTie(LeftToReplicaLoop):
    """Two events at exactly the same instant (a request arriving as a step ends, say) whose
    order only the replica loop's simpy events decide."""


class GrantOrderMatters(LeftToReplicaLoop):
    """A step of a policy that grants its running requests in arrival order
    (``grants_in_arrival_order``) where a prompt mid-prefill comes before a request that
    decodes and the grants or the rows would follow that order: where the budget may not
    cover both, or the prompt finishes with its first token (with a waiting queue in
    priority order; on a pipelined replica, whenever a micro-batch holds both)."""


class PoolMayBind(LeftToReplicaLoop):
    """A run in which a KV pool might refuse a block: a disaggregated deployment
    (sim/array_disagg.py runs one only while no pool can), or a policy that states no decode
    preemptions (vLLM v1, SGLang) on a pool that can bind, once it does
    (``ArrayCore.guard``)."""


@dataclass(eq=False)
class Lane:
    """One replica of several run on the array core behind a router (sim/array_cluster.py,
    sim/array_disagg.py): what its loop reads besides the run's. ``gate`` and ``lines`` are
    shared by the lanes of a pool: the time of the next request not yet routed (or handed
    off) there, and requests.csv's lines not yet written."""

    replica_id: int
    policy: Policy
    gate: list[float]
    lines: list[str]
    line_format: str  # a finished request's requests.csv line, the cluster columns included
    extra_columns: tuple  # those columns, for a sink kept in memory
    arrivals: array = field(default_factory=lambda: array("d"))  # routed here, in order
    indices: list[int] = field(default_factory=list)  # their arrival indices
    # "replica" (co-located), "prefill" (hands each request off after its first token, its
    # blocks kept until the transfer) or "decode" (takes requests in as their KV arrives).
    role: str = "replica"
    # prefill: each hand-off (time, arrival index, first scheduling); each prompt step
    # (start, end, blocks its prompts hold as it starts and after it); and its steps.csv
    # rows, whose blocks in use the deployment completes (those held for transfers are its
    # to count).
    handoffs: list[tuple[float, int, float]] = field(default_factory=list)
    prompt_steps: list[tuple[float, float, int, int]] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)
    # decode: the requests routed here, by arrival index: first token time and first
    # scheduling (set at the hand-off), and cluster columns (set once the transfer's arrival
    # is known); ``seats``: places for members (its step's token budget).
    joins: dict[int, tuple[float, float]] = field(default_factory=dict)
    extras: dict[int, tuple] = field(default_factory=dict)
    seats: int = 0
    # decode, kept by the deployment and the loop together: blocks reserved for transfers
    # not yet joined; the members' blocks in the last step and after it (set where the loop
    # yields); blocks the requests here hold at their full lengths, and those freed when the
    # last step ended (``freed_at``).
    reserved: int = 0
    in_step: int = 0
    now_blocks: int = 0
    held_full: int = 0
    freed_at: float = -1.0
    freed: int = 0
    # co-located, behind a router that reads KV usage: the blocks in use during the last
    # step (the one ending at the loop's last yield's step end, or in progress at a stretch's
    # pause), kept only where ``reads_kv``.
    reads_kv: bool = False
    step_blocks: int = 0
    # A replica that may plan at the very instant a request reaches it (a pipelined one
    # whose stage 0 is free: sim/array_pipeline.py), not only when its step ends: the
    # router lets its loop take that instant in (``route``).
    wakes_on_arrival: bool = False

    def free_full(self, w: WorkloadArrays, block_size: int) -> Callable[[int, float], None]:
        """(A decode lane.) What its loop tells as request ``i`` finishes at ``end``: its
        blocks at full length are free again then (the deployment reads them)."""
        PL, OL = w.prompt_lens, w.output_lens

        def freed(i: int, end: float) -> None:
            full = blocks_for(PL[i] + OL[i] - 1, block_size)
            self.held_full -= full
            if self.freed_at != end:
                self.freed_at = end
                self.freed = 0
            self.freed += full

        return freed


# Runs the loops of a run: (metrics, requests sink, steps sink, progress) -> the simulated
# end, the steps, the decode stretches and the peak KV usage (the largest of any replica's
# fraction of its blocks in use).
Simulate = Callable[[MetricsCollector, CsvSink, CsvSink, Progress],
                    tuple[float, int, int, float]]


def run_to_end(loop: Generator[Any, None, Any]) -> Any:
    """The value a loop without a lane returns (it never yields)."""
    try:
        next(loop)
    except StopIteration as e:
        return e.value
    raise RuntimeError("the array core waited for a router with no lane")


def finisher(w: WorkloadArrays, metrics: MetricsCollector, req_sink: CsvSink, replica: int,
             line_fmt: str, extra: tuple, lines: list[str], extras: dict[int, tuple] | None = None,
             on_free: Callable[[int, float], None] | None = None,
             cached: dict[int, int] | None = None) -> Callable[..., None]:
    """A loop's ``finish(i, first, sched, end, later, preemptions=0, swaps=0)``: request
    ``i`` finished at ``end`` (first token at ``first``, first scheduled at ``sched``, its
    later token times ``later``): its requests.csv line (``line_fmt``, with the cluster
    columns ``extra``, or a decode replica's own in ``extras``) goes to ``lines`` (written
    4,096 at a time) or, to a sink kept in memory, its row; the metrics count it;
    ``on_free(i, end)`` is told (a decode lane's blocks held at full length). ``cached``:
    the prompt tokens a request found in the prefix cache at its last admission, where
    any (its own blocks, kept through a preemption)."""
    ARR, PL, OL, RID, PRI = w.arrivals, w.prompt_lens, w.output_lens, w.request_ids, w.priorities
    to_file = req_sink.to_file
    write_text = req_sink.write_text
    add_finished = metrics.add_finished

    def finish(i: int, first: float, sched: float, end: float, later: array,
               preemptions: int = 0, swaps: int = 0) -> None:
        arrival = ARR[i]
        sched = float(sched)  # the clock's int 0 for a step at the start
        o = OL[i]
        tpot = repr((end - first) / (o - 1)) if o > 1 else ""
        # A decode replica's requests carry their own cluster columns.
        ex = extra if extras is None else extras.pop(i)
        hit = cached.pop(i, 0) if cached else 0
        if to_file:
            line = line_fmt % (RID[i], replica, PRI[i], arrival, PL[i], o, o, sched,
                               first, end, sched - arrival, first - arrival, tpot,
                               end - arrival, preemptions, swaps, preemptions - swaps, hit, "")
            lines.append(line if extras is None else
                         f"{line[:-2]},{','.join(map(str, ex))}\r\n")
            if len(lines) >= 4096:
                write_text("".join(lines))
                lines.clear()
        else:  # request_row's tuple (tests keep rows in memory)
            req_sink.write((RID[i], replica, "finished", "", PRI[i], repr(arrival), PL[i], o,
                            o, repr(sched), repr(first), repr(end), repr(sched - arrival),
                            repr(first - arrival), tpot, repr(end - arrival), preemptions,
                            swaps, preemptions - swaps, hit, "", *ex))
        if on_free is not None:
            on_free(i, end)
        add_finished(PL[i], arrival, first, end, later)
        if preemptions:
            metrics.num_preemptions += preemptions
            metrics.num_swaps += swaps
            metrics.num_recomputes += preemptions - swaps

    return finish


def transferred(policy: Policy, w: WorkloadArrays, i: int) -> Request:
    """Request ``i`` as a decode replica's policy with its own running order meets it when
    its KV arrives (``on_transferred``), as the replica's does: its prompt computed, its
    first token out."""
    req = Request(w.request_ids[i], w.arrivals[i], w.prompt_lens[i], w.output_lens[i],
                  w.priorities[i])
    req.num_computed_tokens = w.prompt_lens[i]
    req.num_output_tokens = 1
    policy.on_transferred(req)
    return req


class _PriorityWaiting:
    """The waiting queue of a chunked policy whose queue is in (priority, arrival time,
    request id) order (``Policy.waiting_by_priority``: vLLM v1's priority scheduling): a heap
    of arrival indices under that key. Admission reads at most the free seats' worth from its
    head (``head``) and takes the first ones (``popleft``)."""

    __slots__ = ("heap", "w")

    def __init__(self, w: WorkloadArrays) -> None:
        self.w = w
        self.heap: list[tuple[int, float, int, int]] = []

    def extend(self, indices: Any) -> None:
        w, heap = self.w, self.heap
        for i in indices:
            heappush(heap, (w.priorities[i], w.arrivals[i], w.request_ids[i], i))

    def __len__(self) -> int:
        return len(self.heap)

    def head(self, k: int) -> Iterator[int]:
        """The first ``k`` waiting requests in queue order, read lazily (admission reads
        only as far as it goes): a walk down the heap from its top, each costing a log of
        those read however long the queue (on a pool that binds it grows long). The queue
        must not change while it is read."""
        heap = self.heap
        n = len(heap)
        frontier = [(heap[0], 0)] if k > 0 and n else []
        while frontier and k:
            e, j = heappop(frontier)
            yield e[3]
            k -= 1
            c = 2 * j + 1
            if c < n:
                heappush(frontier, (heap[c], c))
                if c + 1 < n:
                    heappush(frontier, (heap[c + 1], c + 1))

    def popleft(self) -> int:
        return heappop(self.heap)[3]

    def first_index(self) -> int:
        return self.heap[0][3]


class _IndexedWaiting:
    """The waiting queue of a policy that keeps its own order (``indexed_admissions``): each
    arrival becomes a ``Request`` handed to the policy's ``on_arrival``, as the replica does;
    the policy's admissions come back as arrival indices. ``held`` keeps the Request of each
    request admitted until it leaves (its finishing order is the policy's running order)."""

    __slots__ = ("held", "index_of", "policy", "w")

    def __init__(self, policy: Policy, w: WorkloadArrays) -> None:
        self.w = w
        self.policy = policy
        self.index_of: dict[Request, int] = {}  # waiting Request -> its arrival index
        self.held: dict[int, Request] = {}  # arrival index -> Request, admitted until it leaves

    def extend(self, indices: range) -> None:
        w, on_arrival, index_of = self.w, self.policy.on_arrival, self.index_of
        for i in indices:
            req = Request(w.request_ids[i], w.arrivals[i], w.prompt_lens[i], w.output_lens[i],
                          w.priorities[i])
            index_of[req] = i
            on_arrival(req)

    def __len__(self) -> int:
        return len(self.index_of)

    def first_index(self) -> int:
        """The arrival index of the request that has waited longest."""
        return min(self.index_of.values())

    def admit(self, now: float, seats: int,
              room: tuple[int, int, int] | None = None) -> list[int]:
        batch = []
        for req in self.policy.indexed_admissions(now, seats, room):  # type: ignore
            i = self.index_of.pop(req)
            self.held[i] = req
            batch.append(i)
        return batch

    def requeue(self, preempted: list[tuple[int, Request]]) -> None:
        """Members preempted by recompute (index, Request; counters as they stand), in the
        order they were preempted: waiting again, in the policy's index (``requeue``)."""
        for i, req in preempted:
            del self.held[i]
            req.num_computed_tokens = 0
            req.transition(RequestStatus.PREEMPTED)
            self.index_of[req] = i
        self.policy.requeue([req for _, req in preempted])  # type: ignore[attr-defined]


class ArrayCore:
    """One run of the array core (see the module docstring); ``run`` returns what
    ``Simulation.run`` does."""

    def __init__(self, sim: ArrayCoreHost, w: WorkloadArrays, pool: Any = None) -> None:
        """``pool``: one side of a disaggregated deployment (sim.cluster.pool.Pool), whose
        policy, executor and memory its lanes use; without one, the run's."""
        self.sim = sim
        self.w = w
        self.executor = sim.executor if pool is None else pool.first_executor
        # (A fresh instance for one replica: a run the core gives up goes to the replica
        # loop with the policy as it was, its own state unmoved.)
        self.policy = (sim.pools[0].make_policy(sim.seed) if pool is None
                       else pool.first_policy)
        memory = sim.memory if pool is None else pool.memory
        #: This pool's prefix cache (a recomputed request finds its own blocks in it).
        self.prefix_caching = (sim.pools[0] if pool is None else pool).enable_prefix_caching
        self.block_size = sim.kv_cfg.block_size if pool is None else pool.block_size
        self.num_gpu_blocks = memory.num_gpu_blocks
        self.num_cpu_blocks = memory.num_cpu_blocks
        self.watermark = watermark_blocks(self.policy.config.kv_watermark, self.num_gpu_blocks)
        #: The pool can run short: admission counts blocks. (A disaggregated deployment's
        #: pools never do: sim/array_disagg.py gives a run up where one could.)
        self.can_bind = pool_can_bind(sim, w) if pool is None else False
        #: Under a policy that states no decode preemptions or retractions on counts
        #: (``runs_guarded``), such a pool runs until a running request's blocks do not fit
        #: (where the policy preempts or retracts): there the run is given up
        #: (``PoolMayBind``). Otherwise (``binding``) decode steps may preempt on counts.
        self.guard = self.can_bind and runs_guarded(self.policy)
        self.binding = self.can_bind and not self.guard
        self.num_swap_fallbacks = 0  # swaps the CPU pool could not hold: recomputed instead
        #: Prefix cache lookups past each request's first admission (prompt tokens), hits
        #: and evictions: a recomputed request's own blocks (sim/array_core.py ``runs``).
        self.cache_counts = [0, 0, 0]
        self._prefill_prices: dict[tuple[int, ...], float] = {}

    def prefill_seconds(self, prompts: tuple[int, ...]) -> float:
        """A prefill-only step of these whole prompts, nothing cached, as the executor prices
        the replica's plan for it. Memoized by the prompts (the cost model keeps its own memo
        by step shape, but building the plan and its shape is most of the cost here)."""
        d = self._prefill_prices.get(prompts)
        if d is None:
            plan = StepPlan([ScheduledRequest(i, 0, p, [], True) for i, p in enumerate(prompts)])
            d = self.executor.execute(plan).duration
            if len(self._prefill_prices) < _PREFILL_PRICES_KEPT:
                self._prefill_prices[prompts] = d
        return d

    def run(self, columns: tuple[str, ...] = REQUEST_COLUMNS,
            simulate: Simulate | None = None,
            more_summary: Callable[[float, bool], dict[str, Any]] | None = None,
            ) -> SimulationResult:
        """The run, its files and its summary. ``simulate`` runs the loops (one replica's by
        default) and returns the simulated end, the steps, the decode stretches and the peak
        KV usage; ``more_summary(end, interrupted)`` adds summary keys (a cluster's)."""
        sim = self.sim
        wall0 = time.perf_counter()
        req_sink, step_sink, metrics, progress = sim.open_outputs(columns, len(self.w.arrivals))
        interrupted: RunInterrupted | None = None
        try:
            if simulate is None:
                end, steps, stretches, blocks, _ = run_to_end(
                    self._loop(metrics, req_sink, step_sink, progress))
                peak = blocks / self.num_gpu_blocks
            else:
                end, steps, stretches, peak = simulate(metrics, req_sink, step_sink, progress)
        except RunInterrupted as e:  # the rows so far are whole: keep them, say so
            interrupted = e
            end, steps, stretches, peak = float("nan"), 0, 0, 0.0
        except BaseException:
            progress.close()
            req_sink.close(complete=False)
            step_sink.close(complete=False)
            raise
        progress.close()
        req_sink.close()
        step_sink.close()
        metrics.first_arrival = self.w.arrivals[0]
        summary = sim.summary(metrics, end, time.perf_counter() - wall0,
                              kv_peak_usage=peak, num_steps=steps,
                              num_decode_jumps=stretches,
                              num_swap_fallbacks=self.num_swap_fallbacks,
                              engine="array_core",
                              # Every prompt is looked up at its first admission, and
                              # again (with its sampled tokens) at each after a recompute,
                              # where the pool that admits it (the prefill pool's, in a
                              # disaggregated deployment) caches prefixes.
                              prefix_cache=((sum(self.w.prompt_lens) + self.cache_counts[0],
                                             *self.cache_counts[1:])
                                            if sim.pools[0].enable_prefix_caching
                                            else (0, 0, 0)))
        if more_summary is not None:
            summary.update(more_summary(end, interrupted is not None))
        if interrupted is not None:  # the loop's own counters are lost with its frame
            sim.write_summary(interrupted_summary(
                {**summary, "num_steps": None, "num_decode_jumps": None,
                 "kv_peak_usage": None, "simulated_duration_s": None}, interrupted))
            raise interrupted
        sim.write_summary(summary)
        return SimulationResult(summary, metrics, [], sim.memory, [], req_sink, step_sink, None)

    def _loop(self, metrics: MetricsCollector, req_sink: CsvSink, step_sink: CsvSink,
              progress: Progress, lane: Lane | None = None,
              ) -> Generator[tuple[float, float, int, int], None,
                             tuple[float, int, int, int, float]]:
        """The run itself, in one function on local names (the hot loop). Returns the
        simulated end, the steps, the decode stretches, the peak KV blocks in use and the
        time spent in steps.

        ``lane``: one replica of several behind a router (sim/array_cluster.py,
        sim/array_disagg.py). Its requests are those routed to it so far (``Lane.arrivals``,
        ``Lane.indices``), and it never plans at or past the next arrival not yet routed
        (``Lane.gate[0]``): there it yields (the time it next plans at, the end of its last
        step, its finished requests, those finished before that step ended) and goes on
        once the router has caught up; a decode stretch that reaches it yields at the step
        in progress and goes on if nothing came here meanwhile. A single replica (no lane)
        takes every request and never yields."""
        w = self.w
        ARR, PL, OL = w.arrivals, w.prompt_lens, w.output_lens
        RID, PRI = w.request_ids, w.priorities
        N = len(ARR)
        INF = float("inf")
        policy = self.policy if lane is None else lane.policy
        replica = 0 if lane is None else lane.replica_id
        # The requests this replica takes, in arrival order: their times and indices (a
        # lane's grow as the router sends it requests).
        QA = ARR if lane is None else lane.arrivals
        QI = None if lane is None else lane.indices
        gate = [INF] if lane is None else lane.gate
        nq = len(QA)
        # A disaggregated deployment's lanes (sim/array_disagg.py): a prefill replica hands
        # each request off after its first token (``handoffs``), a decode replica takes them
        # in as members when their KV arrives (``joins``), blocks reserved for them until then.
        hands_off = lane is not None and lane.role == "prefill"
        takes_in = lane is not None and lane.role == "decode"
        reads_kv = lane is not None and lane.reads_kv
        handoffs = lane.handoffs if hands_off else None
        joins = lane.joins if takes_in else {}
        extras = lane.extras if takes_in else None
        seats_total = lane.seats if takes_in else policy.config.max_num_seqs
        # The policy's step structure: whole prompts in prefill-only steps (head_admissions),
        # decodes first, then prompt chunks in the same step (chunk_plan), or prefill batches
        # of prompt chunks apart from decode batches (prefill_plan: SGLang).
        chunked = policy.implements_chunked_prefill
        prefill_plan = getattr(policy, "prefill_plan", None) if chunked else None
        chunk_plan = (policy.chunk_plan  # type: ignore[attr-defined]
                      if chunked and prefill_plan is None else None)
        planned_at = 0  # S when prefill_plan last planned (decode batches since then)
        idled = False  # no request at all since prefill_plan last planned
        OLMAX = max(OL) if prefill_plan is not None else 0  # (no output estimate above it)
        # A prompt mid-prefill holds its whole prompt's blocks from admission on, or those
        # of the tokens computed so far, or its whole length's (prefill_blocks counts them).
        reserves_full = policy.reserves_full_length
        whole_prompt = policy.holds_whole_prompt or reserves_full

        def full_blocks(i: int) -> int:
            """The blocks of request ``i``'s whole length (prompt + maximum output - 1)."""
            return blocks_for(PL[i] + OL[i] - 1, bs)

        def held_mid_prefill(i: int) -> int:
            """The blocks request ``i`` holds by the end of its prefill (or recompute)."""
            return full_blocks(i) if reserves_full else blocks_for(PEND[i], bs)
        # Prefill-only steps: FCFS's queue in arrival order here (head_admissions), or the
        # policy's own order (indexed_admissions), whose finishers leave in its running order.
        waiting: deque[int] | _IndexedWaiting | _PriorityWaiting
        held: dict[int, Request] | None = None
        running_key: Callable[[Request], Any] | None = None
        admit: Callable[[float, int], list[int]] | None = None
        # A chunked policy's queue in priority order (vLLM v1's priority scheduling):
        # admitted requests may have arrived before running ones, so a prompt mid-prefill
        # may come before a decode in the running order (arrival order); on a pool that
        # binds, its victims go by priority too (``decode_victims``).
        by_priority = chunked and policy.waiting_by_priority()
        if by_priority:
            waiting = _PriorityWaiting(w)
        elif chunked:
            waiting = deque()
        elif callable(getattr(policy, "indexed_admissions", None)):
            waiting = _IndexedWaiting(policy, w)
            held = waiting.held
            running_key = policy.decode_run_key()
            if self.can_bind:
                indexed_admit = waiting.admit

                def admit(now: float, seats: int) -> list[int]:
                    return indexed_admit(now, seats, (num_blocks - blocks_at(S), watermark, bs))
            else:
                admit = waiting.admit
        elif self.can_bind:
            waiting = deque()
            head_admissions = policy.head_admissions  # type: ignore[attr-defined]

            def admit(now: float, seats: int) -> list[int]:
                room = (num_blocks - blocks_at(S), watermark, bs)
                # (A policy that reserves whole lengths admits on them.)
                lengths = ({"lengths": (PL[i] + OL[i] - 1 for i in waiting)}
                           if reserves_full else {})
                k, _ = head_admissions(map(PEND.__getitem__, waiting), seats, room, **lengths)
                return [waiting.popleft() for _ in range(k)]  # type: ignore[union-attr]
        else:
            waiting = deque()
            head_admissions = policy.head_admissions  # type: ignore[attr-defined]

            def admit(now: float, seats: int) -> list[int]:
                k, _ = head_admissions(map(PL.__getitem__, waiting), seats)
                return [waiting.popleft() for _ in range(k)]  # type: ignore[union-attr]
        # A pool that can bind: admission counts blocks, and a decode step whose new
        # blocks do not fit preempts (decode_preemptions). A request recomputed waits at the
        # head of the queue to prefill its prompt and the tokens it sampled (PEND: its
        # pending prefill); one swapped out waits in ``swapped`` (PEND: its context); both
        # keep what they had (``resume``).
        binding = self.binding
        guard = self.guard
        can_bind = self.can_bind
        num_blocks = self.num_gpu_blocks
        watermark = self.watermark
        # (None for a policy whose requests hold their whole lengths: none is preempted.)
        decode_preemptions = getattr(policy, "decode_preemptions", None) if binding else None
        # Victims by priority, anywhere in the running order: a request that preempts itself
        # ends the step's grants, and the members after it sit the step out (``skipped``:
        # out of the batch for that step, their blocks held, back in it after).
        decode_victims = (getattr(policy, "decode_victims", None)
                          if binding and by_priority else None)
        skipped: list[tuple[int, int, float, float, tuple[array, int, int]]] = []
        # (SGLang: its decode batch retracts requests where its new blocks do not fit.)
        decode_retractions = getattr(policy, "decode_retractions", None) if binding else None
        # Prefix caching where prompts take blocks chunk by chunk (vLLM v1) on a pool that
        # binds: a request recomputed leaves its computed full blocks cached in the free
        # queue, and is handed those still there when admitted again (no two requests share
        # content here: only their own). The queue on counts: blocks are taken from its front
        # (``pops`` so far = blocks in use + released - revived, every block never used
        # first) and returned to its back, a request's tail block first. A recomputed
        # request's blocks are taken from the queue from its ``runs`` entry's first pop on
        # (the pops so far and the free blocks ahead of it when it left: num_blocks +
        # released - revived then), those without content first (its last, partial block);
        # its hit is what is left of its full blocks when it is admitted again. That place
        # moves up by the blocks revived ahead of it: under vLLM v1 never (with strict FCFS
        # admission everyone running arrived before everyone waiting, and the latest
        # arrivals leave first, so a request admitted again left after every request still
        # waiting), under SGLang where a request retracted earlier comes back first
        # (retracted requests rejoin the queue's tail).
        self_hits = binding and not whole_prompt and self.prefix_caching
        released = revived = 0
        runs: dict[int, list[int]] = {}  # recomputed, waiting: [first pop, blocks, full, seq]
        run_seq = 0  # blocks returned with content so far, in the order they were
        # A request that finished holding cached blocks (its hit) returns them with content
        # too, last in its blocks: those taken from the queue by the end count as evicted.
        kept_runs: list[tuple[int, int, int, int]] = []  # (seq, first pop, blocks, cached)
        revive_log: list[tuple[int, int, int]] = []  # (seq revived, seqs then, blocks)
        cached_of: dict[int, int] = {}  # prompt tokens found cached at the last admission
        cache_counts = self.cache_counts  # [queries past first admissions, hits, evictions]
        PEND = array("q", PL) if binding else PL
        # Preempted (recomputed and waiting, or swapped out): its first token time, first
        # scheduling, later token times, preemptions and swaps so far.
        resume: dict[int, tuple[float, float, array, int, int]] = {}
        swapped: deque[int] = deque()  # swapped out, in the order they left
        cpu_free = self.num_cpu_blocks
        swap = policy.config.preemption_mode == "swap"
        max_tokens = policy.config.max_num_batched_tokens
        ex = self.executor
        execute = ex.execute
        step_pricer = ex.decode_step_pricer
        run_prices = ex.decode_run_durations
        prefill_seconds = self.prefill_seconds
        record = step_sink.enabled
        rows = DecodeStepRows(step_sink, replica, self.num_gpu_blocks)
        write_rows = rows.write
        write_row = rows.write_step
        # A row of a step that carries prompts; a prefill lane keeps it for the deployment,
        # which adds the blocks held for transfers.
        write_prompt_row: Callable[[tuple], None] = (
            lane.rows.append if hands_off else  # type: ignore[union-attr]
            lambda row: step_sink.write_formatted(row, STEP_ROW_FORMAT))
        bs = self.block_size
        write_text = req_sink.write_text
        line_fmt = FINISHED_REQUEST_LINE if lane is None else lane.line_format
        extra = () if lane is None else lane.extra_columns
        lines: list[str] = [] if lane is None else lane.lines
        # What a request holds: its context's blocks, or its whole length's from admission on.
        blocks: _BlockCount | _FullLengthCount = (
            _FullLengthCount(bs, full_blocks) if reserves_full else _BlockCount(bs))
        blocks_at = blocks.at
        add_blocks = blocks.add

        # Members (prompt done, decoding) in slots.
        slot_ctx = [0] * seats_total  # context at decode step count 0 (prompt - joining S)
        slot_start = [0] * seats_total  # the decode step count when it joined
        slot_first = [0.0] * seats_total
        slot_sched = [0.0] * seats_total
        slot_index = [-1] * seats_total  # the member's request (-1: free)
        slot_out0 = [1] * seats_total  # tokens sampled when it joined (more after a recompute)
        # A member preempted before: its later token times so far, preemptions and swaps.
        slot_prior: list[tuple[array, int, int] | None] = [None] * seats_total
        heap_limit = _HEAP_PER_SEAT * seats_total + _HEAP_EXTRA
        free_slots = list(range(seats_total - 1, -1, -1))
        ends_heap: list[int] = []  # last step << (INDEX + SLOT) | index << SLOT | slot
        max_heap: list[int] = []  # -((ctx + OFFSET) << INDEX | index), lazily cleaned
        alive = bytearray(N)
        shift = _INDEX_BITS + _SLOT_BITS
        slot_mask = (1 << _SLOT_BITS) - 1
        members = 0
        ctx_sum = 0
        last_sum = 0  # the members' last decode steps, summed
        # The longest member context (as stored in slot_ctx) while known: a join can only
        # raise it, and only the member holding it leaving makes it unknown (the heap then).
        longest_c: int | None = None
        # Running requests mid-prefill (chunked prefill), in arrival order: prompt tokens
        # computed, and when first scheduled. Each holds its whole prompt's blocks.
        prefilling: list[int] = []
        computed: dict[int, int] = {}
        scheduled_at: dict[int, float] = {}
        prefill_blocks = 0
        # End times of decode steps: step s ends at times[s - 1 - times_off].
        times = array("d")
        times_off = 0
        times_kept = _TIMES_KEPT
        pricers: dict[int, Callable[[int, int], float] | None] = {}

        # simpy's clock starts at the int 0, and a step row written before it moves says so.
        t: float = 0
        S = 0  # steps in which every member decoded, so far
        nxt = 0
        num_steps = 0
        stretches = 0
        done = 0
        peak = 0
        last_d = 0.0
        last_start = -INF  # when the step that ended at t started
        done_before = 0  # requests finished before the step that ended at t
        idle = 0.0  # time spent waiting for a request
        next_tick = 64  # the progress line's next update
        empty = array("d")

        finish = finisher(w, metrics, req_sink, replica, line_fmt, extra, lines, extras,
                          lane.free_full(w, bs) if takes_in else None,  # type: ignore[union-attr]
                          cached_of if self_hits else None)

        def leaves_cached(i: int, computed_tokens: int) -> None:
            """Request ``i``, preempted by recompute with ``computed_tokens`` computed, is
            about to return its blocks to the free queue, its full ones cached (``runs``;
            the caller counts them ``released``)."""
            nonlocal run_seq
            runs[i] = [num_blocks + released - revived, blocks_for(computed_tokens, bs),
                       computed_tokens // bs, run_seq]
            run_seq += 1

        def leaves_kept(i: int, computed_tokens: int) -> None:
            """Request ``i`` finished with ``computed_tokens`` computed and is about to return
            its blocks, those of its last admission's cache hit still with content."""
            nonlocal run_seq
            hit = cached_of.get(i, 0) // bs
            if hit:
                kept_runs.append((run_seq, num_blocks + released - revived,
                                  blocks_for(computed_tokens, bs), hit))
                run_seq += 1

        def kept_evictions() -> int:
            """The cached blocks of finished requests taken from the queue by the end (when
            no block is in use): each run moves up by the blocks revived ahead of it after it
            was returned (those returned before it, revived after)."""
            if not kept_runs:
                return 0
            shift = [0] * (run_seq + 1)
            for seq, now, hit in revive_log:
                shift[seq + 1] += hit
                shift[now] -= hit
            shift = list(accumulate(shift))
            pops = released - revived
            out = 0
            for seq, first, held_blocks, hit in kept_runs:
                taken = min(max(pops - first + shift[seq], 0), held_blocks)
                out += max(0, taken - (held_blocks - hit))
            return out

        def hit_of(i: int, pops: int, shifted: int = 0) -> int:
            """The blocks request ``i`` (waiting) finds cached when admitted after ``pops``
            blocks were taken from the free queue (``shifted``: blocks revived ahead of
            its own since its ``runs`` entry was last moved)."""
            run = runs.get(i)
            if run is None:
                return 0
            first, held_blocks, full, _ = run
            taken = pops - first + shifted
            if taken <= 0:
                return full
            return max(0, min(full, held_blocks - taken))

        def pending_after_hits(free: int, hits_seen: list[int],
                               order: Iterable[int] | None = None,
                               ) -> Iterator[tuple[int, int]]:
            """The waiting requests (``order``: those first in queue order, where it is not
            the queue's own) and their pending prefill tokens, in queue order, each
            after the blocks it would find cached when its turn comes (``free`` blocks left
            when the first is read); ``hits_seen`` gets each hit, in blocks. Each is read
            once the one before it was admitted whole: an admission cut short (or refused)
            ends admission, and the next is never used."""
            pops = num_blocks - free + released - revived
            ahead: list[tuple[int, int]] = []  # (seq, hit) of those read before it
            for i in waiting if order is None else order:
                run = runs.get(i)
                hit = 0
                if run is not None:
                    seq = run[3]
                    hit = hit_of(i, pops, sum([h for q, h in ahead if q < seq]))
                    ahead.append((seq, hit))
                hits_seen.append(hit)
                yield i, PEND[i] - hit * bs
                pops += blocks_for(PEND[i], bs) - hit

        def readmit(i: int, hit: int) -> None:
            """Request ``i`` is admitted again with ``hit`` of its blocks found cached:
            they leave the free queue (the blocks returned after its own move up)."""
            nonlocal revived
            _, _, full, seq = runs.pop(i)
            cache_counts[0] += PEND[i]
            cache_counts[1] += hit * bs
            cache_counts[2] += full - hit
            cached_of[i] = hit * bs
            if hit:
                revived += hit
                for run in runs.values():
                    if run[3] > seq:
                        run[0] -= hit
                if kept_runs:
                    revive_log.append((seq, run_seq, hit))

        def join(i: int, first: float, sched: float,
                 prior: tuple[array, int, int] | None = None) -> None:
            """Request ``i`` sampled its first token at ``first`` (end of the step that
            finished its prompt; S counts that step's decodes): it decodes from the next.
            ``prior``: a request preempted before, its token times after its first (the one
            a recompute just sampled included), preemptions and swaps. A request swapped
            back in joins before the step it decodes in, its context PEND."""
            nonlocal members, ctx_sum, longest_c, last_sum
            c = PEND[i] - S
            slot = free_slots.pop()
            slot_ctx[slot] = c
            slot_start[slot] = S
            slot_first[slot] = first
            slot_sched[slot] = sched
            slot_index[slot] = i
            if binding:  # (elsewhere every member joins with one token, never preempted)
                out0 = PEND[i] - PL[i] + 1
                slot_out0[slot] = out0
                slot_prior[slot] = prior
            else:
                out0 = 1
            last_sum += S + OL[i] - out0
            heappush(ends_heap, (S + OL[i] - out0) << shift | i << _SLOT_BITS | slot)
            heappush(max_heap, -((c + _CTX_OFFSET) << _INDEX_BITS | i))
            if longest_c is not None and c > longest_c:
                longest_c = c
            alive[i] = 1
            ctx_sum += c
            add_blocks(c, 1, i)
            members += 1

        def evict(slot: int) -> tuple[int, int, tuple[float, float, array, int, int]]:
            """Take the member in ``slot`` out of the batch (preempted at step count S): its
            request, its context (prompt and every token sampled but the last) and what it
            keeps while it waits (``resume``'s entry: first token time, first scheduling,
            later token times, preemptions with this one, swaps before it)."""
            i, c, later, prior = remove(slot)
            if prior is None:
                return i, c + S, (slot_first[slot], slot_sched[slot], later, 1, 0)
            return i, c + S, (slot_first[slot], slot_sched[slot], later, prior[1] + 1, prior[2])

        def remove(slot: int) -> tuple[int, int, array, tuple[array, int, int] | None]:
            """Take the member in ``slot`` out of the batch: its request, its context as
            stored, its token times after the first (those from before a preemption
            included) and what it kept from before (``slot_prior``)."""
            nonlocal members, ctx_sum, longest_c, last_sum, released
            i = slot_index[slot]
            c = slot_ctx[slot]
            if self_hits:
                released += blocks_for(c + S, bs)
            last_sum -= slot_start[slot] + OL[i] - slot_out0[slot]
            if c == longest_c:
                longest_c = None
            ctx_sum -= c
            add_blocks(c, -1, i)
            members -= 1
            alive[i] = 0
            slot_index[slot] = -1
            free_slots.append(slot)
            later = times[slot_start[slot] - times_off:S - times_off]
            prior = slot_prior[slot]
            return i, c, later if prior is None else prior[0] + later, prior

        def forget_evicted() -> None:
            """Drop the heap entries of members evicted (their requests no longer alive)."""
            nonlocal max_heap
            ends_heap[:] = [e for e in ends_heap if alive[(e >> _SLOT_BITS) & _INDEX_MASK]]
            heapify(ends_heap)
            max_heap = [e for e in max_heap if alive[-e & _INDEX_MASK]]
            heapify(max_heap)

        def complete(i: int, end: float, sched: float) -> bool:
            """Request ``i``'s prefill (or recompute), first scheduled at ``sched``, finished
            in the step that ends at ``end`` and sampled a token: it finishes if that was
            its last (True; it holds no blocks then), else it decodes from the next step."""
            nonlocal released
            entry = resume.pop(i, None) if resume else None
            prior = None
            first = end
            if entry is not None:  # preempted before: its first scheduling and tokens
                first, sched, later, preemptions, swaps = entry
                if first is None:  # before its first token
                    first = end
                else:
                    later.append(end)
                prior = (later, preemptions, swaps)
            if PEND[i] - PL[i] + 1 == OL[i]:
                if self_hits:
                    if cached_of:
                        leaves_kept(i, PEND[i])
                    released += blocks_for(PEND[i], bs)
                if prior is None:
                    finish(i, first, sched, end, empty)
                else:
                    finish(i, first, sched, end, *prior)
                return True
            if handoffs is not None:  # its KV leaves for a decode replica, its blocks stay
                handoffs.append((end, i, float(sched)))
                return True
            join(i, first, sched, prior)
            return False

        def leave(end: float, also: list[int] | None = None,
                  last_rows: list[int] | None = None) -> list[int]:
            """The members whose last step is S leave, in the step's row order (arrival, or
            the policy's running order); their indices. ``also``: requests (ascending) that
            finish with their first token in the same decode rows (chunked prefill), finished
            among them in arrival order. ``last_rows``: requests swapped back in this step,
            whose rows follow the others, in that order."""
            left = []
            while ends_heap and ends_heap[0] >> shift == S:
                left.append(heappop(ends_heap))
            if held is not None and len(left) > 1:
                left.sort(key=running_rank)
            if last_rows and len(left) > 1:
                # Swapped back in this step: their rows follow the running ones, in the
                # order they came back.
                late = {(key >> _SLOT_BITS) & _INDEX_MASK: key for key in left}
                back = [late.pop(i) for i in last_rows if i in late]
                left = [key for key in left if (key >> _SLOT_BITS) & _INDEX_MASK in late]
                left += back
            gone = []
            for key in left:
                slot = key & slot_mask
                i = (key >> _SLOT_BITS) & _INDEX_MASK
                if held is not None:
                    del held[i]
                while also and also[0] < i:
                    first = also.pop(0)
                    complete(first, end, scheduled_at.pop(first))
                    gone.append(first)
                if cached_of:
                    leaves_kept(i, slot_ctx[slot] + S)
                _, _, later, prior = remove(slot)
                if prior is None:
                    finish(i, slot_first[slot], slot_sched[slot], end, later)
                else:
                    finish(i, slot_first[slot], slot_sched[slot], end, later, prior[1],
                           prior[2])
                gone.append(i)
            for first in also or ():
                complete(first, end, scheduled_at.pop(first))
                gone.append(first)
            return gone

        def running_rank(key: int) -> Any:
            """Where a member leaving at step S (its ``ends_heap`` key) comes in that step's
            rows: the policy's running order, of the request as it stands when its last
            step is planned."""
            i = (key >> _SLOT_BITS) & _INDEX_MASK
            req = held[i]  # type: ignore[index]
            req.num_output_tokens = OL[i] - 1
            return running_key(req)  # type: ignore[misc]

        def arrived(end: float, start: float) -> int:
            """The index past the last request that has arrived when the step [start, end]
            ends and the next one is planned. One arriving exactly at ``end`` is there only
            if its arrival event was scheduled before the step's end event (simpy breaks
            ties in scheduling order): the replica's arrival process schedules a request's
            arrival when the one before it (a different time) arrives, so a request whose
            predecessor arrived during the step comes after the step ends, and so does one
            whose predecessor arrived exactly at the step's start but after the step was
            planned (it was not there then: index ``nxt`` or later)."""
            hi = bisect_right(QA, end, nxt)
            if hi > nxt and QA[hi - 1] == end:
                g = bisect_left(QA, end, nxt, hi)  # the first arriving at ``end``
                if g and (start < QA[g - 1] or (start == QA[g - 1] and g - 1 >= nxt)):
                    return g
            return hi

        def routed_through(end: float) -> Generator[tuple[float, float, int, int], None, None]:
            """(On a lane.) Wait until every request arriving up to ``end`` is routed."""
            nonlocal nq
            while end >= gate[0]:
                if takes_in:
                    lane.now_blocks = blocks_at(S)  # type: ignore[union-attr]
                yield end, end, done, done_before
                nq = len(QA)  # requests routed here meanwhile

        def took_in(end: float, start: float) -> int:
            """(A decode lane.) The index past the last transfer arrived by ``end``, the end
            of a step that started at ``start`` (or the instant the replica wakes, if equal).
            A transfer arriving exactly as a step ends: simpy's event order decides."""
            hi = bisect_right(QA, end, nxt)
            if start < end and hi > nxt and QA[hi - 1] == end:
                raise ExactTie(f"a transfer reaches replica {replica} exactly as its step ends")
            return hi

        def decode_remaining(ones: list[int]) -> Callable[[int], int]:
            """``prefill_plan``'s view of the decoding requests (the members and the prompts
            one token from done): the output tokens each may still sample, each at most a
            cap, summed."""
            def total(cap: int) -> int:
                if cap >= OLMAX:  # none over the cap: the members' last steps say it
                    return last_sum - members * S + sum(map(outputs_left, ones))
                return (sum([min(slot_start[m] + OL[i] - slot_out0[m] - S, cap)
                             for m, i in enumerate(slot_index) if i >= 0])
                        + sum([min(outputs_left(i), cap) for i in ones]))
            return total

        def longest_ctx() -> int:
            nonlocal max_heap, longest_c
            if longest_c is not None:
                return longest_c
            if len(max_heap) > heap_limit:
                # Entries of members gone are dropped only from the top: rebuild from the
                # members now and then, or those under a longer one would pile up.
                max_heap = [-((slot_ctx[s] + _CTX_OFFSET) << _INDEX_BITS | slot_index[s])
                            for s in range(seats_total) if slot_index[s] >= 0]
                heapify(max_heap)
            while not alive[-max_heap[0] & _INDEX_MASK]:
                heappop(max_heap)
            longest_c = ((-max_heap[0]) >> _INDEX_BITS) - _CTX_OFFSET
            return longest_c

        def grant_blocks(i: int, n: int) -> int:
            """The new blocks a grant of ``n`` tokens takes for request ``i`` mid-prefill
            (prompts taking blocks chunk by chunk)."""
            return blocks_added(computed[i], n, bs)

        def outputs_left(i: int) -> int:
            """The output tokens request ``i``, waiting or mid-prefill, may still sample (a
            recomputed one sampled PEND - PL already)."""
            return OL[i] - PEND[i] + PL[i]

        def running_rows(others: list[int]) -> tuple[dict[int, int], list[int]]:
            """The members (request -> slot), and them with ``others`` (running prompts) in
            arrival order: the running order the preemption and retraction rules read."""
            slot_of = {slot_index[m]: m for m in range(seats_total) if slot_index[m] >= 0}
            return slot_of, sorted([*slot_of, *others])

        def running_chunk_needs() -> dict[int, int]:
            """(Prompts taking blocks chunk by chunk.) The new blocks each running prompt's
            grant this step takes: one token for one a token from done, the policy's chunk
            for the others (0 where the budget does not reach it)."""
            ones, multi = [], []
            for i in prefilling:
                (ones if PEND[i] - computed[i] == 1 else multi).append(i)
            chunks, _ = chunk_plan(members + len(ones), [PEND[i] - computed[i] for i in multi],
                                   iter(()), 0, 0)
            grants = dict.fromkeys(multi, 0)
            grants.update(zip(multi, chunks))
            grants.update(dict.fromkeys(ones, 1))
            return {i: grant_blocks(i, n) for i, n in grants.items()}

        def recompute(i: int, slot: int | None) -> None:
            """Request ``i``, a member in ``slot`` or (None) a prompt mid-prefill, is
            preempted by recompute (the caller puts it back in the queue): it keeps what
            ``resume`` holds, and waits to prefill its prompt and every token it sampled."""
            nonlocal prefill_blocks, released
            if slot is None:
                prefilling.remove(i)
                c = computed.pop(i)
                prefill_blocks -= blocks_for(PEND[i] if whole_prompt else c, bs)
                if self_hits:
                    leaves_cached(i, c)
                    released += blocks_for(c, bs)
                sched = scheduled_at.pop(i)
                prev = resume.get(i)  # a recompute, preempted again
                resume[i] = ((None, sched, array("d"), 1, 0) if prev is None else
                             (*prev[:3], prev[3] + 1, prev[4]))
            else:
                if self_hits:
                    leaves_cached(i, slot_ctx[slot] + S)
                _, c, resume[i] = evict(slot)
                PEND[i] = c + 1

        def sit_out(slot: int) -> None:
            """The member in ``slot`` gets no token this step: out of the batch, its blocks
            still held (``prefill_blocks`` counts them meanwhile), back in it by ``rejoin``."""
            nonlocal released, prefill_blocks
            first, sched = slot_first[slot], slot_sched[slot]
            i, c, later, prior = remove(slot)
            c += S
            if self_hits:  # (its blocks stay its own)
                released -= blocks_for(c, bs)
            prefill_blocks += blocks_for(c, bs)
            skipped.append((i, c, first, sched,
                            (later, 0, 0) if prior is None else (later, *prior[1:])))

        def rejoin() -> None:
            """The members that sat a step out (``sit_out``) are back, their contexts as
            they were."""
            nonlocal prefill_blocks
            for i, c, first, sched, prior in skipped:
                PEND[i] = c
                prefill_blocks -= blocks_for(c, bs)
                join(i, first, sched, prior)
            skipped.clear()

        def preempt_by_priority(rows: list[int], slot_of: dict[int, int | None],
                                needs: list[int], holds: list[int], free: int,
                                ) -> tuple[int, list[int]]:
            """The running requests ``rows`` (arrival order) need ``needs`` new blocks and
            hold ``holds``, ``free`` free: the policy's victims by priority
            (``decode_victims``) are recomputed, waiting again in priority order, and the
            members its loop did not reach sit the step out. Returns how many were
            recomputed, and the prompts mid-prefill the loop reached and kept, whose chunks
            the step grants (``GrantOrderMatters`` where one finishes with it: its row would
            come among the decodes'). A prompt one token from done the loop did not reach
            would get no token in the step, unlike those it reached: ``GrantOrderMatters``
            there too."""
            nonlocal peak
            keys = [(PRI[i], ARR[i], RID[i]) for i in rows]
            victims, reached, low = decode_victims(needs, holds, free, keys)
            peak = max(peak, num_blocks - low)
            out = set(victims)
            kept = []
            for r, i in enumerate(rows):
                if r in out or slot_of.get(i) is not None:
                    continue
                if PEND[i] - computed[i] == 1:
                    if r >= reached:
                        raise GrantOrderMatters(
                            f"replica {replica}'s step at {t!r} s preempts by priority and "
                            "leaves out a prompt one token from done")
                elif r < reached:
                    if PEND[i] - PL[i] + 1 == OL[i]:
                        raise GrantOrderMatters(
                            f"replica {replica}'s step at {t!r} s preempts by priority and "
                            "keeps a prompt mid-prefill that finishes with its chunk")
                    kept.append(i)
            for r in victims:  # (in the order preempted: their blocks go back so)
                recompute(rows[r], slot_of.get(rows[r]))
            waiting.extend([rows[r] for r in victims])
            for r in range(reached, len(rows)):
                slot = slot_of.get(rows[r])
                if r not in out and slot is not None:  # (a prompt left out gets no chunk)
                    sit_out(slot)
            forget_evicted()
            return len(victims), kept

        def retract_decodes(ones: list[int]) -> int:
            """(SGLang) The decode batch's new blocks do not fit: those of the members and of
            the prompts one token from done (``ones``) the policy retracts
            (``decode_retractions``, over them in running order) are recomputed, rejoining
            the queue at its tail in that order. Returns how many."""
            nonlocal planned_at
            slot_of, rows = running_rows(ones)
            ctxs = [computed[i] if slot_of.get(i) is None else slot_ctx[slot_of[i]] + S
                    for i in rows]
            victims = decode_retractions(
                [c + 1 - PL[i] if i in slot_of else PEND[i] - PL[i]
                 for i, c in zip(rows, ctxs)],
                [PL[i] for i in rows], ctxs, [blocks_for(c, bs) for c in ctxs],
                [OL[i] for i in rows], num_blocks - blocks_at(S) - prefill_blocks, bs)
            for r in victims:
                i = rows[r]
                recompute(i, slot_of.get(i))
                waiting.append(i)  # type: ignore[union-attr]
            if victims:
                forget_evicted()
            # The ratio is the retraction's: the decode batches before this one (and this
            # one, if it runs at all) no longer lower it.
            planned_at = S + 1 if members or any(i in computed for i in ones) else S
            return len(victims)

        def fill_through(needs: list[int], holds: list[int], free: int, kept: int) -> int:
            """The most blocks in use while the step's rows take their new blocks in
            running order (``needs``, ``holds``), the first ``kept`` rows granted and the
            rest preempted from the last as each row that finds too few frees them
            (``decode_preemptions``' outcome, replayed for the pool's peak)."""
            low = free
            end = len(needs)
            for r in range(kept):
                need = needs[r]
                while need > free and end > kept:
                    end -= 1
                    free += holds[end]
                free -= need
                low = min(low, free)
            return num_blocks - low

        while lane is not None or done < N:
            if lane is not None:
                # Plan only once every request arriving up to then has been routed: wait
                # for the router (an idle replica, for its next request), or end.
                while True:
                    if waiting or members or prefilling or swapped:
                        plans_at = t
                    elif nxt < nq:  # idle, with a request routed to it
                        plans_at = max(t, QA[nxt])
                    elif gate[0] == INF:  # idle, and nothing left to route
                        if lines:
                            write_text("".join(lines))
                            lines.clear()
                        cache_counts[2] += kept_evictions()
                        return t, num_steps, stretches, peak, t - idle
                    else:
                        plans_at = INF
                    if plans_at < gate[0]:
                        break
                    if takes_in:
                        lane.now_blocks = blocks_at(S)
                    yield plans_at, t if num_steps else -INF, done, done_before
                    nq = len(QA)  # requests routed here meanwhile
                if takes_in:  # transfers reserved here meanwhile
                    prefill_blocks = lane.reserved
            if run_stop.requested:  # stop here, with every finished request's row written
                if lines:
                    write_text("".join(lines))
                run_stop.check()
            if len(times) > times_kept:  # drop the step times no member needs any more
                low = min((slot_start[s] for s in range(seats_total) if slot_index[s] >= 0),
                          default=S)
                del times[:low - times_off]
                times_off = low
            if nxt < nq and QA[nxt] <= t:
                if takes_in:  # transfers arrived: members from this step, in their blocks
                    hi = took_in(t, last_start)
                    for i in QI[nxt:hi]:  # type: ignore[index]
                        if held is not None:
                            held[i] = transferred(policy, w, i)
                        join(i, *joins.pop(i))
                        prefill_blocks -= blocks_for(PL[i], bs)
                    lane.reserved = prefill_blocks  # type: ignore[union-attr]
                else:
                    hi = arrived(t, last_start)
                    waiting.extend(range(nxt, hi) if QI is None else QI[nxt:hi])
                nxt = hi
            if not waiting and not members and not prefilling and not swapped:
                idled = True
                idle += QA[nxt] - t
                t = last_start = QA[nxt]  # idle: the arrivals at t wake the replica
                continue
            if admit is not None and waiting and not swapped:
                batch = admit(t, seats_total - members)
                if batch:  # a prefill-only step of whole prompts
                    k = len(batch)
                    d = prefill_seconds(tuple([PEND[i] for i in batch]))
                    start = last_start = t
                    t += d
                    done_before = done
                    num_steps += 1
                    gone = 0  # blocks of prompts done with their first token
                    for i in batch:
                        if complete(i, t, start):
                            gone += blocks_for(PEND[i], bs)
                            done += 1
                            if held is not None:
                                del held[i]
                    used = blocks_at(S)
                    if used + gone > peak:
                        peak = used + gone
                    if reads_kv:  # its prompts' blocks, those done with it included
                        lane.step_blocks = used + gone  # type: ignore[union-attr]
                    if hands_off:  # the deployment adds the blocks held for transfers
                        lane.prompt_steps.append((start, t, gone, 0))  # type: ignore[union-attr]
                    if record:
                        if lane is not None:  # the row counts the arrivals up to t
                            yield from routed_through(t)
                        queued = len(waiting) + arrived(t, start) - nxt
                        tokens = sum([PEND[i] for i in batch])
                        row = (num_steps, replica, repr(start), repr(d), k, tokens, 0, k, queued,
                               members, 0, used, round(used / self.num_gpu_blocks, 6), 0, 0, 0, 0)
                        write_prompt_row(row)
                    continue
            elif chunked and (waiting or prefilling):
                # Decodes first (members, and prompts one token from done), then chunks; or a
                # prefill batch of chunks alone (prefill_plan), else a decode batch.
                recomputed = 0
                apart = False  # a prefill batch, apart from the decodes
                hits_seen: list[int] = []  # the waiting requests' cache hits, as read
                # Where prompts take blocks chunk by chunk (vLLM v1), the running prompts'
                # grants (a token to one a token from done, the policy's chunks to the
                # others) need blocks too: the step preempts where theirs do not fit either.
                chunk_needs: dict[int, int] | None = None
                over = (binding and prefill_plan is None
                        and blocks_at(S + 1) + prefill_blocks > num_blocks)
                if binding and not whole_prompt and prefilling and not over and chunk_plan:
                    chunk_needs = running_chunk_needs()
                    over = (blocks_at(S + 1) + prefill_blocks + sum(chunk_needs.values())
                            > num_blocks)
                if over:
                    # The running requests' new blocks do not fit: the latest arrivals among
                    # every running request (decoding or mid-prefill) are recomputed (the
                    # policy's decode_preemptions), and the step decodes the rest, with no
                    # chunk.
                    if not whole_prompt and chunk_needs is None:
                        chunk_needs = running_chunk_needs()
                    slot_of, running = running_rows(prefilling)
                    needs, holds = [], []
                    for i in running:
                        m = slot_of.get(i)
                        if m is not None:
                            c = slot_ctx[m] + S
                            needs.append(1 if c % bs == 0 else 0)
                            holds.append(blocks_for(c, bs))
                        elif chunk_needs is None:  # it holds its whole prompt's blocks
                            needs.append(0)
                            holds.append(blocks_for(PEND[i], bs))
                        else:  # it holds its computed tokens' blocks, and takes its grant's
                            needs.append(chunk_needs[i])
                            holds.append(blocks_for(computed[i], bs))
                    free = num_blocks - blocks_at(S) - prefill_blocks
                    kept: list[int] = []  # (prompts mid-prefill a preemption by priority keeps)
                    if decode_victims is not None:
                        if any(PEND[i] - computed[i] > 1 for i in prefilling) and (
                                members + sum([PEND[i] - computed[i] for i in prefilling])
                                > max_tokens):
                            # (A victim's tokens given back would lengthen a chunk after it.)
                            raise GrantOrderMatters(
                                f"replica {replica}'s step at {t!r} s preempts by priority "
                                "with a prompt's chunk cut by the budget")
                        recomputed, kept = preempt_by_priority(running, slot_of, needs,
                                                               holds, free)
                    else:
                        recomputed = decode_preemptions(needs, holds, free)
                        fullest = fill_through(needs, holds, free, len(running) - recomputed)
                        for i in reversed(running[len(running) - recomputed:]):  # as preempted
                            recompute(i, slot_of.get(i))
                            waiting.appendleft(i)  # type: ignore[union-attr]
                        forget_evicted()
                        peak = max(peak, fullest)
                    ones = [i for i in prefilling if PEND[i] - computed[i] == 1]
                    if not members and not ones and not kept:
                        # Every decode preempted (itself, at last) or left out: the
                        # replica's plan is empty and it plans again at once, with no step.
                        rejoin()
                        continue
                    multi = chunks = admitted = []
                    if kept:
                        # The prompts mid-prefill its loop reached and kept: each its whole
                        # pending prefill (the budget covers every running request's).
                        multi = kept
                        chunks = [PEND[i] - computed[i] for i in kept]
                else:
                    ones, multi = [], []
                    for i in prefilling:
                        left = PEND[i] - computed[i]
                        (ones if left == 1 else multi).append(i)
                    if prefill_plan is not None:
                        # (pending prefill, output tokens left): a recomputed request's
                        # pending tokens after what it finds of its own blocks.
                        queue2: Iterator[tuple[int, int]] = (
                            (PEND[i], outputs_left(i)) for i in waiting)
                        hits_kw = {}
                        if runs:
                            # Free when the queue is read: the prompts mid-chunk went first,
                            # each whole (a chunk cut short ends the batch).
                            free = num_blocks - blocks_at(S) - prefill_blocks - sum(
                                [grant_blocks(i, PEND[i] - computed[i]) for i in multi])
                            queue2 = ((n, outputs_left(i))
                                      for i, n in pending_after_hits(free, hits_seen))
                            hits_kw = {"cached_blocks": hits_seen.__getitem__}
                        chunks, admitted = prefill_plan(
                            S - planned_at, decode_remaining(ones),
                            [PEND[i] - computed[i] for i in multi],
                            [computed[i] for i in multi], queue2,
                            members + len(prefilling), num_blocks - blocks_at(S) - prefill_blocks,
                            bs, idled, **hits_kw)
                        planned_at = S
                        idled = False
                        apart = bool(chunks or admitted)
                        if (not apart and decode_retractions is not None
                                and blocks_at(S + 1) + prefill_blocks
                                + sum([grant_blocks(i, 1) for i in ones]) > num_blocks):
                            # The decode batch's new blocks do not fit: retractions.
                            recomputed = retract_decodes(ones)
                            ones = [i for i in ones if i in computed]
                            if not members and not ones:
                                continue  # (everyone retracted: no step, plan again)
                    else:
                        room = None
                        if can_bind:
                            free = num_blocks - blocks_at(S + 1) - prefill_blocks
                            if not whole_prompt:  # once every partial has its tokens' blocks
                                free -= sum([grant_blocks(i, PEND[i] - computed[i])
                                             for i in prefilling])
                            room = (free, watermark, bs)
                        # (A policy that reserves whole lengths admits on them.)
                        rule_kw = ({"lengths": (PL[i] + OL[i] - 1 for i in waiting)}
                                   if reserves_full and room is not None else {})
                        pendings = [PEND[i] - computed[i] for i in multi]
                        seats = seats_total - members - len(prefilling)
                        queue: Iterator[int] = map(PEND.__getitem__, waiting if not by_priority
                                                   else waiting.head(seats))
                        if by_priority and multi:
                            # A prompt mid-prefill before a running request that decodes
                            # (or is one token from done) gets its chunk first: the same
                            # grants as every decode first where the budget covers them all,
                            # and the same rows unless it finishes with its first token.
                            later = max(max(slot_index), ones[-1] if ones else -1)
                            if multi[0] < later and (
                                    members + len(ones) + sum(pendings) > max_tokens
                                    or any(PEND[i] - PL[i] + 1 == OL[i]
                                           for i in multi if i < later)):
                                raise GrantOrderMatters(
                                    f"replica {replica}'s step at {t!r} s grants a prompt "
                                    "mid-prefill before a request that decodes and arrived "
                                    "after it")
                        if runs and room is not None:
                            # Recomputed requests find what is left of their own blocks.
                            queue = (n for _, n in pending_after_hits(
                                room[0], hits_seen, waiting.head(seats) if by_priority
                                else None))
                            rule_kw["cached_blocks"] = lambda seen=hits_seen: seen[-1]
                        chunks, admitted = chunk_plan(members + len(ones), pendings, queue,
                                                      len(waiting), seats, room, **rule_kw)
                        if (admitted and not whole_prompt and room is not None
                                and sum(chunks) != sum(pendings)):
                            # (The room counted every partial's whole pending prefill.)
                            raise PoolMayBind(f"replica {replica} admits at {t!r} s while a "
                                              "prompt mid-prefill is cut short")
                if ones or chunks or admitted or recomputed:
                    new = [waiting.popleft() for _ in admitted]
                    for n, i in enumerate(new):
                        computed[i] = 0
                        if prefilling and i < prefilling[-1]:
                            # (SGLang: a retracted request, back from the queue's tail.)
                            insort(prefilling, i)
                        else:
                            prefilling.append(i)
                        if whole_prompt:
                            prefill_blocks += held_mid_prefill(i)
                        elif i in runs:  # (recomputed, prefix caching on)
                            hit = hits_seen[n]
                            readmit(i, hit)
                            computed[i] = hit * bs
                            prefill_blocks += hit
                    grants = [] if apart else [(i, 1) for i in ones]
                    grants += zip(multi, chunks)
                    grants += zip(new, admitted)
                    if not whole_prompt:  # this step's chunks take their blocks
                        prefill_blocks += sum([grant_blocks(i, n) for i, n in grants])
                    plan = StepPlan([ScheduledRequest(i, computed[i], n, [],
                                                      computed[i] + n == PEND[i])
                                     for i, n in grants])
                    if record:
                        # Rows of one token over a non-empty cache are decode rows
                        # (step_shape).
                        one_token = sum(1 for i, n in grants if n == 1 and computed[i])
                        prompt_tokens = sum(n for i, n in grants if n > 1 or not computed[i])
                    completed = [i for i, n in grants if computed[i] + n == PEND[i]]
                    nd = 0 if apart else members
                    if nd:
                        top = longest_ctx()
                        # Start positions: each member's context before its new token.
                        plan.add_block(DecodeBlock.for_pricing(members, ctx_sum + members * S,
                                                               top + S))
                    d = execute(plan).duration
                    start = last_start = t
                    t += d
                    done_before = done
                    num_steps += 1
                    if not apart:
                        S += 1  # every member decoded
                        times.append(t)
                    used = blocks_at(S) + prefill_blocks
                    if guard and used > num_blocks:
                        raise PoolMayBind(f"replica {replica}'s step at {start!r} s does not "
                                          "fit its KV pool")
                    if used > peak:
                        peak = used
                    if reads_kv:
                        lane.step_blocks = used  # type: ignore[union-attr]
                    at_plan = prefill_blocks
                    for i in new:
                        scheduled_at[i] = start
                    for i, n in grants:
                        computed[i] += n
                    for i in completed:
                        prefilling.remove(i)
                        del computed[i]
                        prefill_blocks -= held_mid_prefill(i)
                    # Sampled in row order: the decode rows in arrival order (members and
                    # prompts one token from done), then the chunks in grant order.
                    also = ([i for i in ones if PEND[i] - PL[i] + 1 == OL[i]]
                            if ones and not apart else None)
                    if not apart and (also or (ends_heap and ends_heap[0] >> shift == S)):
                        done += len(leave(t, also))
                    for i in completed:
                        if i in scheduled_at:  # not finished among the decode rows
                            done += complete(i, t, scheduled_at.pop(i))
                    if skipped:
                        rejoin()
                    if hands_off:  # the deployment adds the blocks held for transfers
                        lane.prompt_steps.append(  # type: ignore[union-attr]
                            (start, t, at_plan, prefill_blocks))
                    if record:
                        if lane is not None:  # the row counts the arrivals up to t
                            yield from routed_through(t)
                        used = blocks_at(S) + prefill_blocks
                        row = (num_steps, replica, repr(start), repr(d), nd + len(grants),
                               prompt_tokens, nd + one_token, nd + len(completed),
                               len(waiting) + arrived(t, start) - nxt,
                               members + len(prefilling), 0, used,
                               round(used / self.num_gpu_blocks, 6), recomputed, 0, 0, 0)
                        write_prompt_row(row)
                    if done >= next_tick:
                        progress.update(done, t)
                        next_tick = done + 64
                    continue
            # One decode step planned on its own (pools that can bind): when its new blocks do
            # not fit (rows in arrival order, the latest arrivals preempted: the policy's
            # decode_preemptions), or when swapped requests come back in it (resume_swapped's
            # order and limits).
            if binding and (swapped or blocks_at(S + 1) + prefill_blocks > num_blocks):
                recomputed = swapped_out = moved_out = moved_in = 0
                resumed: list[int] = []
                if blocks_at(S + 1) + prefill_blocks > num_blocks and decode_retractions:
                    recomputed = retract_decodes([])
                    if not members:
                        continue  # (everyone retracted: no step, plan again)
                elif blocks_at(S + 1) + prefill_blocks > num_blocks:
                    order = [m for m in range(seats_total) if slot_index[m] >= 0]
                    if held is None:  # arrival order
                        order.sort(key=slot_index.__getitem__)
                    else:  # the policy's running order, of its requests as they stand
                        for m in order:
                            held[slot_index[m]].num_output_tokens = (slot_out0[m] + S
                                                                     - slot_start[m])
                        order.sort(key=lambda m: running_key(held[slot_index[m]]))
                    requeued = []
                    ctxs = [slot_ctx[m] + S for m in order]
                    needs = [1 if c % bs == 0 else 0 for c in ctxs]
                    holds = [blocks_for(c, bs) for c in ctxs]
                    k = 0
                    if decode_victims is not None:
                        recomputed, _ = preempt_by_priority(
                            [slot_index[m] for m in order], {slot_index[m]: m for m in order},
                            needs, holds, num_blocks - blocks_at(S))
                        if not members:  # (every member preempted or left out)
                            rejoin()
                            continue
                    else:
                        k = decode_preemptions(needs, holds, num_blocks - blocks_at(S))
                    for slot in reversed(order[len(order) - k:]):  # as preempted: latest first
                        if self_hits:  # (recompute only)
                            leaves_cached(slot_index[slot], slot_ctx[slot] + S)
                        i, c, kept = evict(slot)
                        held_blocks = blocks_for(c, bs)
                        if swap and held_blocks <= cpu_free:  # its blocks go to the CPU pool
                            cpu_free -= held_blocks
                            moved_out += held_blocks
                            swapped_out += 1
                            PEND[i] = c
                            resume[i] = (*kept[:4], kept[4] + 1)
                            swapped.append(i)
                        else:  # recomputed (a swap the CPU pool cannot hold falls back to it)
                            if swap:
                                self.num_swap_fallbacks += 1
                            recomputed += 1
                            PEND[i] = c + 1
                            resume[i] = kept
                            if held is None:
                                waiting.appendleft(i)  # type: ignore[union-attr]
                            else:
                                requeued.append((i, held[i]))
                    if requeued:
                        waiting.requeue(requeued)  # type: ignore[union-attr]
                    forget_evicted()
                    # A row found no free block before anyone was preempted: the pool was full.
                    peak = num_blocks
                else:
                    free = num_blocks - blocks_at(S + 1)  # once every member has its block
                    if held is not None and len(swapped) > 1:  # back in running order
                        swapped = deque(sorted(swapped, key=lambda i: running_key(held[i])))
                    seats = seats_total - members
                    tokens = max_tokens - members
                    while swapped and seats > 0 and tokens > 0:
                        i = swapped[0]
                        held_blocks = blocks_for(PEND[i], bs)
                        if free - held_blocks < watermark:  # swap_in's room
                            break
                        swapped.popleft()
                        # Its blocks back, then its next one (the watermark's block at worst).
                        free -= held_blocks + (PEND[i] % bs == 0)
                        cpu_free += held_blocks
                        moved_in += held_blocks
                        first, sched, later, preemptions, swaps = resume.pop(i)
                        join(i, first, sched, (later, preemptions, swaps))
                        resumed.append(i)
                        seats -= 1
                        tokens -= 1
                if recomputed or swapped_out or moved_in:
                    nd = members
                    # Pricing reads how many blocks move, not which.
                    plan = StepPlan([], swap_out=[(0, 0)] * moved_out,
                                    swap_in=[(0, 0)] * moved_in)
                    if nd:
                        plan.add_block(DecodeBlock.for_pricing(nd, ctx_sum + nd * S,
                                                               longest_ctx() + S))
                    d = last_d = execute(plan).duration
                    start = last_start = t
                    t += d
                    done_before = done
                    num_steps += 1
                    S += 1
                    times.append(t)
                    used = blocks_at(S) + prefill_blocks  # (members that sat it out, theirs)
                    if used > peak:
                        peak = used
                    if reads_kv:
                        lane.step_blocks = used  # type: ignore[union-attr]
                    if ends_heap and ends_heap[0] >> shift == S:
                        done += len(leave(t, None, resumed))
                        if done >= next_tick:
                            progress.update(done, t)
                            next_tick = done + 64
                    if skipped:
                        rejoin()
                    if record:
                        if lane is not None:  # the row counts the arrivals up to t
                            yield from routed_through(t)
                        used = blocks_at(S)
                        step_sink.write_formatted(
                            (num_steps, replica, repr(start), repr(d), nd, 0, nd, nd,
                             len(waiting) + arrived(t, start) - nxt, members, len(swapped), used,
                             round(used / num_blocks, 6), recomputed, swapped_out, moved_out,
                             moved_in), STEP_ROW_FORMAT)
                    continue
            if not members:
                # Waiting requests that cannot be admitted with nobody running: impossible
                # where every request fits the pool alone (and the step's budget).
                head = waiting[0] if type(waiting) is deque else waiting.first_index()
                raise RuntimeError(f"array core: request {RID[head]} can never be admitted")
            # Decode until the next arrival (the steps that start before it), members
            # finishing on the way while nothing waits or is mid-prefill. (A prompt
            # mid-prefill gets a chunk every step unless the decodes take the whole budget.)
            # (A lane's: the next request not yet routed, since any may come to it.)
            horizon = QA[nxt] if nxt < nq else gate[0]
            decision = INF
            if can_bind and held is not None:
                # Where the pool binds, the order may decide who fits: a deadline of the
                # policy's (SJF's aging) may reorder the queue, as an arrival may.
                decision = policy.next_decision_time(t)
                horizon = min(horizon, decision)
            elif prefill_plan is not None and (waiting or prefilling):
                # A prefill batch is tried after every decode batch (its rule may admit at
                # any: SGLang's new_token_ratio falls with each).
                decision = horizon = t
            # (A lane, up to the next request not yet routed: a step past it waits there for
            # the router, and the stretch goes on if nothing was sent here.)
            routing = lane is not None and nxt >= nq and horizon == gate[0]
            cur = S
            longest = longest_ctx()
            while True:
                last = ends_heap[0] >> shift
                length = last - cur
                if can_bind and blocks_at(last) + prefill_blocks > num_blocks:
                    # The steps whose new blocks fit (blocks in use only grow until a
                    # member leaves); the one after them preempts, planned on its own (or,
                    # under the guard, retracts: the replica loop's to run).
                    lo, hi = 0, length
                    while hi - lo > 1:
                        mid = (lo + hi) >> 1
                        if blocks_at(cur + mid) + prefill_blocks <= num_blocks:
                            lo = mid
                        else:
                            hi = mid
                    length = lo
                    if not length:
                        if guard:
                            raise PoolMayBind(f"replica {replica}'s decode step at "
                                              f"{t!r} s does not fit its KV pool")
                        break
                nd = members
                if nd in pricers:
                    pricer = pricers[nd]
                else:
                    pricer = pricers[nd] = step_pricer(nd)
                stretches += 1
                if pricer is not None:
                    # Contexts include each member's new token: step cur + 1 first.
                    x = ctx_sum + nd * (cur + 1)
                    y = longest + cur + 1
                    durs: list[float] = []
                    ends: list[float] = []
                    tt = t
                    j = 0
                    while j < length:
                        dd = pricer(x, y)
                        tt += dd
                        durs.append(dd)
                        ends.append(tt)
                        j += 1
                        if tt >= horizon:
                            if not routing or j == length:
                                break
                            # The router reads this lane at the step in progress (no finish
                            # in it): the stretch goes on only if nothing came here meanwhile
                            # (then its later steps are the ones a new stretch would take).
                            if takes_in:
                                lane.in_step = blocks_at(cur + j)  # type: ignore[union-attr]
                                reserved = lane.reserved  # type: ignore[union-attr]
                            elif reads_kv:
                                lane.step_blocks = (  # type: ignore[union-attr]
                                    blocks_at(cur + j) + prefill_blocks)
                            yield tt, tt, done, done
                            if len(QA) != nq or (takes_in and lane.reserved != reserved):
                                nq = len(QA)  # requests routed here meanwhile
                                break
                            horizon = min(gate[0], decision)
                            if tt >= horizon:  # the policy's deadline passed meanwhile
                                break
                            routing = horizon == gate[0]
                        x += nd
                        y += 1
                else:
                    # Priced ahead in arrays as the replica's jumps size them (a stretch
                    # that falls short of the horizon ends there; the next one goes on).
                    c0, m0 = ctx_sum + nd * (cur + 1), longest + cur + 1
                    durs, ends = _price_until(lambda m: run_prices(nd, c0, m0, m), t, length,
                                              horizon, last_d)  # type: ignore[misc]
                    j = _steps_before(ends, horizon)
                    del ends[j:]
                    del durs[j:]
                times.extend(ends)
                if record and j > 1:
                    starts = [t]
                    starts += ends[:-2]
                    # Blocks in use after each step but the last: a member's count grows
                    # by one in step k + 1 when its context at k is a multiple of the block
                    # size, i.e. its residue is (-k) mod B; so the growth per step walks
                    # the residue counts backwards, cyclically.
                    # (The last entry, after the stretch's last step, is for the peak.)
                    rev = blocks.count[::-1]
                    grow = islice(cycle(rev), bs - 1 - (-cur) % bs, bs - 1 - (-cur) % bs + j)
                    used_list = list(accumulate(grow, initial=blocks_at(cur) + prefill_blocks))
                    used = used_list.pop()
                    del used_list[0]
                    # (A prompt the step grants nothing is running too: SGLang's mid-chunk,
                    # vLLM's whose chunk the decodes leave no budget for.)
                    write_rows(num_steps + 1, starts, durs[:-1], nd, len(waiting),
                               nd + len(prefilling),
                               len(swapped), used_list)
                else:
                    used = -1
                step_start = last_start = ends[-2] if j > 1 else t
                num_steps += j
                last_d = durs[-1]
                t = ends[-1]
                done_before = done
                cur += j
                S = cur
                if used < 0:
                    used = blocks_at(cur) + prefill_blocks
                if used > peak:
                    peak = used
                if takes_in:  # (the deployment reads them where a hand-off meets this step)
                    lane.in_step = used - prefill_blocks  # type: ignore[union-attr]
                elif reads_kv:
                    lane.step_blocks = used  # type: ignore[union-attr]
                if cur == last:
                    done += len(leave(t))
                    if done >= next_tick:
                        progress.update(done, t)
                        next_tick = done + 64
                    used = blocks_at(cur) + prefill_blocks
                if record:
                    if lane is not None:  # the row counts the arrivals up to t
                        yield from routed_through(t)
                    if takes_in:  # those arrived during the step are running, not waiting
                        used = blocks_at(cur) + lane.reserved  # (reserved here meanwhile)
                        queued, running_now = 0, members + took_in(t, step_start) - nxt
                    else:
                        queued = len(waiting) + arrived(t, step_start) - nxt
                        running_now = members + len(prefilling)
                    if swapped:
                        write_rows(num_steps, [step_start], [last_d], nd, queued, running_now,
                                   len(swapped), [used])
                    else:
                        write_row(num_steps, step_start, last_d, nd, queued, running_now, used)
                if (cur != last or not members or t >= horizon or waiting or prefilling
                        or swapped):
                    break
                longest = longest_ctx()
        if lines:
            write_text("".join(lines))
        cache_counts[2] += kept_evictions()
        return t, num_steps, stretches, peak, t - idle
