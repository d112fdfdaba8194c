"""The engine driven from outside, for online mode: requests come in one at a time at the
clock's current time, the caller moves the clock, and the deployment (one replica, several
behind a router, or prefill and decode pools joined by a KV link) runs exactly as in an
offline run, one step at a time.

The caller (the pacer of ``online/``) keeps the simulated clock on the wall clock:
``run_until`` processes every event due by a time, ``next_event_time`` says when the next one
is, ``submit`` adds a request now and ``abort`` takes one out at the next step boundary. Token
times are the requests' own (``Request.token_times``), in simulated seconds; the engine never
runs ahead of the clock it is given (``PacedEnvironment``), so every token a request holds has
happened. ``close`` writes what an offline run writes (requests.csv, steps.csv, summary.json)
and returns the run's result.
"""

from __future__ import annotations

import time
from itertools import count

from sim.clock import PacedEnvironment
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS
from sim.errors import ConfigError
from sim.outputs import REQUEST_COLUMNS
from sim.replica import Replica
from sim.request import Request
from sim.result import SimulationResult
from sim.simulation import Simulation


class OnlineEngine:
    """``sim``'s deployment, online."""

    def __init__(self, sim: Simulation) -> None:
        if sim.step_mode != "exact":
            raise ConfigError("step_mode", "online mode plans one step at a time "
                              "(step_mode=exact): a decode jump needs the arrivals ahead")
        self.sim = sim
        self.env = PacedEnvironment()
        self._ids = count()
        self.wall0 = time.perf_counter()  # reset when the clock starts (summary: wall_time_s)
        columns = REQUEST_COLUMNS + (CLUSTER_REQUEST_COLUMNS if sim.is_cluster else ())
        self.req_sink, self.step_sink, self.metrics, progress = sim.open_outputs(columns, None)
        progress.close()  # a server has no end to show progress towards
        # No horizon: replicas plan one step at a time (no decode jumps).
        self.deployment = sim.build_deployment(self.env, self.metrics, self.req_sink,
                                               self.step_sink, None, None)
        self.replicas: list[Replica] = self.deployment.replicas
        self.closed = False

    @property
    def now(self) -> float:
        return self.env.now

    def run_until(self, t: float) -> None:
        """Process every event due by simulated time ``t``; the clock ends at ``t``."""
        self.env.run_until(t)

    def next_event_time(self) -> float:
        """When the next event is due (inf: nothing scheduled, the engine waits for work)."""
        return self.env.peek()

    def submit(self, prompt_len: int, max_output_len: int, *, priority: int = 0,
               prompt_token_ids: list[int] | None = None,
               prefix: tuple[tuple[int, int], ...] | None = None) -> Request:
        """A request arriving now; it may come back rejected (``Request.reject_reason``
        says why, e.g. longer than the model's context), in which case it has left.
        ``prefix``: its prompt as content spans for the prefix cache (``Request.prefix``).
        """
        if self.closed:
            raise RuntimeError("the online engine is closed")
        req = Request(next(self._ids), self.env.now, prompt_len, max_output_len,
                      priority=priority, prompt_token_ids=prompt_token_ids, prefix=prefix)
        self.deployment.add_request(req)
        return req

    def abort(self, req: Request) -> None:
        """``req``'s client gave up: it leaves before its replica plans the next step (in a
        disaggregated deployment, wherever it is: ``Disaggregated.abort``)."""
        self.deployment.abort(req)

    # ---- what a server reports ------------------------------------------------------------
    def num_waiting(self) -> int:
        """Requests waiting (never run, or preempted by recompute), as vLLM counts them, and
        in a disaggregated deployment those waiting for their KV to reach a decode replica
        (held by no replica's queues), as vLLM's decode side counts them."""
        between = self.deployment.num_unfinished - sum(r.num_unfinished for r in self.replicas)
        return sum(len(r.queues.waiting) for r in self.replicas) + between

    def num_running(self) -> int:
        return sum(len(r.queues.running) for r in self.replicas)

    def num_swapped(self) -> int:
        return sum(len(r.queues.swapped) for r in self.replicas)

    def kv_usage(self) -> float:
        """Fraction of the GPU KV blocks in use, over all replicas."""
        used = sum(r.kv.num_used_blocks for r in self.replicas)
        return used / sum(r.kv.num_gpu_blocks for r in self.replicas)

    def prefix_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache, and those found."""
        return (sum(r.kv.prefix_queries for r in self.replicas),
                sum(r.kv.prefix_hits for r in self.replicas))

    def num_unfinished(self) -> int:
        return self.deployment.num_unfinished

    def leaked_blocks(self) -> int:
        """GPU and CPU blocks still held with no request left to hold them (0 when the books
        balance); the KV books themselves are checked too (``KVIntegrityError``)."""
        held = 0
        for r in self.replicas:
            r.verify()
            held += r.kv.num_used_blocks + (r.kv.num_cpu_blocks - r.kv.num_free_cpu_blocks)
        return held

    # ---- the end --------------------------------------------------------------------------
    def close(self) -> SimulationResult:
        """Write the run's outputs (every request still unfinished must have been
        aborted and left first) and return its result."""
        if self.closed:
            raise RuntimeError("the online engine is already closed")
        left = self.deployment.num_unfinished
        if left:
            raise RuntimeError(f"{left} requests are unfinished: abort them and run the "
                               f"clock to their replicas' next step first")
        self.closed = True
        self.req_sink.close()
        self.step_sink.close()
        wall = time.perf_counter() - self.wall0
        summary = self.sim.deployment_summary(self.deployment, self.metrics, self.env.now, wall)
        summary["kv_blocks_leaked"] = self.leaked_blocks()
        self.sim.write_summary(summary)
        return SimulationResult(summary, self.metrics, self.replicas, self.sim.memory, [],
                                self.req_sink, self.step_sink, self.deployment)
