"""Co-located replicas behind a router on the array core: step_mode=fast for
``cluster.num_replicas`` > 1 where the router reads only outstanding counts
(``Router.reads_only_counts``).

Each replica is the array core's loop (sim/array_core.py) on a ``Lane``: it takes the requests
routed to it and never plans at or past the next request not yet routed, where it pauses.
The router here takes the requests in arrival order; before routing one arriving at time T it
lets every replica that plans before T go on until it plans at or after T, so each replica's
outstanding count at T (routed there, less finished before T: a step ending after T finishes
its requests after the arrival) is what the replica loop's router would read. A replica's
decode stretches therefore stop at every arrival, not only its own.

Where a step ends exactly when a request arrives, the replica loop's outcome depends on the
order simpy gives the two events (which the router may see first); the run then stops with
``ExactTie`` and ``Simulation.run`` takes the replica loop from the start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sim.array_core import ArrayCore, Lane
from sim.array_inputs import ArrayCoreHost, WorkloadArrays
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS, cluster_summary
from sim.cluster.pool import replica_seed
from sim.cluster.router import make_router
from sim.errors import RunInterrupted
from sim.outputs import FINISHED_REQUEST_LINE, REQUEST_COLUMNS, interrupted_summary
from sim.progress import Progress
from sim.request import Request
from sim.result import SimulationResult

INF = float("inf")


class ExactTie(Exception):
    """A request arrived exactly when a replica's step ended: the array core leaves the
    run to the replica loop, whose event order decides which came first."""


class _Target:
    """What a router reads of a replica: its outstanding requests at the arrival."""

    __slots__ = ("num_outstanding",)

    def __init__(self) -> None:
        self.num_outstanding = 0


@dataclass
class _KV:
    num_gpu_blocks: int
    peak_used_blocks: int


@dataclass
class _Replica:
    """A replica's figures for ``cluster_summary``."""

    replica_id: int
    kv: _KV
    num_steps: int
    busy_time: float


@dataclass
class _Deployment:
    """The co-located deployment's figures for ``cluster_summary``."""

    replicas: list[_Replica]
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

    def run(self) -> SimulationResult:
        sim, w, core = self.sim, self.w, self.core
        wall0 = time.perf_counter()
        n = len(w.arrivals)
        req_sink, step_sink, metrics, progress = sim.open_outputs(
            REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS, n)
        pool = sim.pools[0]
        gate = [INF]
        lines: list[str] = []
        # Every replica gets a policy of its own (replica 0 with the run's seed), as the
        # replica loop's pool builds them; the run's own instance stays untouched.
        lanes = [Lane(r, pool.make_policy(replica_seed(sim.seed, r)), gate, lines,
                      f"{FINISHED_REQUEST_LINE[:-2]},{r},{r},,,\r\n", (r, r, "", "", ""))
                 for r in range(pool.count)]
        quiet = Progress(None, False)  # each replica's; the whole run's is updated here
        loops = [core._loop(metrics, req_sink, step_sink, quiet, lane) for lane in lanes]
        interrupted: RunInterrupted | None = None
        routed = [0] * len(lanes)  # requests routed to each replica (so far, if stopped)
        try:
            self._route(lanes, loops, gate, progress, routed)
            results = []
            for loop in loops:  # nothing left to route: each runs to its end
                try:
                    while True:
                        next(loop)
                except StopIteration as e:
                    results.append(e.value)
        except RunInterrupted as e:  # the rows so far are whole: keep them, say so
            interrupted = e
            results = [(float("nan"), 0, 0, 0, 0.0)] * len(lanes)
        except BaseException:
            progress.close()
            req_sink.close(complete=False)
            step_sink.close(complete=False)
            raise
        if lines and interrupted is None:
            req_sink.write_text("".join(lines))
        progress.close()
        req_sink.close()
        step_sink.close()
        metrics.first_arrival = w.arrivals[0]
        end = max(r[0] for r in results)
        blocks = core.num_gpu_blocks
        summary = sim.summary(metrics, end, time.perf_counter() - wall0,
                              kv_peak_usage=max(r[3] for r in results) / blocks,
                              num_steps=sum(r[1] for r in results),
                              num_decode_jumps=sum(r[2] for r in results),
                              num_swap_fallbacks=core.num_swap_fallbacks,
                              engine="array_core",
                              prefix_cache=(sum(w.prompt_lens) if sim.prefix_caching else 0,
                                            0, 0))
        deployment = _Deployment([_Replica(lane.replica_id, _KV(blocks, r[3]), r[1], r[4])
                                  for lane, r in zip(lanes, results)], routed)
        summary.update(cluster_summary(sim.cluster, sim.pools, deployment, end))
        if interrupted is not None:  # the loops' own counters are lost with their frames
            for entry in summary["replicas"]:
                entry.update(num_steps=None, busy_fraction=None, kv_peak_usage=None)
            sim.write_summary(interrupted_summary(
                {**summary, "num_steps": None, "num_decode_jumps": None,
                 "kv_peak_usage": None, "simulated_duration_s": None}, interrupted))
            raise interrupted
        sim.write_summary(summary)
        return SimulationResult(summary, metrics, [], sim.memory, [], req_sink, step_sink, None)

    def _route(self, lanes: list[Lane], loops: list, gate: list[float], progress: Progress,
               routed: list[int]) -> None:
        """Route every request, in arrival order, counting them in ``routed``."""
        sim, w = self.sim, self.w
        ARR, PL, OL, RID, PRI = (w.arrivals, w.prompt_lens, w.output_lens, w.request_ids,
                                 w.priorities)
        choose = make_router(sim.cluster.router, sim.seed).choose
        targets = [_Target() for _ in lanes]
        # Each replica's last pause: when it plans next (inf: idle, nothing routed to it),
        # when its last step ended, its finished requests, those finished before that step.
        gate[0] = ARR[0]
        states = [next(loop) for loop in loops]
        pairs = list(zip(range(len(lanes)), loops, targets))
        for a in range(len(ARR)):
            now = gate[0] = ARR[a]
            for r, loop, target in pairs:
                state = states[r]
                while state[0] < now:
                    state = next(loop)
                states[r] = state
                _, last_end, done, before = state
                if last_end == now:
                    raise ExactTie(
                        f"request {RID[a]} arrives exactly as a step of replica {r} ends")
                target.num_outstanding = routed[r] - (before if last_end > now else done)
            req = Request(RID[a], now, PL[a], OL[a], PRI[a])
            r = choose(req, targets)
            routed[r] += 1
            lanes[r].arrivals.append(now)
            lanes[r].indices.append(a)
            if states[r][0] == INF:  # it was idle: when it plans now
                states[r] = next(loops[r])
            if a & 1023 == 1023:
                progress.update(sum(s[2] for s in states), now)
        gate[0] = INF
