"""A disaggregated deployment on the array core: step_mode=fast for ``cluster=disaggregated``
behind a prefill router that reads only outstanding counts and a decode router that reads
only those and KV usage (``array_core_blocker`` names what else it needs).

Every replica is the array core's loop (sim/array_core.py) on a ``Lane``, or in a pool with
pipeline stages the pipelined loop (sim/array_pipeline.py), in two passes:

1. The prefill replicas, routed as co-located ones are (``route``, sim/array_cluster.py):
   a request whose first token is not its last is handed off at the end of the step that
   finishes its prompt (with pipeline stages: as that micro-batch leaves the last stage;
   ``Lane.handoffs``) and leaves the replica's count there, as the replica loop's
   ``Replica._handoff`` does; its blocks stay until its transfer ends.
2. The hand-offs, in time order: before each, every decode replica runs until it plans at or
   after it, so the decode router reads the counts it would read then (requests routed
   there, less those finished before that instant) and the KV usage (the blocks of the step
   in progress then, or of the last one if none is, and those reserved for transfers not
   yet arrived); the decode replica reserves the prompt's blocks, and the KV moves over the run's own ``Link`` (a simpy environment of its ports
   only), whose arrivals become the decode replica's requests, members from the step after
   (with pipeline stages: decoding requests not in flight from the arrival on).

Transfers never wait for blocks here: a run is given up (``PoolMayBind``, and the replica
loop takes it) unless at every hand-off the decode replica could hold every request it
holds or has reserved for at its full length above its watermark, within its step's token
budget (so it never refuses a reservation nor preempts), and unless at every prompt step a
prefill replica's prompts and the blocks it holds for transfers fit above its watermark
(so a block never refuses an admission). Prefill replicas write their steps.csv rows once
the transfers' arrivals are known (the blocks they hold for them are in each row), after
the decode replicas' rows.

Where two events that the replica loop orders by simpy's event order meet exactly (a
hand-off as a decode step ends, a transfer arriving as a step ends, a link event at a
hand-off, hand-offs of two prefill replicas at one instant, a transfer arriving as a
pipelined decode replica's micro-batch leaves or its first stage comes free), the run stops
with ``ExactTie``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from heapq import heappop, heappush
from itertools import accumulate
from typing import Any

import simpy

from sim.array_cluster import (
    CountTarget,
    ReplicaFigures,
    count_at,
    drain,
    lanes_summary,
    replica_figures,
    route,
)
from sim.array_core import ArrayCore, ExactTie, Lane, PoolMayBind
from sim.array_inputs import ArrayCoreHost, WorkloadArrays
from sim.array_pipeline import pipelined_loop
from sim.clock import advance
from sim.cluster.disaggregated import transfer_summary
from sim.cluster.link import Link
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS
from sim.cluster.pool import replica_seed
from sim.cluster.router import make_router
from sim.kv_manager import blocks_for
from sim.metrics import MetricsCollector
from sim.outputs import FINISHED_REQUEST_LINE, REQUEST_COLUMNS, STEP_ROW_FORMAT, CsvSink
from sim.progress import PassProgress, Progress
from sim.request import Request
from sim.result import SimulationResult

INF = float("inf")


@dataclass
class _Deployment:
    """The deployment's figures for ``cluster_summary``."""

    replicas: list[ReplicaFigures]
    routed: list[int]
    link: Link
    transfer_time: array = field(default_factory=lambda: array("d"))
    kind: str = "disaggregated"

    def summary(self, sim_end: float) -> dict[str, Any]:
        # No transfer ever waits for blocks here: every wait is nil.
        waits = array("d", bytes(8 * len(self.transfer_time)))
        return transfer_summary(self.link, self.transfer_time, waits, 0, sim_end)


class ArrayDisaggregated:
    """One disaggregated run on the array core (module docstring); ``run`` returns what
    ``Simulation.run`` does, or raises ``ExactTie`` or ``PoolMayBind`` before any summary."""

    def __init__(self, sim: ArrayCoreHost, w: WorkloadArrays) -> None:
        self.sim = sim
        self.w = w
        prefill, decode = sim.pools
        self.prefill_core = ArrayCore(sim, w, prefill)
        self.decode_core = ArrayCore(sim, w, decode)
        num_prefill = prefill.count
        lines: list[str] = []  # requests.csv's lines not yet written, every replica's
        # The next arrival not yet routed (prefill), the next hand-off not yet routed (decode).
        prefill_gate, decode_gate = [INF], [INF]
        # Every replica gets a policy of its own, seeded as the replica loop's pools seed
        # them (the run's own instance stays untouched).
        # A prefill pool with pipeline stages runs each replica in the pipelined loop
        # (sim/array_pipeline.py), which may plan at the very instant a request reaches it.
        self.prefill_stages = prefill.pipeline_parallel
        self.prefill_lanes = [
            Lane(r, prefill.make_policy(replica_seed(sim.seed, r)), prefill_gate, lines,
                 f"{FINISHED_REQUEST_LINE[:-2]},{r},,,,\r\n", (r, "", "", "", ""),
                 role="prefill", wakes_on_arrival=self.prefill_stages > 1)
            for r in range(num_prefill)]
        seats = decode.first_policy.config.max_num_batched_tokens
        self.decode_stages = decode.pipeline_parallel
        self.decode_lanes = [
            Lane(r, decode.make_policy(replica_seed(sim.seed, r)), decode_gate, lines,
                 FINISHED_REQUEST_LINE, (), role="decode", seats=seats,
                 wakes_on_arrival=self.decode_stages > 1)
            for r in range(num_prefill, num_prefill + decode.count)]
        self.routed = [0] * (num_prefill + decode.count)
        self.link = Link(simpy.Environment(), sim.cluster.link, num_prefill + decode.count)
        self.transfer_time = array("d")
        # Each loop's result (end, steps, stretches, peak blocks, time in steps), the peak
        # blocks corrected for what the deployment holds (transfers' blocks).
        self.results: list[tuple[float, int, int, int, float]] = []

    def run(self) -> SimulationResult:
        return self.prefill_core.run(REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS, self._simulate,
                                     self._cluster_summary)

    def _simulate(self, metrics: MetricsCollector, req_sink: CsvSink, step_sink: CsvSink,
                  progress: Progress) -> tuple[float, int, int, float]:
        quiet = Progress(None, False)  # each replica's; the whole run's is updated here
        lanes = self.prefill_lanes
        loops = _loops(self.prefill_core, self.prefill_stages, lanes,
                       (metrics, req_sink, step_sink, quiet))
        choose = make_router(self.sim.cluster.router, self.sim.seed, 0).choose
        # The prefill pass finishes nothing yet (a request whose first token is its last is
        # counted with the decode pass): its line shows how far it has come.
        prompts = PassProgress(progress, "prefill pass", counts=False)
        states = route(self.w, lanes, loops, choose, self.routed, prompts)
        prefill = drain(loops, states, lanes[0].gate, prompts)
        decodes = PassProgress(progress, base=self.w.output_lens.count(1))
        arrivals = self._decode(metrics, req_sink, step_sink, quiet, decodes)
        prefill = self._complete_prefill(prefill, arrivals, step_sink)
        self.results = r = prefill + self.results
        peak = max(x[3] / self._blocks(i) for i, x in enumerate(r))
        return (max(x[0] for x in r), sum(x[1] for x in r), sum(x[2] for x in r), peak)

    def _blocks(self, i: int) -> int:
        """Replica ``i``'s KV blocks."""
        core = self.prefill_core if i < len(self.prefill_lanes) else self.decode_core
        return core.num_gpu_blocks

    def _decode(self, metrics: MetricsCollector, req_sink: CsvSink, step_sink: CsvSink,
                quiet: Progress, progress: PassProgress
                ) -> list[list[tuple[float, float, int]]]:
        """Route the hand-offs, move their KV and run the decode replicas (module
        docstring, 2.). Each prefill replica's transfers: (hand-off, arrival, its blocks
        there), as the link announced their arrivals."""
        sim, w = self.sim, self.w
        RID, ARR, PL, OL, PRI = (w.request_ids, w.arrivals, w.prompt_lens, w.output_lens,
                                 w.priorities)
        lanes = self.decode_lanes
        num_prefill = len(self.prefill_lanes)
        gate = lanes[0].gate
        routed = self.routed
        prefill_pool, decode_pool = sim.pools
        bs_p, bs_d = self.prefill_core.block_size, self.decode_core.block_size
        room = self.decode_core.num_gpu_blocks - self.decode_core.watermark
        seats = lanes[0].seats
        per_token = sim.model.kv_bytes_per_token
        # Parallel rank-to-rank links per transfer: the smaller side's GPUs per replica.
        link_lanes = min(prefill_pool.gpus_per_replica, decode_pool.gpus_per_replica)
        link = self.link
        env = link.env
        router = make_router(sim.cluster.decode_router, sim.seed, 1, "cluster.decode_router")
        choose = router.choose
        reads_kv = not router.reads_only_counts
        num_blocks = self.decode_core.num_gpu_blocks
        targets = [CountTarget() for _ in lanes]
        peaks = [0] * len(lanes)  # blocks in use where a reservation meets a step
        # Arrivals announced by the link (its last event scheduled), per decode replica:
        # (time, order, arrival index), handed to the replica in time order.
        announced: list[list[tuple[float, int, int]]] = [[] for _ in lanes]
        transfers: list[list[tuple[float, float, int]]] = [[] for _ in self.prefill_lanes]
        hand = sorted((h[0], p, k, h[1], h[2]) for p, lane in enumerate(self.prefill_lanes)
                      for k, h in enumerate(lane.handoffs))

        def in_use(j: int, t: float) -> int:
            """Decode replica ``j``'s blocks at hand-off time ``t``: its members' in the step
            in progress (or after its last step, if none is) and those reserved."""
            lane = lanes[j]
            return (lane.in_step if states[j][1] > t else lane.now_blocks) + lane.reserved
        seq = 0

        def on_last(arrival: float, j: int, i: int, p: int, start: float, nbytes: float,
                    blocks: int) -> None:
            nonlocal seq
            heappush(announced[j], (arrival, seq, i))
            seq += 1
            took = arrival - start
            lanes[j].extras[i] = (p, lanes[j].replica_id, int(nbytes), "0.0", repr(took))
            self.transfer_time.append(took)
            transfers[p].append((start, arrival, blocks))

        def release(upto: float) -> None:
            """The decode replicas get the transfers arriving before ``upto`` (gated there);
            an idle one plans at the first (or at its last step's end, if later)."""
            gate[0] = upto
            for j, (heap, lane) in enumerate(zip(announced, lanes)):
                if not heap or heap[0][0] >= upto:
                    continue
                if lane.wakes_on_arrival:  # (pipelined: it takes the instant of the first)
                    states[j] = (min(states[j][0], heap[0][0]), *states[j][1:])
                elif states[j][0] == INF:
                    states[j] = (max(heap[0][0], states[j][1]), *states[j][1:])
                while heap and heap[0][0] < upto:
                    a, _, i = heappop(heap)
                    lane.arrivals.append(a)
                    lane.indices.append(i)

        loops = _loops(self.decode_core, self.decode_stages, lanes,
                       (metrics, req_sink, step_sink, quiet))
        gate[0] = hand[0][0] if hand else 0.0
        states = [next(loop) for loop in loops]
        last_t, last_p = -INF, -1
        for n, (t, p, _, i, sched) in enumerate(hand):
            if t != last_t:
                while env.peek() < t:  # the link's events before the hand-off
                    env.step()
                if env.peek() == t:
                    raise ExactTie(f"request {RID[i]} is handed off exactly as a KV "
                                   "transfer's event happens")
                advance(env, t)
                release(t)
                count_at(t, lanes, loops, states, targets, routed, num_prefill,
                         f"request {RID[i]} is handed off")
                if reads_kv:  # (divided as the block manager's usage is)
                    for j in range(len(lanes)):
                        targets[j].kv_usage = in_use(j, t) / num_blocks
                last_t = t
            elif p != last_p:
                raise ExactTie(f"request {RID[i]} is handed off by two prefill replicas at "
                               "one instant")
            last_p = p
            j = choose(Request(RID[i], ARR[i], PL[i], OL[i], PRI[i]), targets)
            lane = lanes[j]
            full = blocks_for(PL[i] + OL[i] - 1, bs_d)
            held = lane.held_full + (lane.freed if lane.freed_at > t else 0)
            if held + full > room or targets[j].num_outstanding >= seats:
                raise PoolMayBind(
                    f"request {RID[i]}: decode replica {lane.replica_id} might run short of KV "
                    f"blocks or of its step's token budget")
            lane.held_full += full
            lane.reserved += blocks_for(PL[i], bs_d)
            used = in_use(j, t)
            peaks[j] = max(peaks[j], used)
            targets[j].num_outstanding += 1
            targets[j].kv_usage = used / num_blocks  # (what the next hand-off then reads)
            routed[num_prefill + j] += 1
            lane.joins[i] = (t, sched)
            blocks = blocks_for(PL[i], bs_p)
            nbytes = blocks * bs_p * per_token
            env.process(link.transfer(p, lane.replica_id, nbytes, link_lanes,
                                      partial(on_last, j=j, i=i, p=p, start=t, nbytes=nbytes,
                                              blocks=blocks)))
            if n & 1023 == 1023:
                progress.update(sum(s[2] for s in states), t)
        env.run()
        release(INF)  # (a replica with nothing left ends here)
        results = drain(loops, states, gate, progress)
        self.results = [(*r[:3], max(r[3], peak), r[4]) for r, peak in zip(results, peaks)]
        return transfers

    def _complete_prefill(self, results: list[Any],
                          transfers: list[list[tuple[float, float, int]]],
                          step_sink: CsvSink) -> list[tuple[float, int, int, int, float]]:
        """The prefill replicas' blocks held for transfers: each prompt step must have found
        its prompts' blocks free above the watermark, the peak counts them, and each
        steps.csv row (written now) shows them. The loops' results, their peaks corrected."""
        blocks = self.prefill_core.num_gpu_blocks
        room = blocks - self.prefill_core.watermark
        out = []
        for lane, result, sent in zip(self.prefill_lanes, results, transfers):
            held = _held_for_transfers(lane.replica_id, sent)
            peak = 0
            for start, _, prompts, _ in lane.prompt_steps:
                used = held(start) + prompts
                if used > room:
                    raise PoolMayBind(f"prefill replica {lane.replica_id} might run short of "
                                      "KV blocks for its prompts")
                peak = max(peak, used)
            for row, (_, end, _, prompts) in zip(lane.rows, lane.prompt_steps):
                used = held(end) + prompts
                step_sink.write_formatted(
                    (*row[:11], used, round(used / blocks, 6), *row[13:]), STEP_ROW_FORMAT)
            out.append((*result[:3], peak, result[4]))
        return out

    def _cluster_summary(self, end: float, interrupted: bool) -> dict[str, Any]:
        """The deployment's summary keys (``lanes_summary``)."""
        lanes = self.prefill_lanes + self.decode_lanes
        blocks = [self._blocks(i) for i in range(len(lanes))]
        deployment = _Deployment(replica_figures(lanes, self.results, blocks, interrupted),
                                 self.routed, self.link, self.transfer_time)
        return lanes_summary(self.sim, deployment, end, interrupted)


def _loops(core: ArrayCore, stages: int, lanes: list[Lane],
           sinks: tuple[MetricsCollector, CsvSink, CsvSink, Progress],
           ) -> list[Generator[Any, None, Any]]:
    """Each lane's loop on ``core``: the pipelined one where its pool has pipeline stages."""
    if stages > 1:
        return [pipelined_loop(core, *sinks, lane, stages) for lane in lanes]
    return [core._loop(*sinks, lane) for lane in lanes]


def _held_for_transfers(replica_id: int, sent: list[tuple[float, float, int]],
                        ) -> Callable[[float], int]:
    """The blocks prefill replica ``replica_id`` holds for transfers at an instant, from its
    transfers ``sent`` (hand-off, arrival, blocks). A transfer ending exactly then: which of
    the two comes first is simpy's event order (``ExactTie``)."""
    sent = sorted(sent)
    starts = [x[0] for x in sent]
    taken = list(accumulate((x[2] for x in sent), initial=0))
    ended = sorted((x[1], x[2]) for x in sent)
    ends = [x[0] for x in ended]
    freed = list(accumulate((x[1] for x in ended), initial=0))

    def held(now: float) -> int:
        k = bisect_right(ends, now)
        if k and ends[k - 1] == now:
            raise ExactTie(f"a transfer from replica {replica_id} ends exactly as one of its "
                           "steps starts or ends")
        return taken[bisect_right(starts, now)] - freed[k]

    return held
