"""A pool of identical replicas: one policy config, hardware, parallelism and memory plan,
and a fresh policy, executor and KV block manager per replica."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import simpy

import policies
from executors.base import Executor
from sim.cluster.pipeline import PipelinedReplica
from sim.kv_manager import KVBlockManager
from sim.memory import MemoryPlan
from sim.metrics import MetricsCollector
from sim.outputs import CsvSink
from sim.replica import Replica
from sim.request import Request
from sim.specs import HardwareSpec


@dataclass
class Pool:
    """What every replica of one role shares. ``first_policy``/``first_executor`` are the
    instances the memory planner was run with; replica 0 of the pool reuses them."""

    role: str  # "replica" (co-located), "prefill" or "decode"
    count: int
    hardware: HardwareSpec
    policy_cfg: dict[str, Any]
    tensor_parallel: int
    pipeline_parallel: int
    memory: MemoryPlan
    block_size: int
    first_policy: policies.Policy
    first_executor: Executor
    make_executor: Callable[[], Executor]
    seed: int = 0

    @property
    def num_gpus(self) -> int:
        return self.count * self.tensor_parallel * self.pipeline_parallel

    def build(self, env: simpy.Environment, first_id: int, metrics: MetricsCollector,
              requests_sink: CsvSink, steps_sink: CsvSink, *, max_model_len: int,
              check_integrity: bool, on_finished: Callable[[Request], None] | None,
              handoff: Callable[[Request, Replica], None] | None = None,
              horizon: Callable[[], float] | None = None,
              fast_forward: bool = False) -> list[Replica]:
        out = []
        for i in range(self.count):
            policy = (self.first_policy if i == 0
                      else policies.make_policy(self.policy_cfg, seed=self.seed))
            executor = self.first_executor if i == 0 else self.make_executor()
            kv = KVBlockManager(self.memory.num_gpu_blocks, self.block_size,
                                self.memory.num_cpu_blocks)
            executor.init_kv_cache(kv.num_gpu_blocks, kv.num_cpu_blocks, kv.block_size)
            kwargs: dict[str, Any] = dict(max_model_len=max_model_len,
                                          check_integrity=check_integrity,
                                          on_finished=on_finished, handoff=handoff)
            if self.pipeline_parallel > 1:
                cls, kwargs["pipeline_parallel"] = PipelinedReplica, self.pipeline_parallel
            else:
                cls = Replica
                kwargs.update(horizon=horizon, fast_forward=fast_forward)
            out.append(cls(env, first_id + i, policy, executor, kv, metrics, requests_sink,
                           steps_sink, **kwargs))
        return out
