"""A pool of identical replicas: one policy config, hardware, parallelism and memory plan,
and a fresh policy, executor and KV block manager per replica."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from sim.cluster.pipeline import PipelinedReplica
from sim.executor import Executor
from sim.kv_manager import KVBlockManager
from sim.memory import MemoryPlan
from sim.metrics import MetricsCollector
from sim.outputs import CsvSink
from sim.policy import Policy
from sim.replica import Replica
from sim.request import Request
from sim.specs import HardwareSpec


def replica_seed(seed: int, replica_id: int) -> int:
    """The seed of replica ``replica_id``'s policy: the run's seed for replica 0, an
    independent one (a ``SeedSequence`` child of the run's seed) for every other."""
    if replica_id == 0:
        return seed
    return int(np.random.SeedSequence(seed, spawn_key=(replica_id,)).generate_state(1)[0])


@dataclass
class Pool:
    """What every replica of one role shares. ``first_policy``/``first_executor`` are the
    instances the memory planner was run with; replica 0 of the pool reuses the executor, and
    the policy too when it is replica 0 of the deployment (``replica_seed``)."""

    role: str  # "replica" (co-located), "prefill" or "decode"
    count: int
    hardware: HardwareSpec
    policy_cfg: dict[str, Any]
    tensor_parallel: int
    pipeline_parallel: int
    memory: MemoryPlan
    block_size: int
    first_policy: Policy
    first_executor: Executor
    make_executor: Callable[[], Executor]
    make_policy: Callable[[int], Policy]  # a new policy instance, from its seed
    seed: int = 0
    enable_prefix_caching: bool = False

    @property
    def gpus_per_replica(self) -> int:
        """A replica's GPUs (every stage's tensor-parallel group): the ranks a KV transfer
        from or to it can send over in parallel."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def num_gpus(self) -> int:
        return self.count * self.gpus_per_replica

    def build(self, env: simpy.Environment, first_id: int, metrics: MetricsCollector,
              requests_sink: CsvSink, steps_sink: CsvSink, *, max_model_len: int,
              check_integrity: bool, on_finished: Callable[[Request], None] | None,
              handoff: Callable[[Request, Replica], None] | None = None,
              horizon: Callable[[], float] | None = None,
              fast_forward: bool = False, fast_steps: bool = False) -> list[Replica]:
        """The pool's replicas, ids from ``first_id``. ``fast_forward``: decode jumps (with
        the decoding requests as one block) on plain replicas; ``fast_steps``
        (step_mode=fast): decode runs and repeated micro-batches on pipelined ones, which
        never pass another process's event (sim/cluster/pipeline.py), so a closed loop's
        follow-ups cannot be run past."""
        out = []
        for i in range(self.count):
            rid = first_id + i
            # Replica 0 of the deployment keeps the planning instance (and the run's seed, so a
            # single replica draws what it always drew); every other replica gets its own
            # policy and seed, so noisy predictors do not repeat one sequence across replicas.
            policy = (self.first_policy if rid == 0 else
                      self.make_policy(replica_seed(self.seed, rid)))
            executor = self.first_executor if i == 0 else self.make_executor()
            offload = self.memory.num_offload_blocks
            kv = KVBlockManager(self.memory.num_gpu_blocks, self.block_size,
                                self.memory.num_cpu_blocks, self.enable_prefix_caching,
                                offload)
            # The tier's size is passed only where there is one: executors written to the
            # three-argument call keep working.
            executor.init_kv_cache(kv.num_gpu_blocks, kv.num_cpu_blocks, kv.block_size,
                                   **({"num_offload_blocks": offload} if offload else {}))
            kwargs: dict[str, Any] = dict(max_model_len=max_model_len,
                                          check_integrity=check_integrity,
                                          on_finished=on_finished, handoff=handoff,
                                          horizon=horizon, fast_forward=fast_forward)
            if self.pipeline_parallel > 1:
                cls, kwargs["pipeline_parallel"] = PipelinedReplica, self.pipeline_parallel
                kwargs["fast_forward"] = fast_steps
            else:
                cls = Replica
            out.append(cls(env, rid, policy, executor, kv, metrics, requests_sink,
                           steps_sink, **kwargs))
        return out
