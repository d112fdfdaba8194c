"""Build a whole run from one plain config mapping (what Hydra composes) and run it.

The mapping has the sections ``model, hardware, policy, workload, executor, cluster, kv`` and
the scalars ``seed, progress, check_integrity``; see ``conf/config.yaml``. Everything is
validated before the first simulated event, with errors that name the field.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import simpy

from sim import stop as run_stop
from sim.array_cluster import ArrayCluster
from sim.array_core import ArrayCore, LeftToReplicaLoop
from sim.array_disagg import ArrayDisaggregated
from sim.array_inputs import WorkloadArrays, array_core_blocker, pool_blocker
from sim.clock import ChainEnvironment, timeout_at
from sim.cluster.colocated import Colocated
from sim.cluster.config import ClusterConfig, DisaggregatedConfig, cluster_config_from
from sim.cluster.disaggregated import Disaggregated
from sim.cluster.link import Link
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS, ClusterRequestSink, cluster_summary
from sim.cluster.pool import Pool
from sim.cluster.router import make_router
from sim.config_types import as_bool, as_int, typed_fields
from sim.errors import ConfigError, RunInterrupted, renamed, require, require_known_fields
from sim.executor import Executor
from sim.fast_forward import UpcomingArrivals
from sim.memory import MemoryPlan, check_block_size, plan_memory
from sim.metrics import MetricsCollector
from sim.outputs import (
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    CsvSink,
    NullSink,
    interrupted_summary,
    strict_json,
    write_atomic,
)
from sim.policy import Policy
from sim.progress import Progress
from sim.replica import SimulationStalled
from sim.report_options import report_options
from sim.request import Request
from sim.result import SimulationResult
from sim.specs import (
    HardwareSpec,
    ModelSpec,
    hardware_spec_from,
    load_hardware_spec,
    model_spec_from,
)
from sim.workload import Workload


class Components(Protocol):
    """Where a run's policies, executors and workloads come from: the registries of
    ``policies/``, ``executors/`` and ``workloads/``, which sit above ``sim/`` and are handed in
    (``experiments/simulation.py``)."""

    def make_policy(self, section: dict[str, Any], seed: int) -> Policy:
        """The policy a ``policy`` config section names (``ConfigError`` if unknown)."""

    def executor_factory(self, name: str) -> Callable[..., Executor]:
        """The factory of the executor named ``name`` (``KeyError`` if unknown)."""

    def make_workload(self, section: dict[str, Any], seed: int, *, model: ModelSpec,
                      token_ids: bool) -> Workload:
        """The workload a ``workload`` config section describes."""


SECTIONS = ("model", "hardware", "policy", "workload", "executor", "cluster", "kv")
TOP_LEVEL = {*SECTIONS, "seed", "progress", "check_integrity", "output_dir", "step_mode",
             "device", "itl_quantiles", "record_steps", "array_core", "overwrite", "goodput",
             "error_bars", "report", "objective"}
# error_bars and objective: read by the command that runs the job (experiments/run.py).
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


def goodput_slos(section: Any) -> dict[str, float] | None:
    """The ``goodput`` config: SLOs in milliseconds (benchmark_serving's ``--goodput``), or
    None for no goodput."""
    if section is None:
        return None
    if not isinstance(section, dict) or not section:
        raise ConfigError("goodput", f"must map some of {', '.join(SLO_KEYS)} to milliseconds "
                          f"(or be null), got {section!r}")
    out = {}
    for key, value in section.items():
        require(key in SLO_KEYS, f"goodput.{key}", f"unknown SLO; known: {', '.join(SLO_KEYS)}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        require(ok and math.isfinite(value) and value > 0, f"goodput.{key}",
                f"must be a positive number of milliseconds, got {value!r}")
        out[key] = float(value)
    return out


@dataclass(frozen=True)
class KVConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0  # CPU swap pool per GPU (vLLM's swap_space)
    num_cpu_blocks: int | None = None  # overrides swap_space
    activation_reserve_gib: float | None = None  # overrides the estimate
    # vLLM's automatic prefix caching: full blocks stay findable by content after they are
    # freed, until handed out again (sim/prefix_cache.py, KVBlockManager).
    # None: the policy's engine default (``Policy.prefix_caching_default``; vLLM v1: on).
    enable_prefix_caching: bool | None = None
    # The offload tier: host memory per GPU that keeps cached blocks evicted from the GPU,
    # loaded back over PCIe on a hit (vLLM's CPU offloading connector, LMCache, SGLang's
    # HiCache). Needs prefix caching.
    kv_offloading_size: float = 0.0
    num_offload_blocks: int | None = None  # overrides kv_offloading_size

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        require(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "kv.num_cpu_blocks",
                f"must be >= 0, got {self.num_cpu_blocks}")
        require(math.isfinite(self.kv_offloading_size) and self.kv_offloading_size >= 0,
                "kv.kv_offloading_size",
                f"must be a finite number >= 0, got {self.kv_offloading_size}")
        require(self.num_offload_blocks is None or self.num_offload_blocks >= 0,
                "kv.num_offload_blocks", f"must be >= 0, got {self.num_offload_blocks}")
        # A negative reserve would hand the planner more bytes than the GPU has.
        require(self.activation_reserve_gib is None or self.activation_reserve_gib >= 0,
                "kv.activation_reserve_gib", f"must be >= 0, got {self.activation_reserve_gib}")


def _section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    value = cfg.get(name)
    if not isinstance(value, dict):
        raise ConfigError(name, "missing config section")
    return dict(value)


def _dataclass_from(cls: type, data: dict[str, Any], section: str) -> Any:
    require_known_fields(data, cls, section, "option")
    return cls(**typed_fields(cls, data, section))


class Simulation:
    """A validated, ready-to-run simulation: one replica, ``num_replicas`` behind a router, or a
    disaggregated prefill + decode deployment (``sim/cluster/``). TP and PP live inside each
    replica (the cost model and ``PipelinedReplica``)."""

    def __init__(self, cfg: dict[str, Any], out_dir: Path | None = None,
                 keep_requests: bool = False, *, components: Components) -> None:
        self.components = components
        unknown = sorted(set(cfg) - TOP_LEVEL)
        if unknown:
            raise ConfigError(unknown[0], f"unknown top-level option; known: {', '.join(sorted(TOP_LEVEL))}")
        self.cfg = cfg
        # numpy seeds are non-negative integers.
        self.seed = as_int(cfg.get("seed", 0), "seed", minimum=0)
        self.out_dir = out_dir
        self.keep_requests = keep_requests
        self.progress_enabled = as_bool(cfg.get("progress", True), "progress")
        self.check_integrity = as_bool(cfg.get("check_integrity", False), "check_integrity")
        # Where executor=real runs; refused when misspelt whichever executor runs.
        device = cfg.get("device")
        require(device is None or (isinstance(device, str)
                                   and re.fullmatch(r"cpu|cuda(:\d{1,3})?", device) is not None),
                "device", f"must be cpu, cuda, cuda:N or null, got {device!r}")
        self.step_mode = str(cfg.get("step_mode", "fast"))
        require(self.step_mode in ("fast", "exact"), "step_mode",
                f"must be fast or exact, got {self.step_mode!r}")
        self.itl_quantiles = str(cfg.get("itl_quantiles", "exact"))
        require(self.itl_quantiles in ("exact", "streaming"), "itl_quantiles",
                f"must be exact or streaming, got {self.itl_quantiles!r}")
        self.slos = goodput_slos(cfg.get("goodput"))
        self.record_steps = as_bool(cfg.get("record_steps", True), "record_steps")
        self.report = report_options(cfg.get("report"))  # the pages the command writes
        # step_mode=fast on the array core where it applies (sim/array_core.py).
        self.use_array_core = as_bool(cfg.get("array_core", True), "array_core")
        # Why the last run did not use the array core (None: it did, or no run yet).
        self.array_core_skipped: str | None = None

        self.model: ModelSpec = model_spec_from(_section(cfg, "model"), "model config")
        self.hardware: HardwareSpec = hardware_spec_from(_section(cfg, "hardware"), "hardware config")
        self.cluster: ClusterConfig | DisaggregatedConfig = cluster_config_from(
            _section(cfg, "cluster"), self.model)
        self.kv_cfg = _dataclass_from(KVConfig, _section(cfg, "kv"), "kv")
        self.policy_cfg = _section(cfg, "policy")
        self.pools = self._make_pools()
        # The first pool's (the prefill pool's, when disaggregated) policy, executor and
        # memory plan: what single-replica callers read.
        first = self.pools[0]
        self.policy, self.executor = first.first_policy, first.first_executor
        self.memory = first.memory
        # The device the executor really runs on (the real executor's CPU or GPU).
        self.hardware = self.executor.device_spec(self.hardware)
        # An executor that samples real tokens needs the prompts' token ids.
        self.workload = components.make_workload(_section(cfg, "workload"), self.seed,
                                                 model=self.model,
                                                 token_ids=self.executor.produces_tokens)
        self._validate(first.first_policy,
                       "policy" if len(self.pools) == 1 else "cluster.prefill.policy")
        if self.is_disaggregated and first.first_executor.produces_tokens:
            raise ConfigError("cluster.name", "disaggregation moves KV blocks between replicas, "
                              "which only executors without KV contents (cost_model) can do")

    def replace_executor(self, executor: Executor) -> None:
        """Swap the single replica's executor before ``run()`` (e.g. for a recording wrapper
        or a stand-in). Cluster runs build one executor per replica: not supported there."""
        if self.is_cluster:
            raise ValueError("replace_executor works on single-replica runs only")
        self.executor = self.pools[0].first_executor = executor

    @property
    def is_disaggregated(self) -> bool:
        return isinstance(self.cluster, DisaggregatedConfig)

    @property
    def prefix_caching(self) -> bool:
        """Whether any pool caches prefixes (``kv.enable_prefix_caching``, or the policy's
        engine default where it is null)."""
        return any(p.enable_prefix_caching for p in self.pools)

    @property
    def is_cluster(self) -> bool:
        """Anything beyond the plain single replica: adds the cluster outputs."""
        c = self.cluster
        return self.is_disaggregated or c.num_replicas > 1 or c.pipeline_parallel_size > 1

    def _make_pools(self) -> list[Pool]:
        c = self.cluster
        if isinstance(c, ClusterConfig):
            return [self._make_pool("replica", c.num_replicas, self.hardware, self.policy_cfg,
                                    c.tensor_parallel_size, c.pipeline_parallel_size, "cluster")]
        pools = []
        for side, count in (("prefill", c.num_prefill_replicas), ("decode", c.num_decode_replicas)):
            pc = getattr(c, side)
            try:
                hw = self.hardware if pc.hardware is None else load_hardware_spec(pc.hardware)
            except ConfigError as e:
                raise ConfigError(f"cluster.{side}.hardware", str(e).split(": ", 1)[-1]) from None
            policy_cfg = {**self.policy_cfg, **pc.policy}
            pools.append(self._make_pool(side, count, hw, policy_cfg, c.tp(side), c.pp(side),
                                         f"cluster.{side}", own=frozenset(pc.policy)))
        return pools

    def _make_pool(self, role: str, count: int, hardware: HardwareSpec,
                   policy_cfg: dict[str, Any], tp: int, pp: int, where: str,
                   own: frozenset[str] = frozenset()) -> Pool:
        """``where``: the pool's config section; ``own``: the policy keys the pool sets
        itself (an error on any other names the run's ``policy`` section, where it was set)."""
        # Limits left null take the engine's default for this hardware (vLLM v1's depend on
        # the GPU), where the components know the policy's engine.
        defaults = getattr(self.components, "policy_defaults", None)
        if defaults is not None and any(v is None for v in policy_cfg.values()):
            filled = defaults(policy_cfg, hardware)
            policy_cfg = {k: filled.get(k, v) if v is None else v
                          for k, v in policy_cfg.items()}
        try:
            policy = self.components.make_policy(policy_cfg, self.seed)
        except ConfigError as e:
            key = e.field.split(".")[1] if e.field.startswith("policy.") else None
            if where == "cluster" or (key is not None and key not in own):
                raise
            raise (renamed(f"{where}.{e.field}")
                   or ConfigError(f"{where}.{e.field}", str(e).split(": ", 1)[-1])) from None
        make = lambda: self._make_executor(hardware, tp, pp, type(policy))  # noqa: E731
        executor = make()
        # A pool that does not fit names the field that set its parallelism.
        c = self.cluster
        tp_field = (c.tp_field(role) if isinstance(c, DisaggregatedConfig)
                    else "cluster.tensor_parallel_size")
        memory = self._plan_memory(policy, executor, hardware, tp, pp, tp_field)
        caching = (type(policy).prefix_caching_default
                   if self.kv_cfg.enable_prefix_caching is None
                   else self.kv_cfg.enable_prefix_caching)
        if memory.num_offload_blocks and not caching:
            field = ("kv.num_offload_blocks" if self.kv_cfg.num_offload_blocks is not None
                     else "kv.kv_offloading_size")
            raise ConfigError(field, (
                "the offload tier keeps cached blocks evicted from the GPU: it needs prefix "
                f"caching, which is off for policy {policy.config.name!r}; set "
                "kv.enable_prefix_caching=true"))
        return Pool(role, count, hardware, policy_cfg, tp, pp, memory, self.kv_cfg.block_size,
                    policy, executor, make,
                    lambda seed: self.components.make_policy(policy_cfg, seed), self.seed,
                    caching)

    def _make_executor(self, hardware: HardwareSpec, tp: int, pp: int,
                       policy: type[Policy]) -> Executor:
        ex = _section(self.cfg, "executor")
        name = ex.get("name")
        try:
            factory = self.components.executor_factory(str(name))
        except KeyError as e:
            raise ConfigError("executor.name", str(e.args[0])) from None
        # Only executors that model pipeline stages take pipeline_parallel.
        extra = {"pipeline_parallel": pp} if pp > 1 else {}
        # The policy's engine default for what an executor leaves to the engine (the cost
        # model's host_overlap: null).
        return factory(model=self.model, hardware=hardware, tensor_parallel=tp, config=ex,
                       block_size=self.kv_cfg.block_size, seed=self.seed,
                       device=self.cfg.get("device"),
                       engine_host_overlap=policy.host_overlap_default, **extra)

    def _plan_memory(self, policy: Policy, executor: Executor, hardware: HardwareSpec,
                     tp: int, pp: int,
                     tp_field: str = "cluster.tensor_parallel_size") -> MemoryPlan:
        k, p = self.kv_cfg, policy.config
        kv_cache_dtype = executor.kv_cache_dtype()
        if kv_cache_dtype is not None and kv_cache_dtype != self.model.kv_cache_dtype:
            self.model = dataclasses.replace(self.model, kv_cache_dtype=kv_cache_dtype)
        hardware = executor.device_spec(hardware)
        act = executor.activation_reserve_bytes(p.max_num_batched_tokens, p.max_num_seqs)
        if k.activation_reserve_gib is not None:
            act = k.activation_reserve_gib * 2**30
        mp = plan_memory(
            self.model, hardware, block_size=k.block_size,
            gpu_memory_utilization=k.gpu_memory_utilization,
            tensor_parallel=tp, pipeline_parallel=pp,
            max_num_batched_tokens=p.max_num_batched_tokens, max_num_seqs=p.max_num_seqs,
            swap_space=k.swap_space, num_gpu_blocks_override=k.num_gpu_blocks_override,
            activation_reserve_override_bytes=act,
            weight_bytes_override=executor.weight_bytes(), parallel_field=tp_field,
            activation_field=(None if k.activation_reserve_gib is None
                              else "kv.activation_reserve_gib"),
        )
        if k.num_cpu_blocks is not None:
            mp = MemoryPlan(**{**mp.__dict__, "num_cpu_blocks": int(k.num_cpu_blocks)})
        offload = (int(k.num_offload_blocks) if k.num_offload_blocks is not None
                   else int(k.kv_offloading_size * 2**30 // mp.kv_bytes_per_block))
        if offload:
            mp = MemoryPlan(**{**mp.__dict__, "num_offload_blocks": offload})
        return mp

    def _validate(self, policy: Policy, section: str) -> None:
        p = policy.config
        # Prompts longer than the model's context are rejected at arrival (as vLLM does), so
        # only the ones that fit it must fit a step.
        longest = min(self.workload.max_prompt_len, self.model.max_model_len - 1)
        if not p.enable_chunked_prefill and p.max_num_batched_tokens < longest:
            raise ConfigError(
                f"{section}.max_num_batched_tokens",
                f"{p.max_num_batched_tokens} is below the longest prompt the workload can send "
                f"within model.max_model_len ({longest} tokens) and policy "
                f"{p.name!r} does not chunk prompts: such prompts could never be scheduled. "
                f"Raise it or use policy=chunked_prefill.")
        if p.max_num_batched_tokens < p.max_num_seqs and not p.enable_chunked_prefill:
            raise ConfigError(
                f"{section}.max_num_batched_tokens",
                f"{p.max_num_batched_tokens} is below policy.max_num_seqs={p.max_num_seqs}: "
                f"a full batch of decodes would not fit in one step")

    # ---- run ----------------------------------------------------------------------------
    def run(self) -> SimulationResult:
        # (wall_time_s counts an array-core run given up, with the replica loop's after it.)
        wall0 = time.perf_counter()
        core = self._array_core()
        if core is not None:
            try:
                return core.run()
            except LeftToReplicaLoop as e:  # an exact tie, a pool that may bind: see e
                self.array_core_skipped = str(e)
        # Lazy decode replicas sleep through their jumps' steps (ChainEnvironment).
        lazy = ((isinstance(self.cluster, DisaggregatedConfig) and self._jumps)
                or self._lazy_colocated)
        env = ChainEnvironment() if lazy else simpy.Environment()
        columns = REQUEST_COLUMNS + (CLUSTER_REQUEST_COLUMNS if self.is_cluster else ())
        req_sink, step_sink, metrics, progress = self.open_outputs(columns,
                                                                   self.workload.num_requests)
        kept: list[Request] = []
        state = {"done": 0}
        # A closed loop's follow-up requests, arriving later: (time, sequence) in a heap,
        # and the sequences arrived (dropped from the heap once at its top).
        later: list[tuple[float, int]] = []
        arrived: set[int] = set()
        closed = self.workload.closed_loop

        def arrive_later(req: Request, seq: int):
            yield timeout_at(env, req.arrival_time)
            if run_stop.requested:  # a signal asked the run to stop
                run_stop.check()
            arrived.add(seq)
            while later and later[0][1] in arrived:
                arrived.discard(heapq.heappop(later)[1])
            deployment.add_request(req)
            if req.is_finished:  # rejected at arrival
                on_done(req)

        def on_done(req: Request) -> None:
            state["done"] += 1
            if self.keep_requests:
                kept.append(req)
            if state["done"] & 63 == 0:
                progress.update(state["done"], env.now)
            if closed:
                nxt = self.workload.follow_up(req)
                if nxt is not None:
                    seq = state.setdefault("seq", 0)
                    state["seq"] = seq + 1
                    heapq.heappush(later, (nxt.arrival_time, seq))
                    env.process(arrive_later(nxt, seq))

        # The requests, read a few ahead; the next arrival's time: decode jumps stop before
        # it (sim/fast_forward.py).
        upcoming = UpcomingArrivals(self.workload)
        deployment = self.build_deployment(
            env, metrics, req_sink, step_sink, on_done,
            (lambda: min(upcoming.next_time, later[0][0] if later else float("inf")))
            if closed else (lambda: upcoming.next_time), upcoming)
        for r in deployment.replicas:
            r.finishes_bring_arrivals = closed

        def arrivals():
            while (req := upcoming.pop()) is not None:
                delay = req.arrival_time - env.now
                if delay > 0:
                    yield timeout_at(env, req.arrival_time)
                if run_stop.requested:  # a signal asked the run to stop
                    run_stop.check()
                deployment.add_request(req)
                if req.is_finished:  # rejected at arrival
                    on_done(req)

        env.process(arrivals())
        interrupted: RunInterrupted | None = None
        try:
            env.run()
        except RunInterrupted as e:  # the rows so far are whole: keep them, say so
            interrupted = e
        except BaseException:
            progress.close()
            req_sink.close(complete=False)
            step_sink.close(complete=False)
            raise
        stalled = deployment.num_unfinished and interrupted is None
        progress.close()
        req_sink.close(complete=not stalled)  # a stalled run's rows are not the whole run
        step_sink.close(complete=not stalled)
        if stalled:
            raise SimulationStalled(deployment.stall_message())
        summary = self.deployment_summary(deployment, metrics, env.now,
                                          time.perf_counter() - wall0)
        if interrupted is not None:
            self.write_summary(interrupted_summary(summary, interrupted))
            raise interrupted
        self.write_summary(summary)
        return SimulationResult(summary, metrics, deployment.replicas, self.memory, kept,
                                req_sink, step_sink, deployment)

    def deployment_summary(self, deployment: Colocated | Disaggregated,
                           metrics: MetricsCollector, sim_end: float,
                           wall: float) -> dict[str, Any]:
        """``summary.json``'s figures for a run of the replica loop (offline or online)."""
        reps = deployment.replicas
        summary = self.summary(
            metrics, sim_end, wall,
            kv_peak_usage=max(r.kv.peak_used_blocks / r.kv.num_gpu_blocks for r in reps),
            num_steps=sum(r.num_steps for r in reps),
            num_decode_jumps=sum(r.num_jumps for r in reps),
            num_swap_fallbacks=sum(r.builder.num_swap_fallbacks for r in reps),
            engine="replica",
            prefix_cache=(sum(r.kv.prefix_queries for r in reps),
                          sum(r.kv.prefix_hits for r in reps),
                          sum(r.kv.num_evictions for r in reps)),
            offload=(sum(r.kv.num_offload_stores for r in reps),
                     sum(r.kv.num_offload_loads for r in reps)))
        if self.is_cluster:
            summary.update(cluster_summary(self.cluster, self.pools, deployment, sim_end))
        return summary

    @property
    def _jumps(self) -> bool:
        """Whether replicas take decode jumps: in fast mode. (A single replica's jumps stop
        at its own finishes in a closed loop; a cluster's replicas sleep through theirs, cut
        by what reaches them: ``_lazy_colocated``, ``Disaggregated.enable_lazy_decode``.)"""
        return self.step_mode == "fast"

    @property
    def _lazy_colocated(self) -> bool:
        """Co-located replicas (two or more), in fast mode: each takes its jumps as a chain
        of step ends (``Replica.enable_lazy_decode``), past the arrivals routed elsewhere. A
        request routed to one cuts its jump at the step in progress, and a router reading one
        first has the steps begun take their blocks, so each sees what stepping shows. In a
        closed loop a finish brings a turn no jump can see coming: jumps end at their own
        first finish and before the next arrival known when they start."""
        c = self.cluster
        return (self.step_mode == "fast" and isinstance(c, ClusterConfig)
                and c.num_replicas > 1)

    def build_deployment(self, env: simpy.Environment, metrics: MetricsCollector,
                         req_sink: CsvSink, step_sink: CsvSink, on_done,
                         horizon, upcoming: UpcomingArrivals | None = None,
                         ) -> Colocated | Disaggregated:
        common = dict(max_model_len=self.model.max_model_len,
                      check_integrity=self.check_integrity)
        rows: CsvSink = req_sink
        if self.is_cluster:
            rows = ClusterRequestSink(req_sink)  # appends the cluster columns to each row
        c = self.cluster
        if isinstance(c, ClusterConfig):
            # Routers decide only at arrivals, so jumps that stop before the next arrival
            # never show a router a replica's future.
            replicas = self.pools[0].build(env, 0, metrics, rows, step_sink,
                                           on_finished=on_done, horizon=horizon,
                                           fast_forward=self._jumps,
                                           fast_steps=self.step_mode == "fast", **common)
            router = make_router(c.router, self.seed)
            deployment = Colocated(replicas, router)
            if self._lazy_colocated:
                soft = upcoming is not None and not self.workload.closed_loop
                for r in replicas:
                    if r.enable_lazy_decode() and soft:
                        # Priced as far as the N-th next arrival for N replicas: any end is
                        # exact (what reaches the replica cuts its jump).
                        r.horizon = partial(upcoming.time, len(replicas) - 1)
        else:
            prefill_pool, decode_pool = self.pools
            holder: list[Disaggregated] = []

            def decode_done(req: Request) -> None:
                if on_done is not None:
                    on_done(req)
                holder[0].on_decode_finished(req)

            prefill = prefill_pool.build(env, 0, metrics, rows, step_sink, on_finished=on_done,
                                         handoff=lambda req, rep: holder[0].handoff(req, rep),
                                         **common)
            # Decode replicas sleep through their jumps (lazy decode, set below; pipelined ones
            # repeat up to Disaggregated.decode_horizon); prefill replicas hand every request
            # off after its prompt step, so they step one at a time.
            decode = decode_pool.build(env, prefill_pool.count, metrics, rows, step_sink,
                                       on_finished=decode_done, horizon=horizon,
                                       fast_forward=self._jumps,
                                       fast_steps=self.step_mode == "fast", **common)
            link = Link(env, c.link, prefill_pool.count + decode_pool.count)
            lanes = min(prefill_pool.gpus_per_replica, decode_pool.gpus_per_replica)
            deployment = Disaggregated(
                env, prefill, decode, make_router(c.router, self.seed, 0),
                make_router(c.decode_router, self.seed, 1, "cluster.decode_router"), link,
                kv_bytes_per_token=self.model.kv_bytes_per_token, lanes=lanes, metrics=metrics,
                requests_sink=rows)
            holder.append(deployment)
            if horizon is not None:  # (online mode has none: one step at a time)
                deployment.enable_decode_jumps(horizon)
            # Each decode replica sleeps through its jumps past the other replicas' steps
            # (Replica.enable_lazy_decode).
            if upcoming is not None and self._jumps:
                deployment.enable_lazy_decode(upcoming, decode_pool.count)
        if isinstance(rows, ClusterRequestSink):
            rows.extra = deployment.extra_columns
        return deployment

    def _array_core(self) -> ArrayCore | ArrayCluster | ArrayDisaggregated | None:
        """The array core for this run (one replica, co-located replicas behind a router, or a
        disaggregated deployment), or None (the reason in ``array_core_skipped``)."""
        reason = array_core_blocker(self)
        if reason is None:
            arrays = WorkloadArrays.collect(self.workload, self.prefix_caching)
            reason = arrays if isinstance(arrays, str) else pool_blocker(self, arrays)
        self.array_core_skipped = reason
        if reason is not None:
            return None
        if isinstance(self.cluster, DisaggregatedConfig):
            return ArrayDisaggregated(self, arrays)  # type: ignore[arg-type]
        if self.is_cluster:
            return ArrayCluster(self, arrays)  # type: ignore[arg-type]
        return ArrayCore(self, arrays)  # type: ignore[arg-type]

    def open_outputs(self, request_columns: tuple[str, ...], num_requests: int | None,
                     ) -> tuple[CsvSink, CsvSink, MetricsCollector, Progress]:
        """A run's sinks (requests.csv, steps.csv or none), metrics and progress line,
        whichever loop runs it."""
        out = self.out_dir
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        req_sink = CsvSink(out / "requests.csv" if out else None, request_columns)
        step_sink = (CsvSink(out / "steps.csv" if out else None, STEP_COLUMNS)
                     if self.record_steps else NullSink(STEP_COLUMNS))
        return (req_sink, step_sink, MetricsCollector(self.itl_quantiles, self.slos),
                Progress(num_requests, self.progress_enabled))

    def _offered_load(self) -> dict[str, Any]:
        """benchmark_serving's ``request_rate`` (req/s, or inf for all at once), ``burstiness``
        (the gamma shape of the gaps: 1 for Poisson, inf for constant gaps) and
        ``max_concurrency``: of an open-loop synthetic workload; null where the workload sets
        no rate (a trace, a closed loop). Arrivals are never capped by a client (null)."""
        w = self.cfg.get("workload") or {}
        rate = burst = None
        if "qps" in w and w.get("name") != "multi_turn":
            rate = float(w["qps"])
            kind = w.get("arrival", "poisson")
            cv = float(w.get("cv", 1.0))
            burst = (1.0 if kind == "poisson" else float("inf") if kind == "constant"
                     else 1.0 / (cv * cv) if cv > 0 else float("inf"))
        return {"request_rate": rate, "burstiness": burst, "max_concurrency": None}

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` in the output folder (none without one): strict JSON (a figure
        with no value, such as a latency with no finished request, is null), written whole
        or not at all."""
        if self.out_dir is not None:
            write_atomic(self.out_dir / "summary.json",
                         json.dumps(strict_json(summary), indent=2, allow_nan=False) + "\n")

    def summary(self, metrics: MetricsCollector, sim_end: float, wall: float, *,
                kv_peak_usage: float, num_steps: int, num_decode_jumps: int,
                num_swap_fallbacks: int, engine: str,
                prefix_cache: tuple[int, int, int] = (0, 0, 0),
                offload: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """``summary.json``'s figures for a finished run, whichever loop ran it.
        ``prefix_cache``: prompt tokens looked up in the prefix cache, found in GPU blocks,
        and cached blocks evicted; ``offload``: blocks stored to and loaded from the offload
        tier."""
        s = metrics.summary()
        s.update(self._offered_load())
        s["status"] = "complete"
        mem = self.memory
        queries, hits, evictions = prefix_cache
        stores, loads = offload
        s.update({
            "kv_block_size": self.kv_cfg.block_size,
            "kv_num_gpu_blocks": mem.num_gpu_blocks,
            "kv_num_cpu_blocks": mem.num_cpu_blocks,
            "kv_bytes_per_token": int(self.model.kv_bytes_per_token),
            "kv_peak_usage": kv_peak_usage,
            "enable_prefix_caching": self.prefix_caching,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "kv_evictions": evictions,
            "kv_num_offload_blocks": mem.num_offload_blocks,
            "kv_offload_stores": stores,
            "kv_offload_loads": loads,
            # Prompt tokens a hit loaded from the offload tier, of those looked up.
            "kv_offload_hit_rate": loads * self.kv_cfg.block_size / queries if queries else 0.0,
            "num_steps": num_steps,
            "num_decode_jumps": num_decode_jumps,
            "step_mode": self.step_mode,
            # The loop that ran: the replica (simpy) or the array core (sim/array_core.py).
            "step_engine": engine,
            "num_swap_fallbacks": num_swap_fallbacks,
            "simulated_duration_s": sim_end,
            "wall_time_s": wall,
            "model": self.model.name,
            "hardware": self.hardware.name,
            "policy": self.policy.config.name,
            "executor": str(self.cfg["executor"].get("name")),
            "tensor_parallel_size": self.cluster.tensor_parallel_size,
            "seed": self.seed,
            "weight_bytes_per_gpu": self.memory.weight_bytes,
        })
        return s

