"""Clusters in step_mode=fast reproduce step_mode=exact: co-located replicas behind each
router and disaggregated prefill/decode pools (whose decode replicas take decode jumps), on
random small workloads under KV pressure, with both preemption modes. The same steps on every
replica, the same request timestamps, and the same free block queue on every replica at the
end (so the same block ids were handed out in the same order)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import BUILT_IN, Simulation
from sim.replica import SimulationStalled
from sim.simulation import Components
from sim.simulation import Simulation as EngineSimulation
from tests.helpers import assert_approx, compose_cfg, free_queues

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

STEP_INTS = ["replica_id", "step", "batch_size", "prefill_tokens", "decode_tokens", "sampled",
             "num_waiting", "num_running", "num_swapped", "kv_blocks_used", "recomputed",
             "swapped_out", "swap_out_blocks", "swap_in_blocks"]
REQUEST_TIMES = ["first_scheduled_time", "first_token_time", "finish_time", "ttft", "tpot",
                 "e2e_latency"]
REQUEST_SAME = ["request_id", "replica_id", "status", "output_len", "num_preemptions",
                "num_swaps", "num_recomputes", "num_cached_tokens"]
# The cluster columns that are not times (kv_backpressure_wait and kv_transfer_time are).
CLUSTER_SAME = ["prefill_replica_id", "decode_replica_id", "kv_transfer_bytes"]
# summary.json's per-replica figures: equal, and equal to 1e-9 relative (times).
REPLICA_SAME = ["replica_id", "role", "routed", "num_steps"]
REPLICA_CLOSE = ["busy_fraction", "kv_peak_usage"]


def _run(mode: str, overrides: list[str], components: Components = BUILT_IN):
    cfg = compose_cfg(f"step_mode={mode}", *overrides)
    sim = EngineSimulation(cfg, components=components)
    res = sim.run()
    # Why the fast run did not take the array core (None: it did).
    res.summary["array_core_skipped"] = sim.array_core_skipped
    reqs = pd.DataFrame(res.requests_sink.rows, columns=res.requests_sink.columns)
    steps = pd.DataFrame(res.steps_sink.rows, columns=res.steps_sink.columns)
    # Replicas write their rows as they go (a jump writes its steps at once): compare each
    # replica's own sequence.
    steps = steps.sort_values(["replica_id", "step"], kind="stable").reset_index(drop=True)
    return (res.summary, reqs.sort_values("request_id").reset_index(drop=True), steps,
            free_queues(res))


def assert_fast_equals_exact(overrides: list[str], components: Components = BUILT_IN,
                             exact_only: Sequence[str] = ()) -> dict:
    """The fast run's summary, once it has the exact run's steps, requests, block ids and
    figures. ``exact_only``: overrides of the exact run alone that change nothing it does
    (``check_integrity=true`` checks the books after its every step)."""
    fast, rf, sf, free_f = _run("fast", overrides, components)
    exact, re_, se, free_e = _run("exact", [*overrides, *exact_only], components)
    assert len(sf) == len(se)
    assert (sf[STEP_INTS].to_numpy() == se[STEP_INTS].to_numpy()).all()
    for c in ("time", "duration"):
        a, b = sf[c].astype(float).to_numpy(), se[c].astype(float).to_numpy()
        assert_approx(a, b, rel=1e-9, abs=1e-12, what=c)
    assert rf[REQUEST_SAME].equals(re_[REQUEST_SAME])
    if "prefill_replica_id" in rf:
        assert rf[CLUSTER_SAME].astype(str).equals(re_[CLUSTER_SAME].astype(str))
        assert len(fast["replicas"]) == len(exact["replicas"])
        for a, b in zip(fast["replicas"], exact["replicas"]):
            assert {k: a[k] for k in REPLICA_SAME} == {k: b[k] for k in REPLICA_SAME}
            for k in REPLICA_CLOSE:
                assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k
    for key in ("duration", "kv_peak_usage", "num_preemptions", "num_swaps",
                "num_recomputes", "num_swap_fallbacks", "completed", "prefix_cache_queries",
                "prefix_cache_hits", "kv_evictions"):
        assert fast[key] == pytest.approx(exact[key], rel=1e-9), key
    for c in REQUEST_TIMES:
        a = pd.to_numeric(rf[c]).to_numpy(dtype=float)
        b = pd.to_numeric(re_[c]).to_numpy(dtype=float)
        assert_approx(a, b, rel=1e-9, abs=1e-12, nan_ok=True, what=c)
    if free_f is not None:  # None on the array core (no block ids)
        assert free_f == free_e
    return fast


def _workload(seed: int, qps: float, n: int) -> list[str]:
    return ["model=tiny", f"seed={seed}", f"workload.qps={qps}", f"workload.num_requests={n}",
            "workload.prompt_len.max=300", "workload.output_len.max=200"]


POLICIES = ["fcfs", "sjf", "priority", "chunked_prefill", "sglang"]
POLICY_EXTRA = {"priority": ["workload.priorities=[1,1,2]"],
                "sjf": ["policy.predictor=noisy"],
                "chunked_prefill": ["policy.max_num_batched_tokens=256"],
                "sglang": ["policy.chunked_prefill_size=128"]}
# (Each of these engines preempts by recompute only.)
RECOMPUTE_ONLY = ("sglang", "vllm_v1", "trtllm")


def preemption(policy: str, swap: bool) -> str:
    """The ``policy.preemption_mode`` override: swap where asked and the policy has it."""
    swap = swap and policy not in RECOMPUTE_ONLY
    return f"policy.preemption_mode={'swap' if swap else 'recompute'}"


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 80.0), blocks=st.integers(60, 400),
       replicas=st.integers(2, 3),
       router=st.sampled_from(["round_robin", "random", "least_outstanding", "least_kv",
                               "power_of_two", "prefix_aware", "prefix_aware_approx"]),
       policy=st.sampled_from(POLICIES), swap=st.booleans(), array_core=st.booleans())
def test_colocated_replicas_fast_equals_exact(seed, qps, blocks, replicas, router, policy,
                                              swap, array_core):
    # (array_core=false: the replica loop's fast path, where the array core would run it.)
    assert_fast_equals_exact([
        *_workload(seed, qps, 60), f"policy={policy}", *POLICY_EXTRA.get(policy, []),
        "policy.max_num_seqs=16", f"kv.num_gpu_blocks_override={blocks}",
        preemption(policy, swap), f"array_core={str(array_core).lower()}",
        f"cluster.num_replicas={replicas}", f"cluster.router={router}"])


# Every built-in policy, on pipelined replicas.
PIPELINE_POLICIES = [*POLICIES, "vllm_v1", "trtllm", "static"]


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 100.0), blocks=st.integers(50, 400),
       replicas=st.integers(1, 2), policy=st.sampled_from(PIPELINE_POLICIES),
       swap=st.booleans())
def test_pipelined_replicas_fast_equals_exact(seed, qps, blocks, replicas, policy, swap):
    """Pipeline stages in step_mode=fast (decode runs in flight, the policy's steady
    micro-batches repeated without asking it) against one plan per micro-batch."""
    assert_fast_equals_exact([
        *_workload(seed, qps, 60), f"policy={policy}", *POLICY_EXTRA.get(policy, []),
        "policy.max_num_seqs=16", f"kv.num_gpu_blocks_override={blocks}",
        preemption(policy, swap), "cluster.pipeline_parallel_size=2",
        f"cluster.num_replicas={replicas}", "cluster.router=least_kv"])


def test_pipelined_replica_repeats_steady_micro_batches():
    """A pipelined replica repeats most of its micro-batches without the policy, through
    finishes, and stops at every arrival: the same steps, block ids and times as
    step_mode=exact, where the policy plans each micro-batch."""
    setup = [*_workload(11, 20.0, 60), "policy.max_num_seqs=16",
             "cluster.pipeline_parallel_size=2", "array_core=false"]
    summary = assert_fast_equals_exact(setup)
    res = EngineSimulation(compose_cfg("step_mode=fast", *setup), components=BUILT_IN).run()
    (replica,) = res.replicas
    assert replica.num_repeats > res.summary["num_steps"] // 2
    assert 0 < summary["num_decode_jumps"] < replica.num_repeats


@pytest.mark.parametrize("layout", [[], ["cluster.num_replicas=2", "cluster.router=least_kv"]])
def test_pipelined_replicas_repeat_in_a_closed_loop(layout):
    """Multi-turn sessions: a finish brings the session's next turn, at once (no think
    time) or later. A pipelined replica's repeats never pass another process's event, so
    they go on in a closed loop too, where plain replicas take no jumps in a cluster."""
    setup = ["model=tiny", "seed=3", "workload=multi_turn", "workload.num_sessions=30",
             "workload.qps=4", "workload.think_time_s=0.0", "workload.system_prompt_len=64",
             "workload.max_prompt_len=600", "workload.user_len.max=100",
             "workload.output_len.max=80", "policy=vllm_v1", "kv.num_gpu_blocks_override=300",
             "cluster.pipeline_parallel_size=2", *layout]
    assert_fast_equals_exact(setup)
    res = EngineSimulation(compose_cfg("step_mode=fast", *setup), components=BUILT_IN).run()
    assert sum(r.num_repeats for r in res.replicas) > res.summary["num_steps"] // 2


@pytest.mark.parametrize("router, seed, sessions, think, median", [
    ("round_robin", 961, 10, 0.0, 100),  # turns sent to a replica in the middle of its jump
    ("least_kv", 999, 20, 0.05, 100),  # KV use read in the middle of a jump
    ("prefix_aware", 1, 20, 0.05, 200),  # caches read where a jump's new blocks evicted some
])
def test_closed_loop_clusters_sleep_through_their_jumps(router, seed, sessions, think, median):
    """Multi-turn sessions behind a router: a finish on one replica brings a turn that the
    router may send to a replica in the middle of a jump. Each replica sleeps through its
    jumps as a chain of step ends: the turn cuts the jump of the replica it goes to at the
    step in progress, and a router reading a replica's caches or KV use first has it take
    the blocks of the steps begun, exactly as step by step. (Each case fails if its part is
    left out.)"""
    setup = ["model=tiny", f"seed={seed}", "workload=multi_turn",
             f"workload.num_sessions={sessions}", "workload.qps=5",
             f"workload.think_time_s={think}", "workload.system_prompt_len=64",
             "workload.max_prompt_len=900", "workload.user_len.max=60",
             f"workload.output_len.median={median}", "workload.output_len.max=400",
             "policy=vllm_v1", "kv.num_gpu_blocks_override=200", "cluster.num_replicas=2",
             f"cluster.router={router}"]
    summary = assert_fast_equals_exact(setup)
    assert summary["num_decode_jumps"] > 0
    res = EngineSimulation(compose_cfg("step_mode=fast", *setup), components=BUILT_IN).run()
    assert all(r.lazy_decode and r.num_jumps for r in res.replicas)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_pipelined_requests_that_restart_for_ever_stop_the_run(mode):
    """Two requests on a pipelined decode replica of 39 blocks cannot hold their blocks
    together; the one in flight cannot be preempted, so the other preempts itself and
    restarts its prefill, in turn, for ever: the run stops with an error that says so."""
    setup = ["model=llama3_8b", "hardware=a100_80gb", "seed=25951", "workload=multi_turn",
             "workload.num_sessions=16", "workload.qps=0.5", "workload.think_time_s=0.0",
             "workload.system_prompt_len=256", "workload.num_system_prompts=1",
             "workload.max_prompt_len=600", "workload.user_len.max=40",
             "workload.user_len.median=100", "workload.output_len.median=150",
             "workload.output_len.max=400", "workload.turns.max=2", "policy=vllm_v1",
             "policy.max_num_batched_tokens=128", "policy.max_num_seqs=32",
             "kv.enable_prefix_caching=false", "kv.num_gpu_blocks_override=39",
             "kv.num_cpu_blocks=8", "cluster=disaggregated", "cluster.router=power_of_two",
             "cluster.num_decode_replicas=2", "cluster.decode_router=round_robin",
             "cluster.link.preset=infiniband", "cluster.decode.pipeline_parallel_size=2",
             f"step_mode={mode}"]
    with pytest.raises(SimulationStalled, match="preempted by recompute in a row with no "
                                                "token sampled"):
        EngineSimulation(compose_cfg(*setup), components=BUILT_IN).run()


def test_pipelined_sjf_repeats_only_while_its_order_holds():
    """SJF with noisy predictions reorders its running requests as predictions run out: a
    repeated micro-batch keeps its run's order only as far as ``decode_order_steps`` says
    (a replica that repeats past it hands out blocks and finishes in the wrong order)."""
    assert_fast_equals_exact([*_workload(7104, 27.99946832539177, 100), "policy=sjf",
                              "policy.predictor=noisy", "policy.max_num_seqs=32",
                              "cluster.pipeline_parallel_size=2"])


def test_pipelined_repeats_stop_at_the_policys_deadline():
    """SJF's aging deadline comes while a steady micro-batch repeats: the repeats stop
    there, and the policy plans (an aged request goes ahead), even though the loop's clock
    passed the deadline while the pipeline was full and the policy no longer names it."""
    assert_fast_equals_exact([
        "model=tiny", "seed=4", "policy=sjf", "policy.predictor=bucket", "policy.aging_s=0.5",
        "workload.qps=300.0", "workload.num_requests=100", "workload.prompt_len.max=600",
        "workload.output_len.max=200", "kv.num_gpu_blocks_override=200",
        "policy.max_num_batched_tokens=1024", "cluster.pipeline_parallel_size=2"])


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 120.0), blocks=st.integers(40, 400),
       prefill=st.integers(1, 2), decode=st.integers(1, 3),
       decode_router=st.sampled_from(["round_robin", "least_outstanding", "least_kv"]),
       link=st.sampled_from(["nvlink", "infiniband", "pcie", "ethernet"]),
       scope=st.sampled_from(["replica", "cluster"]), prefill_pp=st.sampled_from([1, 1, 2]),
       decode_pp=st.sampled_from([1, 1, 2]), policy=st.sampled_from(POLICIES),
       swap=st.booleans())
def test_disaggregated_pools_fast_equals_exact(seed, qps, blocks, prefill, decode,
                                               decode_router, link, scope, prefill_pp,
                                               decode_pp, policy, swap):
    assert_fast_equals_exact([
        *_workload(seed, qps, 60), f"policy={policy}", *POLICY_EXTRA.get(policy, []),
        "policy.max_num_seqs=16", f"kv.num_gpu_blocks_override={blocks}",
        preemption(policy, swap),
        "cluster=disaggregated", f"cluster.num_prefill_replicas={prefill}",
        f"cluster.num_decode_replicas={decode}", f"cluster.decode_router={decode_router}",
        f"cluster.link.preset={link}", f"cluster.link.scope={scope}",
        f"cluster.prefill.pipeline_parallel_size={prefill_pp}",
        f"cluster.decode.pipeline_parallel_size={decode_pp}"])


@pytest.mark.slow
def test_disaggregated_decode_replicas_take_decode_jumps():
    """The decode pool jumps (a lower bound on its next outside event lets it), the prefill
    pool steps one at a time (it hands every request off after its prompt step)."""
    s = assert_fast_equals_exact([*_workload(3, 40.0, 40), "cluster=disaggregated",
                                  "cluster.num_prefill_replicas=2",
                                  "cluster.num_decode_replicas=2"])
    assert s["num_decode_jumps"] > 0


def test_back_pressure_on_one_decode_replica_bounds_the_others_jumps():
    """Transfers wait for decode replica B's blocks; B finishes a request mid-way through
    decode replica A's jump, starts a transfer, whose arrival frees the prefill replica's
    blocks, whose next step hands a request to A: A's jump must have stopped by then (a
    tiny pool on every replica makes all of it happen within a few milliseconds)."""
    s = assert_fast_equals_exact([
        *_workload(269074, 83.72447158133198, 80), "policy=priority",
        "workload.priorities=[1,1,2]", "policy.max_num_seqs=64", "kv.num_gpu_blocks_override=44",
        "policy.preemption_mode=swap", "cluster=disaggregated",
        "cluster.num_prefill_replicas=1", "cluster.num_decode_replicas=2",
        "cluster.decode_router=random", "cluster.link.preset=nvlink"])
    assert s["num_decode_jumps"] > 0


@pytest.mark.slow
def test_a_request_arriving_exactly_at_a_decode_step_end(tmp_path):
    """A request reaches an idle prefill replica at the very instant a decode step ends: the
    decode replica, resuming at that instant, must not jump past the prefill step the arrival
    is about to start (its end is not known yet). The arrival time is a decode step's end
    from an exact run of the first request alone, to the last bit."""
    base = tmp_path / "one.csv"
    base.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,50,200\n")
    layout = ["model=tiny", "workload=trace", "cluster=disaggregated"]
    alone = Simulation(compose_cfg("step_mode=exact", *layout, f"workload.path={base}")).run()
    decode_starts = [float(row[2]) for row in alone.steps_sink.rows if int(row[1]) == 1]
    tie = tmp_path / "tie.csv"
    tie.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   f"0,50,200\n{decode_starts[40]!r},50,100\n")
    s = assert_fast_equals_exact([*layout, f"workload.path={tie}"])
    assert s["num_decode_jumps"] > 0
