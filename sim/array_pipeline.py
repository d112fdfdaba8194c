"""Replicas split into pipeline stages on the array core: step_mode=fast with
``cluster.pipeline_parallel_size`` > 1 under a policy of whole-prompt, prefill-only steps
(FCFS, static batching: ``head_admissions``; SJF, priority: ``indexed_admissions``) or of
chunked steps that grant every decode first (``grants_decodes_first``: vLLM v0's chunked
prefill, TensorRT-LLM's without it; ``chunk_plan``) or every running request in arrival
order (``grants_in_arrival_order``: vLLM v1, TensorRT-LLM; the same grants while no prompt
mid-prefill comes before a request that decodes, and the run is given up where one does:
``GrantOrderMatters``), one replica or several behind a router that reads only outstanding
counts and KV usage (sim/array_cluster.py drives each replica's loop on a ``Lane``), or
the replicas of a disaggregated deployment's pool (sim/array_disagg.py: a prefill replica
hands each request off as its prompt's micro-batch leaves, a decode replica takes each
transfer in among the decoding requests not in flight as its KV arrives). On a
KV pool that can bind, admission counts blocks above the watermark and the run is given up
(``PoolMayBind``) where a micro-batch's decodes' blocks do not fit: the policy would
preempt there, which only the replica loop does. A policy whose requests hold their whole
length from admission (``reserves_full_length``: static batching, TensorRT-LLM's
guaranteed_no_evict) is admitted on whole lengths, which its decodes never outgrow.

The replica loop's pipelined replica (sim/cluster/pipeline.py) is the reference: up to
``stages`` micro-batches are in flight, each built when stage 0 is free from the running
requests not in flight; a batch of duration d takes d / stages in each stage, entering stage
k once it has left stage k - 1 and the batch before it has left stage k (a flow shop), and
its tokens are applied when it leaves the last one. Here that loop runs on plain numbers,
one instant at a time (an arrival, a batch leaving, stage 0 coming free; every arrival up to
an instant is in the queue then, as simpy orders a sleeping replica's wake-up after the
arrivals due with it):

* the policy decides as in its ``schedule``: a prefill-only micro-batch of the waiting
  requests it admits (seats: every running request, in flight or not), else one decode row
  for each decoding request not in flight (requests finishing in one leave in its running
  order); under chunked prefill, a micro-batch of those decode rows with the prompts one
  token from done (in arrival order), then the chunks ``chunk_plan`` grants the prompts
  mid-prefill not in flight and the waiting ones (told how many prompts in flight stay
  mid-prefill once their chunk lands), priced as a plan; a prompt whose chunk leaves
  tokens rejoins those not in flight, in arrival order, when it lands;
* the decoding requests not in flight form a group, and each decode micro-batch takes a
  whole group into the pipeline. A group keeps its members as the array core keeps its
  batch: contexts as offsets from the group's own decode count, the finishing order in a
  heap keyed by (last step, arrival index), the longest context in a lazy max-heap, its
  KV blocks in closed form (``_BlockCount``), and the end times of its micro-batches. A
  group that leaves rejoins those not in flight: the smaller of two is re-based into the
  larger, its members' token times so far kept with them;
* blocks are counted, not handed out, at each micro-batch's planning (where the replica's
  pool takes them: ``kv_peak_usage``; a prompt's all at its admission, or where prompts
  take blocks chunk by chunk, vLLM v1's, each chunk's), and freed as their requests
  finish.

requests.csv (row order included), steps.csv and the summary are the replica loop's, the
times to 1e-9 relative, except ``num_decode_jumps`` (here: runs of decode micro-batches
between prefill ones; the replica loop counts its stretches of repeated ones),
``step_engine`` and ``wall_time_s``. Decode micro-batches are priced in plain floats
(``Executor.decode_step_pricer``), or ahead in arrays up to a group's first finish where the
cost model has no such form, or as a plan: a duration's last bits may differ from the
replica loop's, and so may the instants built on it. An arrival within an ulp or two of a
batch leaving or of stage 0 coming free may then come before it here and after it there
(as between the replica loop and step_mode=exact), where the admission it gets, and so
the schedule after it, may differ; and an arrival exactly at one of the replica loop's
instants (a trace with timestamps taken from such a run) is a tie there, which the core
need not see (``ExactTie`` is raised for its own instants). tests/test_array_pipeline.py
checks it against step-by-step simulation and the replica loop.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Generator
from heapq import heapify, heappop, heappush
from typing import Any

from sim import stop as run_stop
from sim.array_core import (
    ArrayCore,
    ExactTie,
    GrantOrderMatters,
    Lane,
    PoolMayBind,
    _BlockCount,
    _FullLengthCount,
    _IndexedWaiting,
    finisher,
    transferred,
)
from sim.array_inputs import INDEX_BITS
from sim.kv_manager import blocks_added, blocks_for
from sim.metrics import MetricsCollector
from sim.outputs import STEP_ROW_FORMAT, CsvSink
from sim.plan import DecodeBlock, ScheduledRequest, StepPlan
from sim.progress import Progress

INF = float("inf")
_MASK = (1 << INDEX_BITS) - 1
_CTX_OFFSET = 1 << 62  # contexts stored as offsets may be negative: shift them positive
_EMPTY = array("d")
# A group's end times are trimmed (those older than every member's joining) past this many
# more than at its last trim.
_TIMES_KEPT = 4096


def _joined(parts: list[array], last: array) -> array:
    """One array of ``parts`` followed by ``last``."""
    out = array("d")
    for part in parts:
        out += part
    out += last
    return out


class _Group:
    """Decoding requests that go through the pipeline together (module docstring): member
    ``i``'s context after the group's ``S``-th decode micro-batch is ``ctx[i] + S``."""

    __slots__ = ("S", "blocks", "ctx_sum", "ends", "max_heap", "members", "prices",
                 "prices_from", "times", "toff", "top", "trim_at")

    def __init__(self, blocks: _BlockCount | _FullLengthCount) -> None:
        self.S = 0  # decode micro-batches planned for it
        self.members: set[int] = set()
        self.ctx_sum = 0
        # Its next micro-batches' durations from the one after ``prices_from`` on, priced
        # ahead (they hold while its members do).
        self.prices: list[float] = []
        self.prices_from = 0
        self.top: int | None = None  # the longest stored context, while known
        self.ends: list[int] = []  # last step << INDEX_BITS | arrival index
        self.max_heap: list[int] = []  # -((ctx + OFFSET) << INDEX_BITS | index), lazy
        self.blocks = blocks  # the members' KV blocks (empty at first)
        self.times = array("d")  # end of its micro-batch s + 1 at times[s - toff]
        self.toff = 0
        self.trim_at = _TIMES_KEPT  # the length of ``times`` at which to drop old ones


def pipelined_loop(core: ArrayCore, metrics: MetricsCollector, req_sink: CsvSink,
                   step_sink: CsvSink, progress: Progress, lane: Lane, pp: int,
                   ) -> Generator[tuple[float, float, int, int], None,
                                  tuple[float, int, int, int, float]]:
    """A pipelined replica of ``pp`` stages on ``lane`` (module docstring), on local names
    (the hot loop). Returns the simulated end, the micro-batches, the runs of decode
    micro-batches, the peak KV blocks in use and the time stage 0 was busy (each batch's
    share).

    The replica takes the requests routed to it (sim/array_cluster.py: ``Lane.arrivals``,
    growing; one replica behind a router too) and never takes an instant at or past the
    next request not yet routed (``Lane.gate``): there it yields (its next instant, its next
    own event: a batch leaving or stage 0 coming free, its finished requests twice) with its
    KV blocks in use in ``Lane.step_blocks``, and goes on once the router has caught up (a
    router reading it at one of its own events is an ``ExactTie``). Its lane
    ``wakes_on_arrival``: the router resumes it after routing a request to it."""
    w = core.w
    PL, OL = w.prompt_lens, w.output_lens
    N = len(PL)
    policy = lane.policy
    replica = lane.replica_id
    # The requests routed here, in arrival order: their times and indices (they grow as
    # the router sends it requests).
    QA, QI = lane.arrivals, lane.indices
    gate = lane.gate
    # A disaggregated deployment's decode replica (sim/array_disagg.py): its "arrivals" are
    # the transfers, each request joining the decoding ones not in flight as its KV arrives
    # (its blocks reserved until then: ``Lane.reserved``, counted in its blocks in use).
    takes_in = lane.role == "decode"
    joins = lane.joins
    seats_total = lane.seats if takes_in else policy.config.max_num_seqs
    # Its admission: FCFS's from the head of a queue in arrival order (``head_admissions``),
    # or, for a policy with its own waiting order (SJF, priority: ``indexed_admissions``),
    # from its index, each request a ``Request`` from arrival until it leaves (finishers of
    # one micro-batch leave in its running order, ``decode_run_key``).
    indexed = callable(getattr(policy, "indexed_admissions", None))
    # A pool that can bind: admission counts blocks above the watermark (``room``), and the
    # run is given up where a decode micro-batch's blocks do not fit (the policy would
    # preempt there: the replica loop's to run).
    counts = core.can_bind
    watermark = core.watermark
    held: dict[int, Any] | None = None
    if indexed:
        waiting: deque[int] | _IndexedWaiting = _IndexedWaiting(policy, w)
        held = waiting.held
        running_key = policy.decode_run_key()
        indexed_admit = waiting.admit
    else:
        waiting = deque()
    # Chunked prefill that grants every decode first (``grants_decodes_first``): a
    # micro-batch holds the decoding requests not in flight, the prompts one token from
    # done, and chunks of the prompts mid-prefill not in flight and of those it admits
    # (``chunk_plan``, told the prompts in flight that stay mid-prefill); its rows are
    # sampled in that order, the decode rows in arrival order.
    chunked = policy.implements_chunked_prefill
    # Or chunked steps that grant the running requests in arrival order, each what the budget
    # has left (``grants_in_arrival_order``: vLLM v1): the same grants and rows as every
    # decode first while every prompt mid-prefill not in flight arrived after every request
    # that decodes. Where one arrived before (rare: it takes two micro-batches coming free
    # together), the run is given up (``GrantOrderMatters``).
    in_arrival_order = chunked and not policy.grants_decodes_first
    if chunked:
        chunk_plan = policy.chunk_plan  # type: ignore[attr-defined]
    elif not indexed:
        head_admissions = policy.head_admissions  # type: ignore[attr-defined]
    ex = core.executor
    execute = ex.execute
    step_pricer = ex.decode_step_pricer
    run_prices = ex.decode_run_durations
    pricers: dict[int, Any] = {}
    prefill_seconds = core.prefill_seconds
    bs = core.block_size
    num_blocks = core.num_gpu_blocks
    # A policy whose requests hold their whole length from admission on
    # (``reserves_full_length``: TensorRT-LLM's guaranteed_no_evict): admission counts whole
    # lengths, and a decode never takes a block.
    reserves_full = policy.reserves_full_length
    # Where prompts take blocks chunk by chunk (vLLM v1), each grant takes its tokens'.
    whole_prompt = policy.holds_whole_prompt or reserves_full

    def full_blocks(i: int) -> int:
        """The blocks of request ``i``'s whole length (prompt + maximum output - 1)."""
        return blocks_for(PL[i] + OL[i] - 1, bs)

    def held_once_admitted(i: int) -> int:
        """The blocks request ``i`` takes at admission (its prompt's, or its whole
        length's; none where prompts take blocks chunk by chunk: ``chunk_blocks``)."""
        if reserves_full:
            return full_blocks(i)
        return blocks_for(PL[i], bs) if whole_prompt else 0

    def chunk_blocks(i: int, n: int) -> int:
        """The new blocks a grant of ``n`` tokens to prompt ``i`` takes."""
        return 0 if whole_prompt else blocks_added(computed[i], n, bs)

    def new_group() -> _Group:
        return _Group(_FullLengthCount(bs, full_blocks) if reserves_full else _BlockCount(bs))

    record = step_sink.enabled
    # A disaggregated deployment's prefill replica (sim/array_disagg.py) hands each request
    # off as its prompt's micro-batch leaves (its blocks then held for the transfer, which
    # the deployment counts) and keeps its steps' rows and blocks for the deployment, which
    # adds those held for transfers: each micro-batch's blocks as it is planned and after it
    # left (``Lane.prompt_steps``).
    handoffs = lane.handoffs if lane.role == "prefill" else None
    write_row = (step_sink.write_formatted if handoffs is None else
                 lambda row, _: lane.rows.append(row))
    lines = lane.lines
    write_text = req_sink.write_text
    finish = finisher(w, metrics, req_sink, replica, lane.line_format, lane.extra_columns,
                      lines, *((lane.extras, lane.free_full(w, bs)) if takes_in else ()))
    shift = INDEX_BITS

    # Each decoding request: its context offset in its group, its group, the group's
    # decode count when it joined, its last step there, first token time, first
    # scheduling, and its token times from groups it was re-based out of.
    ctx = [0] * N
    group_of: list[_Group | None] = [None] * N
    start = [0] * N
    last = [0] * N
    first = [0.0] * N
    sched = [0.0] * N
    prior: list[list[array] | None] = [None] * N
    # Chunked prefill: each prompt mid-prefill's computed tokens, those not in flight in
    # arrival order, and how many in flight stay mid-prefill once their chunk lands.
    computed: dict[int, int] = {}
    partials: list[int] = []
    mid_in_flight = 0

    def join(g: _Group, i: int, c: int, left: int) -> None:
        """Request ``i`` joins group ``g`` with context ``c``, ``left`` decodes to go."""
        s = g.S
        c -= s
        ctx[i] = c
        group_of[i] = g
        start[i] = s
        last[i] = s + left
        heappush(g.ends, (s + left) << shift | i)
        heappush(g.max_heap, -((c + _CTX_OFFSET) << shift | i))
        g.ctx_sum += c
        g.blocks.add(c, 1, i)
        g.members.add(i)
        g.prices = []
        if g.top is not None and c > g.top:
            g.top = c

    def merge(a: _Group, b: _Group) -> _Group:
        """The union of two groups not in flight: the smaller re-based into the larger
        (each member's context, remaining decodes and token times so far kept)."""
        if len(a.members) < len(b.members):
            a, b = b, a
        s, times, toff = b.S, b.times, b.toff
        for i in b.members:
            later = times[start[i] - toff:s - toff]
            p = prior[i]
            if p is None:
                prior[i] = [later]
            else:
                p.append(later)
            join(a, i, ctx[i] + s, last[i] - s)
        return a

    def longest(g: _Group) -> int:
        """The longest member context of ``g`` (as stored)."""
        heap = g.max_heap
        if len(heap) > 4 * len(g.members) + 64:  # dead entries leave only from the top
            heap[:] = [-((ctx[i] + _CTX_OFFSET) << shift | i) for i in g.members]
            heapify(heap)
        while True:
            key = -heap[0]
            i = key & _MASK
            c = (key >> shift) - _CTX_OFFSET
            if group_of[i] is g and ctx[i] == c:
                return c
            heappop(heap)

    def price_ahead(g: _Group, n: int, s: int, top: int) -> float:
        """The duration of group ``g``'s next micro-batch (``n`` members, ``s`` before
        it, longest context ``top``), pricing its next ones up to its first finish."""
        ctx0, top0 = g.ctx_sum + n * (s + 1), top + s + 1
        ahead = run_prices(n, ctx0, top0, max(1, min((g.ends[0] >> shift) - s, 32)))
        if ahead is None:
            plan = StepPlan()
            plan.add_block(DecodeBlock.for_pricing(n, ctx0 - n, top0 - 1))
            return execute(plan).duration
        g.prices = ahead.tolist()
        g.prices_from = s
        return g.prices[0]

    # In flight, in leave order: (leave, start, the decode group or None, rows, prompt
    # tokens, and where it holds prompts, their grants (request, tokens) in row order with
    # (decode rows, rows sampled, prompts one token from done), else None, None; the blocks
    # in use once it was planned).
    in_flight: deque[tuple[float, float, _Group | None, int, int,
                           list[tuple[int, int]] | None, tuple[int, int, int] | None,
                           int]] = deque()
    stage_free = [0.0] * pp
    later_stages = range(1, pp)
    free_group: _Group | None = None  # the decoding requests not in flight
    nxt = 0
    running = 0  # admitted and not finished (in flight or not)
    used = 0  # KV blocks held
    peak = 0
    busy = 0.0
    num_steps = 0
    runs = 0  # runs of decode micro-batches
    last_was_decode = False
    done = 0
    next_tick = 64

    def finish_first(i: int, at: float) -> None:
        """Request ``i``'s prompt, done in the micro-batch that left at ``at``, sampled its
        only token: it leaves with its blocks."""
        nonlocal used, running, done
        if held is not None:
            del held[i]
        finish(i, at, sched[i], at, _EMPTY)
        used -= full_blocks(i) if reserves_full else blocks_for(PL[i], bs)
        running -= 1
        done += 1

    def running_rank(i: int) -> Any:
        """Where request ``i``, leaving in a decode micro-batch, came in its rows: the
        policy's running order, of the request as it stood when that batch was planned."""
        req = held[i]  # type: ignore[index]
        req.num_output_tokens = OL[i] - 1
        return running_key(req)

    nq = len(QA)
    nxt_arrival = QA[0] if nq else INF
    own = INF  # the next instant of its own: a batch leaving, stage 0 coming free
    # The first instant: simpy's clock starts at the int 0, where requests arriving at 0.0
    # find it.
    wake: float = 0
    while True:
        # (A lane: up to the next request not yet routed, then wait for the router.)
        while wake >= gate[0] < INF:
            lane.step_blocks = lane.in_step = lane.now_blocks = used
            yield wake, own, done, done
            nq = len(QA)  # requests routed here meanwhile
            nxt_arrival = QA[nxt] if nxt < nq else INF
            wake = min(wake, nxt_arrival)
        if wake == INF:  # nothing left
            break
        now = wake
        if run_stop.requested:  # stop here, with every finished request's row written
            if lines:
                write_text("".join(lines))
                lines.clear()
            run_stop.check()
        if nxt_arrival <= now:
            hi = bisect_right(QA, now, nxt, nq)
            if not takes_in:
                waiting.extend(QI[nxt:hi])
            else:  # transfers arrived: decoding, not in flight, in their blocks
                if own == now and QA[hi - 1] == now:
                    raise ExactTie(f"a transfer reaches replica {replica} exactly as one of "
                                   "its micro-batches leaves or its first stage comes free")
                for i in QI[nxt:hi]:
                    if held is not None:
                        held[i] = transferred(policy, w, i)
                    if free_group is None:
                        free_group = new_group()
                    first[i], sched[i] = joins.pop(i)
                    prior[i] = None
                    join(free_group, i, PL[i], OL[i] - 1)
                    b = blocks_for(PL[i], bs)
                    used += b
                    lane.reserved -= b
                running += hi - nxt
            nxt = hi
            nxt_arrival = QA[nxt] if nxt < nq else INF
        # The micro-batch leaving now applies its tokens (leave times only grow).
        if in_flight and in_flight[0][0] <= now:
            leave, began, g, rows, tokens, grants, counts_of, at_plan = in_flight.popleft()
            if g is not None:  # the decode group: every member's next token
                s = g.S
                times = g.times
                times.append(leave)
                ends = g.ends
                toff = g.toff
                gone = []
                while ends and ends[0] >> shift == s:
                    gone.append(heappop(ends) & _MASK)
                if held is not None and len(gone) > 1:  # rows in the policy's running order
                    gone.sort(key=running_rank)
                # Chunked: prompts one token from done that finish with it, among the decode
                # rows (arrival order).
                ends_too = None
                if grants is not None and counts_of[2]:  # type: ignore[index]
                    ends_too = [i for i, _ in grants[:counts_of[2]]  # type: ignore[index]
                                if OL[i] == 1]
                if ends_too:
                    gone = sorted(gone + ends_too)
                for i in gone:
                    if ends_too and i in ends_too:
                        finish_first(i, leave)
                        continue
                    c = ctx[i]
                    g.ctx_sum -= c
                    g.blocks.add(c, -1, i)
                    g.members.discard(i)
                    g.prices = []
                    if c == g.top:
                        g.top = None
                    group_of[i] = None
                    used -= full_blocks(i) if reserves_full else blocks_for(c + s, bs)
                    later = times[start[i] - toff:s - toff]
                    p = prior[i]
                    if p is not None:  # its token times in the groups it was re-based from
                        later = _joined(p, later)
                    if held is not None:
                        del held[i]
                    finish(i, first[i], sched[i], leave, later)
                    running -= 1
                    done += 1
                if g.members:
                    if len(times) > g.trim_at:  # drop the end times no member needs
                        low = min(start[i] for i in g.members)
                        del times[:low - toff]
                        g.toff = low
                        g.trim_at = len(times) + _TIMES_KEPT
                    free_group = g if free_group is None else merge(free_group, g)
            if grants is not None:  # its prompt rows, in grant order: a prompt done samples
                num_ones = counts_of[2]  # type: ignore[index]
                for k, (i, n) in enumerate(grants):
                    c = computed[i] + n
                    if c < PL[i]:  # mid-prefill still: back among those not in flight
                        computed[i] = c
                        insort(partials, i)
                        mid_in_flight -= 1
                        continue
                    del computed[i]
                    if OL[i] == 1:
                        if not (k < num_ones and g is not None):  # (else among the decode rows)
                            finish_first(i, leave)
                    elif handoffs is not None:  # its KV leaves for a decode replica
                        handoffs.append((leave, i, float(sched[i])))
                        if held is not None:
                            del held[i]
                        used -= blocks_for(PL[i], bs)
                        running -= 1
                        done += 1
                    else:
                        if free_group is None:
                            free_group = new_group()
                        first[i] = leave
                        prior[i] = None
                        join(free_group, i, PL[i], OL[i] - 1)
            num_steps += 1
            if handoffs is not None:
                lane.prompt_steps.append((began, leave, at_plan, used))
            if record:
                if grants is not None:
                    decode, sampled = counts_of[0], counts_of[1]  # type: ignore[index]
                else:
                    decode = sampled = rows
                # (A decode lane's blocks reserved for transfers count too.)
                in_use = used + lane.reserved if takes_in else used
                write_row((num_steps, replica, repr(began), repr(leave - began), rows, tokens,
                           decode, sampled, len(waiting), running, 0, in_use,
                           round(in_use / num_blocks, 6), 0, 0, 0, 0), STEP_ROW_FORMAT)
            if done >= next_tick:
                progress.update(done, now)
                next_tick = done + 64
        while True:
            # Stage 0 free and a place in the pipeline: the policy's next micro-batch.
            if len(in_flight) < pp and stage_free[0] <= now and (waiting or running):
                d = -1.0
                grants = counts_of = None
                if chunked:
                    # Every decode first (the group, and the prompts one token from done),
                    # then the chunks chunk_plan grants.
                    g = free_group
                    nd = 0 if g is None else len(g.members)
                    ones, multi = [], []
                    for i in partials:
                        (ones if PL[i] - computed[i] == 1 else multi).append(i)
                    chunks: Any = ()
                    admitted: Any = ()
                    if in_arrival_order and multi and (
                            (ones and ones[-1] > multi[0])
                            or (g is not None and max(g.members) > multi[0])):
                        raise GrantOrderMatters(
                            f"replica {replica}'s micro-batch at {now!r} s grants a prompt "
                            "mid-prefill before a decode that arrived after it")
                    if multi or waiting:
                        room = None
                        plan_kw: dict[str, Any] = {}
                        if counts:  # the free blocks once the decodes have their new ones
                            grow = 0 if g is None else g.blocks.count[-g.S % bs]
                            # (And, chunk by chunk, once the running prompts have the blocks
                            # of all their pending tokens: only then does anyone wait for
                            # admission.)
                            pending_blocks = 0 if whole_prompt else sum(
                                [chunk_blocks(i, PL[i] - computed[i]) for i in ones + multi])
                            room = (num_blocks - used - grow - pending_blocks, watermark, bs)
                            if reserves_full:  # (admitted on their whole lengths)
                                plan_kw["lengths"] = (PL[i] + OL[i] - 1 for i in waiting)
                        if mid_in_flight and not in_arrival_order:
                            plan_kw["in_flight_partials"] = mid_in_flight
                        chunks, admitted = chunk_plan(
                            nd + len(ones), [PL[i] - computed[i] for i in multi],
                            map(PL.__getitem__, waiting), len(waiting), seats_total - running,
                            room, **plan_kw)
                    if ones or chunks or admitted:
                        new = [waiting.popleft() for _ in admitted]  # type: ignore[union-attr]
                        for i in new:
                            computed[i] = 0
                            sched[i] = now
                            used += held_once_admitted(i)
                        running += len(new)
                        grants = [(i, 1) for i in ones]
                        grants += zip(multi, chunks)
                        grants += zip(new, admitted)
                        if not whole_prompt:
                            used += sum([chunk_blocks(i, n) for i, n in grants])
                        plan = StepPlan([ScheduledRequest(i, computed[i], n, [],
                                                          computed[i] + n == PL[i])
                                         for i, n in grants])
                        tokens = 0
                        one_token = 0
                        sampled = nd
                        for i, n in grants:
                            c = computed[i]
                            # (One token over a non-empty cache is a decode row: step_shape.)
                            if n == 1 and c:
                                one_token += 1
                            else:
                                tokens += n
                            if c + n == PL[i]:
                                sampled += 1
                            else:
                                mid_in_flight += 1
                        # Those left out of it: the partials the budget did not reach.
                        partials = multi[len(chunks):]
                        if g is not None:
                            free_group = None
                            s = g.S
                            top = g.top
                            if top is None:
                                top = g.top = longest(g)
                            # Start positions: each member's context before its new token.
                            plan.add_block(DecodeBlock.for_pricing(nd, g.ctx_sum + nd * s,
                                                                   top + s))
                            used += g.blocks.count[-s % bs]  # (as the decode path below)
                            g.S = s + 1
                        if used > num_blocks:
                            raise PoolMayBind(f"replica {replica}'s micro-batch at "
                                              f"{now!r} s does not fit its KV pool")
                        d = execute(plan).duration
                        rows = nd + len(grants)
                        counts_of = (nd + one_token, sampled, len(ones))
                        last_was_decode = False
                elif waiting:
                    room = (num_blocks - used, watermark, bs) if counts else None
                    if indexed:
                        batch = indexed_admit(now, seats_total - running, room)
                        k = len(batch)
                        tokens = sum([PL[i] for i in batch])
                    else:
                        # (A policy that reserves whole lengths admits on them.)
                        kw = ({"lengths": (PL[i] + OL[i] - 1 for i in waiting)}
                              if reserves_full and room is not None else {})
                        k, tokens = head_admissions(map(PL.__getitem__, waiting),
                                                    seats_total - running, room, **kw)
                        batch = [waiting.popleft() for _ in range(k)]  # type: ignore[union-attr]
                    if k:
                        d = prefill_seconds(tuple([PL[i] for i in batch]))
                        for i in batch:
                            sched[i] = now
                            used += held_once_admitted(i)
                            computed[i] = 0
                        running += k
                        g = None
                        rows = k
                        grants = [(i, PL[i]) for i in batch]
                        counts_of = (0, k, 0)
                        last_was_decode = False
                if d < 0 and free_group is not None:
                    g = free_group
                    free_group = None
                    rows = n = len(g.members)
                    s = g.S
                    k = s - g.prices_from
                    if 0 <= k < len(g.prices):
                        d = g.prices[k]
                    else:
                        if n in pricers:
                            pricer = pricers[n]
                        else:
                            pricer = pricers[n] = step_pricer(n)
                        top = g.top
                        if top is None:
                            top = g.top = longest(g)
                        if pricer is not None:  # contexts with each member's new token
                            d = pricer(g.ctx_sum + n * (s + 1), top + s + 1)
                        else:  # priced ahead up to its first finish, as the replica's
                            d = price_ahead(g, n, s, top)
                    # A member's blocks grow by one where its context fills its last
                    # block: those whose stored context's residue is -s modulo the
                    # block size.
                    grow = g.blocks.count[-s % bs]
                    g.S = s + 1
                    used += grow
                    if used > num_blocks:
                        raise PoolMayBind(f"replica {replica}'s decode micro-batch at {now!r} s "
                                          "does not fit its KV pool")
                    tokens = 0
                    if not last_was_decode:
                        runs += 1
                    last_was_decode = True
                if d >= 0:
                    in_use = used + lane.reserved if takes_in else used
                    if in_use > peak:
                        peak = in_use
                    # The flow shop: each stage takes an equal share of the batch (stage
                    # 0 is free now).
                    share = d / pp
                    t = now + share
                    stage_free[0] = t
                    for k in later_stages:
                        free_at = stage_free[k]
                        t = (t if t >= free_at else free_at) + share
                        stage_free[k] = t
                    busy += share
                    in_flight.append((t, now, g, rows, tokens, grants, counts_of, used))
            # Asleep until the next batch leaves, stage 0 comes free or a request
            # arrives (the replica's timeout: its delay added to now).
            own = in_flight[0][0] if in_flight else INF
            free_at = stage_free[0]
            if len(in_flight) < pp and now < free_at < own:
                at = now + (free_at - now)
                if at < nxt_arrival and at < own and at < gate[0]:
                    # Only stage 0 comes free then: plan again there.
                    now = at
                    continue
                own = free_at
            if own < INF:
                own = now + (own - now)
            wake = nxt_arrival if nxt_arrival < own else own
            break
    if running or waiting:
        raise RuntimeError(f"array core: replica {replica}'s {running + len(waiting)} "
                           "requests can never finish")
    if lines:
        write_text("".join(lines))
        lines.clear()
    return now, num_steps, runs, peak, busy
