"""Drive small clusters over hand-made requests with fixed-duration recording executors."""

from __future__ import annotations

from dataclasses import dataclass

import simpy

import policies
from sim.cluster.colocated import Colocated
from sim.cluster.disaggregated import Disaggregated
from sim.cluster.link import Link, LinkConfig
from sim.cluster.pipeline import PipelinedReplica
from sim.cluster.router import make_router
from sim.kv_manager import KVBlockManager
from sim.metrics import MetricsCollector
from sim.outputs import REQUEST_COLUMNS, STEP_COLUMNS, CsvSink
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS, ClusterRequestSink
from sim.replica import Replica
from sim.request import Request
from tests.harness import RecordingExecutor


@dataclass
class ClusterRun:
    env: simpy.Environment
    deployment: Colocated | Disaggregated
    replicas: list[Replica]
    executors: list[RecordingExecutor]
    metrics: MetricsCollector
    rows: list[dict]  # requests.csv rows as dicts
    finished: list[Request]


def _replica(env, rid, policy, blocks, block_size, step_time, metrics, sink, steps, done,
             handoff=None, pipeline_parallel=1):
    ex = RecordingExecutor(step_time)
    ex.now = lambda: env.now
    pol = policies.make_policy({"kv_watermark": 0.0, **policy})
    kv = KVBlockManager(blocks, block_size)
    kw = dict(max_model_len=100_000, check_integrity=True, on_finished=done, handoff=handoff)
    if pipeline_parallel > 1:
        return PipelinedReplica(env, rid, pol, ex, kv, metrics, sink, steps,
                                pipeline_parallel=pipeline_parallel, **kw), ex
    return Replica(env, rid, pol, ex, kv, metrics, sink, steps, **kw), ex


def _drive(env, deployment, requests):
    def arrivals():
        for r in sorted(requests, key=lambda r: (r.arrival_time, r.request_id)):
            if r.arrival_time > env.now:
                yield env.timeout(r.arrival_time - env.now)
            deployment.add_request(r)

    env.process(arrivals())
    env.run()


def run_colocated(requests: list[Request], *, num_replicas: int, router: str = "round_robin",
                  policy: dict | None = None, num_gpu_blocks: int = 64, block_size: int = 16,
                  step_time: float = 1.0, seed: int = 0) -> ClusterRun:
    env = simpy.Environment()
    metrics = MetricsCollector()
    inner = CsvSink(None, REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS)
    sink = ClusterRequestSink(inner)
    steps = CsvSink(None, STEP_COLUMNS)
    finished: list[Request] = []
    built = [_replica(env, i, policy or {"name": "fcfs"}, num_gpu_blocks, block_size, step_time,
                      metrics, sink, steps, finished.append) for i in range(num_replicas)]
    replicas = [r for r, _ in built]
    dep = Colocated(replicas, make_router(router, seed))
    sink.extra = dep.extra_columns
    _drive(env, dep, requests)
    cols = REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS
    return ClusterRun(env, dep, replicas, [e for _, e in built], metrics,
                      [dict(zip(cols, row)) for row in inner.rows], finished)


def run_disaggregated(requests: list[Request], *, num_prefill: int = 1, num_decode: int = 1,
                      prefill_policy: dict | None = None, decode_policy: dict | None = None,
                      prefill_blocks: int = 64, decode_blocks: int = 64, block_size: int = 16,
                      step_time: float = 1.0, kv_bytes_per_token: float = 1000.0,
                      link: LinkConfig | None = None, router: str = "round_robin",
                      decode_router: str = "round_robin", lanes: int = 1,
                      seed: int = 0) -> ClusterRun:
    env = simpy.Environment()
    metrics = MetricsCollector()
    inner = CsvSink(None, REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS)
    sink = ClusterRequestSink(inner)
    steps = CsvSink(None, STEP_COLUMNS)
    finished: list[Request] = []
    holder: list[Disaggregated] = []

    def decode_done(req: Request) -> None:
        finished.append(req)
        holder[0].on_decode_finished(req)

    pre = [_replica(env, i, prefill_policy or {"name": "fcfs"}, prefill_blocks, block_size,
                    step_time, metrics, sink, steps, finished.append,
                    handoff=lambda req, rep: holder[0].handoff(req, rep))
           for i in range(num_prefill)]
    dec = [_replica(env, num_prefill + i, decode_policy or {"name": "fcfs"}, decode_blocks,
                    block_size, step_time, metrics, sink, steps, decode_done)
           for i in range(num_decode)]
    link_obj = Link(env, link or LinkConfig(bandwidth_gbps=16e-6, latency_us=5e5),
                    num_prefill + num_decode)
    dep = Disaggregated(env, [r for r, _ in pre], [r for r, _ in dec],
                        make_router(router, seed, 0), make_router(decode_router, seed, 1),
                        link_obj, kv_bytes_per_token=kv_bytes_per_token, lanes=lanes,
                        metrics=metrics, requests_sink=sink)
    holder.append(dep)
    sink.extra = dep.extra_columns
    _drive(env, dep, requests)
    cols = REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS
    return ClusterRun(env, dep, dep.replicas, [e for _, e in pre + dec], metrics,
                      [dict(zip(cols, row)) for row in inner.rows], finished)
