"""Co-located replicas behind a router on the array core: step_mode=fast for
``cluster.num_replicas`` > 1 where the router reads only outstanding counts and KV usage
(``Router.reads_only_load``), and for replicas with pipeline stages (one or more).

Each replica is the array core's loop (sim/array_core.py; with pipeline stages,
sim/array_pipeline.py's) on a ``Lane``: it takes the requests routed to it and never plans
at or past the next request not yet routed, where it pauses.
The router here takes the requests in arrival order; before routing one arriving at time T it
lets every replica that plans before T go on until it plans at or after T, so each replica's
outstanding count at T (routed there, less finished before T: a step ending after T finishes
its requests after the arrival) is what the replica loop's router would read. A replica's
decode stretch therefore pauses at the step in progress at every arrival (no member
finishes inside a stretch, so its count there is known) and goes on if the request went
elsewhere, or ends with that step if it came here. Its KV usage at T, for a router that reads
it, is that of the step in progress at T: the blocks the step's plan holds (its prompts',
its members' with their new tokens', those finishing at its end included), or none for a
replica idle at T (nothing else holds GPU blocks on the core, which runs no prefix cache). A
replica the router just woke at T plans only after every request arriving at T is routed,
as in the replica loop.

Where a step ends exactly when a request arrives, the replica loop's outcome depends on the
order simpy gives the two events (which the router may see first); the run then stops with
``ExactTie`` and ``Simulation.run`` takes the replica loop from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from math import nextafter
from typing import Any

from sim.array_core import ArrayCore, ExactTie, Lane
from sim.array_inputs import ArrayCoreHost, WorkloadArrays
from sim.array_pipeline import pipelined_loop
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS, cluster_summary
from sim.cluster.pool import replica_seed
from sim.cluster.router import ROUTERS, make_router
from sim.metrics import MetricsCollector
from sim.outputs import FINISHED_REQUEST_LINE, REQUEST_COLUMNS, CsvSink
from sim.progress import PassProgress, Progress
from sim.request import Request
from sim.result import SimulationResult

INF = float("inf")
# A replica's loop on a lane: (core, metrics, requests sink, steps sink, progress, lane) ->
# the generator ``route`` and ``drain`` drive (ArrayCore._loop's protocol).
LaneLoop = Callable[[ArrayCore, MetricsCollector, CsvSink, CsvSink, Progress, Lane],
                    Generator[Any, None, Any]]


class CountTarget:
    """What a router reads of a replica: its outstanding requests at the arrival, and its
    KV usage then (kept only where the router reads it: ``Lane.reads_kv``)."""

    __slots__ = ("kv_usage", "num_outstanding")

    def __init__(self) -> None:
        self.num_outstanding = 0
        self.kv_usage = 0.0


@dataclass
class KVFigures:
    num_gpu_blocks: int
    peak_used_blocks: int


@dataclass
class ReplicaFigures:
    """A replica's figures for ``cluster_summary``."""

    replica_id: int
    kv: KVFigures
    num_steps: int
    busy_time: float


def replica_figures(lanes: list[Lane], results: list[tuple[float, int, int, int, float]],
                    blocks: list[int], interrupted: bool) -> list[ReplicaFigures]:
    """Each lane's figures from its loop's result (end, steps, stretches, peak blocks, time
    in steps) and its KV blocks; zeros for an interrupted run (``lanes_summary`` nulls
    them)."""
    if interrupted:
        results = [(0.0, 0, 0, 0, 0.0)] * len(lanes)
    return [ReplicaFigures(lane.replica_id, KVFigures(n, r[3]), r[1], r[4])
            for lane, r, n in zip(lanes, results, blocks)]


def lanes_summary(sim: ArrayCoreHost, deployment: Any, end: float,
                  interrupted: bool) -> dict[str, Any]:
    """``cluster_summary`` of a deployment run on lanes; an interrupted run's per-replica
    counters (lost with the loops' frames) are null."""
    out = cluster_summary(sim.cluster, sim.pools, deployment, end)
    if interrupted:
        for entry in out["replicas"]:
            entry.update(num_steps=None, busy_fraction=None, kv_peak_usage=None)
    return out


@dataclass
class _Deployment:
    """The co-located deployment's figures for ``cluster_summary``."""

    replicas: list[ReplicaFigures]
    routed: list[int]
    kind: str = "colocated"

    def summary(self, sim_end: float) -> dict[str, Any]:
        return {}


class ArrayCluster:
    """One run of co-located replicas on the array core (module docstring); ``run``
    returns what ``Simulation.run`` does, or raises ``ExactTie`` before any summary."""

    def __init__(self, sim: ArrayCoreHost, w: WorkloadArrays) -> None:
        self.sim = sim
        self.w = w
        self.core = ArrayCore(sim, w)
        # Each replica's loop on its lane: the array core's, or with pipeline stages
        # sim/array_pipeline.py's, whose replica may plan as a request reaches it.
        pp = sim.cluster.pipeline_parallel_size
        self.loop: LaneLoop = partial(pipelined_loop, pp=pp) if pp > 1 else ArrayCore._loop
        pool = sim.pools[0]
        self.gate = [INF]
        lines: list[str] = []  # requests.csv's lines not yet written, every replica's
        # Every replica gets a policy of its own (replica 0 with the run's seed), as the
        # replica loop's pool builds them; the run's own instance stays untouched.
        reads_kv = not ROUTERS.get(str(sim.cluster.router)).reads_only_counts
        self.lanes = [Lane(r, pool.make_policy(replica_seed(sim.seed, r)), self.gate,
                           lines, f"{FINISHED_REQUEST_LINE[:-2]},{r},{r},,,\r\n",
                           (r, r, "", "", ""), reads_kv=reads_kv, wakes_on_arrival=pp > 1)
                      for r in range(pool.count)]
        self.routed = [0] * len(self.lanes)  # requests routed to each replica (so far)
        # Each replica's loop's result: end, steps, stretches, peak blocks, time in steps.
        self.results: list[tuple[float, int, int, int, float]] = []

    def run(self) -> SimulationResult:
        return self.core.run(REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS, self._simulate,
                             self._cluster_summary)

    def _simulate(self, metrics: MetricsCollector, req_sink: CsvSink, step_sink: CsvSink,
                  progress: Progress) -> tuple[float, int, int, float]:
        quiet = Progress(None, False)  # each replica's; the whole run's is updated here
        loops = [self.loop(self.core, metrics, req_sink, step_sink, quiet, lane)
                 for lane in self.lanes]
        choose = make_router(self.sim.cluster.router, self.sim.seed).choose
        states = route(self.w, self.lanes, loops, choose, self.routed, progress,
                       self.core.num_gpu_blocks)
        self.results = r = drain(loops, states, self.gate, progress)
        return (max(x[0] for x in r), sum(x[1] for x in r), sum(x[2] for x in r),
                max(x[3] for x in r) / self.core.num_gpu_blocks)

    def _cluster_summary(self, end: float, interrupted: bool) -> dict[str, Any]:
        """The cluster's summary keys (``lanes_summary``)."""
        blocks = [self.core.num_gpu_blocks] * len(self.lanes)
        deployment = _Deployment(replica_figures(self.lanes, self.results, blocks, interrupted),
                                 self.routed)
        return lanes_summary(self.sim, deployment, end, interrupted)


def route(w: WorkloadArrays, lanes: list[Lane], loops: list[Generator[Any, None, Any]],
          choose: Callable[[Request, list[Any]], int], routed: list[int],
          progress: Progress | PassProgress,
          num_blocks: int = 0) -> list[tuple[float, float, int, int]]:
    """Route every request of ``w`` to one of ``lanes`` (whose ``loops`` go on meanwhile),
    in arrival order, with the router's ``choose``; count them in ``routed``. Each lane's
    last pause. ``num_blocks``: each lane's GPU KV blocks (read where a lane ``reads_kv``)."""
    gate = lanes[0].gate
    ARR, PL, OL, RID, PRI = (w.arrivals, w.prompt_lens, w.output_lens, w.request_ids,
                             w.priorities)
    targets = [CountTarget() for _ in lanes]
    gate[0] = ARR[0]
    states = [next(loop) for loop in loops]
    for a in range(len(ARR)):
        now = gate[0] = ARR[a]
        count_at(now, lanes, loops, states, targets, routed, 0, f"request {RID[a]} arrives",
                 num_blocks)
        req = Request(RID[a], now, PL[a], OL[a], PRI[a])
        r = choose(req, targets)
        routed[r] += 1
        lanes[r].arrivals.append(now)
        lanes[r].indices.append(a)
        if states[r][0] == INF or lanes[r].wakes_on_arrival:  # it plans now, or may
            states[r] = next(loops[r])
        if a & 1023 == 1023:
            progress.update(sum(s[2] for s in states), now)
    return states


def count_at(now: float, lanes: list[Lane], loops: list[Generator[Any, None, Any]],
             states: list[tuple[float, float, int, int]], targets: list[CountTarget],
             routed: list[int], first: int, what: str, num_blocks: int = 0) -> None:
    """Run every lane until it plans at or after ``now``, and set each one's target to its
    outstanding requests at that instant: those sent to it (``routed[first + r]``) less those
    finished before ``now`` (a step ending after it finishes its requests after it).
    ``states``: each lane's last pause (when it plans next, inf while idle with nothing
    routed to it; when its last step ended; its finished requests; those finished before
    that step). A step ending exactly at ``now``: ``ExactTie`` (``what`` happens then).
    A lane that ``reads_kv`` also gets its KV usage then, of ``num_blocks`` (its pool's):
    its last step's blocks if that step is in progress, else none (a lane with work plans at
    the end of its last step, so one whose last step ended before ``now`` is idle). A
    pipelined lane (sim/array_pipeline.py) names its next own event where a lane names its
    last step's end, always after ``now`` once it has paused there, and keeps its blocks in
    use then in ``Lane.step_blocks``."""
    for r, loop in enumerate(loops):
        state = states[r]
        while state[0] < now:
            state = next(loop)
        states[r] = state
        _, last_end, done, before = state
        if last_end == now:
            raise ExactTie(f"{what} exactly as a step of replica {lanes[r].replica_id} ends")
        lane = lanes[r]
        if last_end > now:
            targets[r].num_outstanding = routed[first + r] - before
            if lane.reads_kv:  # (divided as the block manager's usage is)
                targets[r].kv_usage = lane.step_blocks / num_blocks
        else:
            targets[r].num_outstanding = routed[first + r] - done
            if lane.reads_kv:
                targets[r].kv_usage = 0.0


def drain(loops: list[Generator[Any, None, Any]], states: list[tuple], gate: list[float],
          progress: Progress | PassProgress) -> list[Any]:
    """Every request routed: run the lanes' ``loops`` to their ends, the one that plans
    first each time, up to when the next one plans (so steps.csv stays in time order, as far
    as the replica loop keeps it). Where it stops is only where a stretch is cut. Each
    loop's result."""
    results: list[Any] = [None] * len(loops)
    live = set(range(len(loops)))
    steps = 0
    while live:
        order = sorted(live, key=lambda r: states[r][0])
        r = order[0]
        # Up to the next replica's planning time (past its own, on a tie); a replica
        # with nothing left (inf) ends.
        upto = states[order[1]][0] if len(order) > 1 else INF
        gate[0] = upto if upto > states[r][0] else nextafter(states[r][0], INF)
        try:
            states[r] = next(loops[r])
        except StopIteration as e:
            results[r] = e.value
            live.discard(r)
        steps += 1
        if steps & 63 == 0:  # (at the earlier of the two times a lane's pause names)
            progress.update(sum(s[2] for s in states), min(states[r][:2]))
    return results
