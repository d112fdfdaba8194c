"""What the array core (sim/array_core.py) takes, and whether a run can take it: the run it
reads (``ArrayCoreHost``), the workload as columns (``WorkloadArrays``), and why a run must
take the replica loop instead (``array_core_blocker`` before looking at the requests,
``pool_blocker`` after). ``Simulation.run`` asks both and runs the core where neither finds
anything in the way.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from heapq import nlargest
from itertools import islice
from operator import add, gt
from typing import TYPE_CHECKING, Any, Protocol

from sim.cluster.config import ClusterConfig
from sim.cluster.disaggregated import decode_refusal
from sim.cluster.router import ROUTERS
from sim.kv_manager import blocks_for
from sim.step_builder import watermark_blocks

if TYPE_CHECKING:
    from sim.executor import Executor
    from sim.memory import MemoryPlan
    from sim.metrics import MetricsCollector
    from sim.outputs import CsvSink
    from sim.policy import Policy
    from sim.progress import Progress
    from sim.request import Request
    from sim.specs import ModelSpec

# The core numbers seats and requests in these many bits (its heap keys pack them).
SLOT_BITS = 20
INDEX_BITS = 32


class ArrayCoreHost(Protocol):
    """What the array core reads of the run it simulates (``sim.simulation.Simulation``)."""

    use_array_core: bool
    step_mode: str
    is_cluster: bool
    cluster: Any  # sim.cluster.config.ClusterConfig (or DisaggregatedConfig)
    pools: list[Any]  # sim.cluster.pool.Pool: one for co-located replicas
    seed: int
    check_integrity: bool
    keep_requests: bool
    policy: Policy
    executor: Executor
    model: ModelSpec
    memory: MemoryPlan
    kv_cfg: Any  # sim.simulation.KVConfig
    prefix_caching: bool
    workload: Any  # sim.workload.Workload

    def open_outputs(self, request_columns: tuple[str, ...], num_requests: int | None,
                     ) -> tuple[CsvSink, CsvSink, MetricsCollector, Progress]: ...

    def summary(self, metrics: MetricsCollector, sim_end: float, wall: float, *,
                kv_peak_usage: float, num_steps: int, num_decode_jumps: int,
                num_swap_fallbacks: int, engine: str,
                prefix_cache: tuple[int, int, int] = ...,
                offload: tuple[int, int] = ...) -> dict[str, Any]: ...

    def write_summary(self, summary: dict[str, Any]) -> None: ...


def array_core_blocker(sim: ArrayCoreHost) -> str | None:
    """Why this run cannot use the array core before looking at its requests, or None."""
    if not sim.use_array_core:
        return "array_core=false"
    if sim.step_mode != "fast":
        return "step_mode=exact"
    if sim.is_cluster:
        why = _cluster_blocker(sim)
        if why is not None:
            return why
    if sim.check_integrity:
        return "check_integrity=true"
    if sim.keep_requests:
        return "keep_requests (Request objects wanted)"
    if sim.workload.closed_loop:
        return "a closed-loop workload (finished requests bring new ones)"
    # The class's own opt-in (Policy.__init_subclass__: a subclass does not inherit it).
    if not sim.policy.array_core:
        return f"policy {sim.policy.config.name!r} does not decide on arrays"
    why = sim.policy.array_core_refusal()
    if why is not None:
        return f"policy {sim.policy.config.name!r}: {why}"
    cfg = sim.policy.config
    if sim.policy.implements_chunked_prefill and cfg.max_num_seqs > cfg.max_num_batched_tokens:
        return ("policy.max_num_seqs > policy.max_num_batched_tokens (a step may not hold a "
                "token of every running request)")
    if cfg.max_num_seqs >= 1 << SLOT_BITS:
        return f"policy.max_num_seqs >= {1 << SLOT_BITS} (the core's slot numbers)"
    ex = sim.executor
    # The executor's own class states it (a subclass or wrapper may price steps otherwise).
    if not type(ex).__dict__.get("prices_on_arrays", False) or ex.produces_tokens:
        return f"executor {type(ex).__name__} (the array core prices with the cost model)"
    return None


def _pipeline_blocker(sim: ArrayCoreHost) -> str | None:
    """Why these replicas with pipeline stages cannot run on the array core
    (sim/array_pipeline.py), or None: under a policy ``_pipelined_policy_blocker`` takes,
    behind a router that reads only outstanding counts and KV usage. (Where their pool can
    bind: ``pool_blocker``.)"""
    if not ROUTERS.get(str(sim.cluster.router)).reads_only_load:
        return (f"router {sim.cluster.router!r} reads more than outstanding request counts "
                "and KV usage")
    return _pipelined_policy_blocker(sim.policy)


def _pipelined_policy_blocker(policy: Policy) -> str | None:
    """Why a pipelined replica under ``policy`` cannot run on the array core, or None: a
    policy of whole-prompt, prefill-only steps (``head_admissions``: FCFS, static;
    ``indexed_admissions``: SJF, priority) or of chunked steps that grant every decode first
    (``grants_decodes_first`` and ``chunk_plan``: vLLM v0's chunked prefill; TensorRT-LLM's
    without it, its requests holding their whole lengths under guaranteed_no_evict) or
    every running request in arrival order (``grants_in_arrival_order``: vLLM v1,
    TensorRT-LLM)."""
    if policy.implements_chunked_prefill:
        if policy.waiting_by_priority():
            return (f"pipeline stages under policy {policy.config.name!r} with a waiting "
                    "queue in priority order")
        rule = ((policy.grants_decodes_first or policy.grants_in_arrival_order)
                and callable(getattr(policy, "chunk_plan", None)))
    else:
        rule = (callable(getattr(policy, "head_admissions", None))
                or callable(getattr(policy, "indexed_admissions", None)))
    if not rule:
        return (f"pipeline stages under policy {policy.config.name!r} (the core pipelines "
                "whole-prompt, prefill-only steps, or chunked ones that grant every decode "
                "first or every running request in arrival order: fcfs, sjf, priority, "
                "static, chunked_prefill, trtllm, vllm_v1)")
    return None


def _cluster_blocker(sim: ArrayCoreHost) -> str | None:
    """Why this cluster cannot run on the array core, or None: co-located replicas
    (sim/array_cluster.py) behind a router that reads only outstanding counts and KV usage,
    or a disaggregated deployment (sim/array_disagg.py) behind a prefill router that reads
    only outstanding counts and a decode router that reads only those and KV usage. Replicas
    with pipeline stages (one or more, or a deployment's pool) run on the core in a loop of
    their own (``_pipeline_blocker``, ``_pipelined_policy_blocker``, sim/array_pipeline.py). (Prefix caching is for
    ``WorkloadArrays.collect`` to refuse: with no prompt sharing a prefix, and nobody
    recomputed on the core but by ``decode_preemptions`` or ``decode_retractions``, it changes
    nothing the core counts but a recomputed request's hits on its own blocks, which the core
    follows where prompts take blocks chunk by chunk.)"""
    cluster = sim.cluster
    if isinstance(cluster, ClusterConfig):
        if cluster.pipeline_parallel_size > 1:
            return _pipeline_blocker(sim)
        if not ROUTERS.get(str(cluster.router)).reads_only_load:
            return (f"router {cluster.router!r} reads more than outstanding request counts "
                    "and KV usage")
        return None
    for side, policy in (("prefill", sim.policy), ("decode", sim.pools[1].first_policy)):
        why = _pipelined_policy_blocker(policy) if cluster.pp(side) > 1 else None
        if why is not None:
            return f"the {side} pool's {why}"
    if not ROUTERS.get(str(cluster.router)).reads_only_counts:
        # (A prefill replica's blocks held for transfers are known only after the decode
        # replicas have run.)
        return f"cluster.router {cluster.router!r} reads more than outstanding request counts"
    if not ROUTERS.get(str(cluster.decode_router)).reads_only_load:
        return (f"cluster.decode_router {cluster.decode_router!r} reads more than outstanding "
                "request counts and KV usage")
    decode = sim.pools[1].first_policy
    if not decode.array_core:
        return f"decode pool policy {decode.config.name!r} does not decide on arrays"
    why = decode.array_core_refusal()
    if why is not None:
        return f"decode pool policy {decode.config.name!r}: {why}"
    for side, policy in (("prefill", sim.policy), ("decode", decode)):
        if admits_on_free_pool(policy):
            # (Its admission reads the free pool, which the blocks a prefill replica holds
            # for transfers are known only after the decode pass.)
            return (f"the {side} pool's policy {policy.config.name!r} admits on the free "
                    "pool (in a disaggregated deployment)")
        if policy.reserves_full_length:
            return (f"the {side} pool's policy {policy.config.name!r} reserves whole lengths "
                    "(in a disaggregated deployment)")
    if decode.config.max_num_batched_tokens >= 1 << SLOT_BITS:
        return f"the decode pool's policy.max_num_batched_tokens >= {1 << SLOT_BITS}"
    ex = sim.pools[1].first_executor
    if not type(ex).__dict__.get("prices_on_arrays", False) or ex.produces_tokens:
        return (f"decode pool executor {type(ex).__name__} (the array core prices with the "
                "cost model)")
    return None


@dataclass
class WorkloadArrays:
    """A workload's requests as columns, in arrival order."""

    request_ids: array
    priorities: array
    arrivals: array
    prompt_lens: array
    output_lens: array
    _largest: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def largest_lengths(self, k: int) -> list[int]:
        """The ``k`` largest total lengths (prompt + output), largest first, without a list
        of all of them (kept: both blockers and the core ask)."""
        out = self._largest.get(k)
        if out is None:
            out = self._largest[k] = nlargest(k, map(add, self.prompt_lens, self.output_lens))
        return out

    @classmethod
    def collect(cls, requests: Iterable[Request],
                prefix_caching: bool = False) -> WorkloadArrays | str:
        """The columns of ``requests`` (an iterable of Request), or why they cannot be kept as
        plain numbers (ids or priorities that are not ints, token ids given, or with
        ``prefix_caching`` a shared prompt prefix: the core keeps no block contents; without
        one a request can only hit its own blocks after a preemption, which the core follows
        on counts where prompts take blocks chunk by chunk, vLLM v1's and SGLang's, and makes
        only with caching off elsewhere: ``pool_blocker``)."""
        out = cls(array("q"), array("q"), array("d"), array("q"), array("q"))
        ids, pri, arr, pl, ol = (out.request_ids.append, out.priorities.append,
                                 out.arrivals.append, out.prompt_lens.append,
                                 out.output_lens.append)
        for r in requests:
            rid, p = r.request_id, r.priority
            if type(rid) is not int or type(p) is not int or r.prompt_token_ids is not None:
                return f"request {rid!r}: ids and priorities other than ints, or token ids"
            if prefix_caching and r.prefix is not None:
                return f"request {rid!r}: a shared prompt prefix with prefix caching on"
            try:
                ids(rid)
                pri(p)
            except OverflowError:
                return f"request {rid!r}: an id or priority beyond 64 bits"
            arr(r.arrival_time)
            pl(r.prompt_len)
            ol(r.max_output_len)
        return out


def admits_on_free_pool(policy: Policy) -> bool:
    """Whether ``policy``'s prefill batches read the free pool on the array core
    (``prefill_plan``: SGLang's estimate against its free tokens)."""
    return callable(getattr(policy, "prefill_plan", None))


def runs_guarded(policy: Policy) -> bool:
    """Whether, on a pool that can bind, the array core runs ``policy`` as on one that
    cannot, its admission counting blocks, and gives the run to the replica loop once a
    running request finds no block (``ArrayCore.guard``): a policy that states neither
    decode preemptions nor retractions on counts and does not reserve whole lengths."""
    return (not policy.reserves_full_length
            and not callable(getattr(policy, "decode_preemptions", None))
            and not callable(getattr(policy, "decode_retractions", None)))


def pool_can_bind(sim: ArrayCoreHost, w: WorkloadArrays) -> bool:
    """Whether the KV pool can run short on this workload: the most a full batch can ever
    hold (its members' blocks at their last tokens, full_length: prompt + output - 1, for
    the ``max_num_seqs`` largest requests) exceeds the pool above the admission watermark."""
    cfg = sim.policy.config
    blocks = sim.memory.num_gpu_blocks
    bs = sim.kv_cfg.block_size
    need = sum(blocks_for(n - 1, bs) for n in w.largest_lengths(cfg.max_num_seqs))
    return need > blocks - watermark_blocks(cfg.kv_watermark, blocks)


def pool_blocker(sim: ArrayCoreHost, w: WorkloadArrays) -> str | None:
    """Why this workload cannot run on the array core (a request would be refused, or the
    KV pool can bind where the core cannot preempt as the policy does), or None. Where the
    pool can bind, the core preempts (by recompute, or by swap while the CPU pool has room)
    with the policy's rule on counts (``decode_preemptions``), if every request fits the
    pool alone above the watermark and, without chunked prefill, its recompute fits one step
    (so it never re-prefills in chunks); it swaps only with a watermark of at least one
    block, and not under chunked prefill (a request swapped mid-prefill resumes in chunks);
    with prefix caching only where prompts take blocks chunk by chunk (vLLM v1, SGLang: a
    request recomputed finds what is left of its own blocks, which the core follows on
    counts).
    A policy that states no decode preemptions (``runs_guarded``) runs with its admission
    counting blocks until a running request finds none, and the replica loop from there."""
    n = len(w.arrivals)
    if not n:
        return "no requests"
    if n >= 1 << INDEX_BITS:
        return f"{n} requests (the core numbers them in {INDEX_BITS} bits)"
    if any(map(gt, w.arrivals, islice(w.arrivals, 1, None))):
        return "arrival times that decrease (the replica takes them in the order given)"
    cfg = sim.policy.config
    # (A disaggregated prefill replica runs nothing when it plans: every request leaves
    # with its prompt's step, so none is ever preempted to admit another.)
    if isinstance(sim.cluster, ClusterConfig) and sim.policy.may_preempt_to_admit(w.priorities):
        return (f"policy {cfg.name!r} may preempt a running request to admit a waiting one "
                f"on this workload (policy.preemptive)")
    largest = w.largest_lengths(cfg.max_num_seqs)
    if largest[0] > sim.model.max_model_len:
        return "a request longer than model.max_model_len (refused at arrival)"
    if not cfg.enable_chunked_prefill and max(w.prompt_lens) > cfg.max_num_batched_tokens:
        return "a prompt longer than policy.max_num_batched_tokens (refused at arrival)"
    if not isinstance(sim.cluster, ClusterConfig) and sim.is_cluster:
        return _refused_by_pools(sim, w)
    if not pool_can_bind(sim, w):
        return None
    blocks = sim.memory.num_gpu_blocks
    watermark = watermark_blocks(cfg.kv_watermark, blocks)
    bs = sim.kv_cfg.block_size
    fills_alone = blocks_for(largest[0] - 1, bs) > blocks - watermark
    if isinstance(sim.cluster, ClusterConfig) and sim.cluster.pipeline_parallel_size > 1:
        # Admission counts blocks, and the run is given up once a decode micro-batch's
        # blocks do not fit (where the policy would preempt: sim/array_pipeline.py).
        return ("the KV pool can bind, with pipeline stages and a request that alone fills "
                "the pool above the watermark") if fills_alone else None
    why = None
    if (sim.policy.implements_chunked_prefill and sim.policy.waiting_by_priority()
            and not callable(getattr(sim.policy, "decode_victims", None))):
        # (Its victims go by priority, not the last rows in arrival order.)
        why = "a waiting queue in priority order (preempting by priority)"
    elif sim.policy.reserves_full_length:
        # Nobody is ever preempted: admission counts each request's whole length (chunk_plan's
        # room), which its decodes never outgrow.
        if sim.prefix_caching:
            why = "prefix caching (its hits would change what a request reserves)"
        elif fills_alone:
            why = "a request that alone fills the pool above the watermark"
    elif runs_guarded(sim.policy):
        # Admission counts blocks, and the run is given up once a running request finds no
        # block (ArrayCore.guard): one that never fits alone would be, sooner or later.
        if fills_alone:
            why = "a request that alone fills the pool above the watermark"
    elif cfg.preemption_mode == "swap" and sim.policy.implements_chunked_prefill:
        why = "policy.preemption_mode=swap under chunked prefill's step structure"
    elif cfg.preemption_mode == "swap" and watermark < 1:
        # A request swapped back in then always finds its next block (the watermark's).
        why = "policy.preemption_mode=swap and a watermark of no block"
    elif sim.prefix_caching and sim.policy.holds_whole_prompt:
        # (Where prompts take blocks chunk by chunk, the core follows a recomputed
        # request's own blocks through the free queue: sim/array_core.py ``runs``.)
        why = "prefix caching (a recomputed request would find its own blocks)"
    elif not cfg.enable_chunked_prefill and largest[0] - 1 > cfg.max_num_batched_tokens:
        why = ("a request whose recompute (prompt + output - 1 tokens) exceeds "
               "policy.max_num_batched_tokens")
    elif fills_alone:
        why = "a request that alone fills the pool above the watermark"
    return None if why is None else f"the KV pool can bind, with {why}"


def _refused_by_pools(sim: ArrayCoreHost, w: WorkloadArrays) -> str | None:
    """A disaggregated deployment: a request the prefill pool refuses at arrival (its prompt's
    blocks) or the decode pool does (its whole length's blocks, or its prompt's above the
    decode watermark), or None. Whether a pool binds is for the run to find out
    (sim/array_disagg.py gives a run up where one could)."""
    prefill, decode = sim.pools
    if blocks_for(max(w.prompt_lens), prefill.block_size) > prefill.memory.num_gpu_blocks:
        return "a prompt the prefill pool's KV blocks cannot hold (refused at arrival)"
    bs, blocks = decode.block_size, decode.memory.num_gpu_blocks
    watermark = watermark_blocks(decode.first_policy.config.kv_watermark, blocks)
    for p, o in zip(w.prompt_lens, w.output_lens):
        if o > 1 and decode_refusal(p, p + o - 1, bs, blocks, watermark) is not None:
            return "a request the decode pool's KV blocks cannot hold (refused at arrival)"
    return None
