"""Disaggregated deployments on the array core (sim/array_disagg.py): prefill replicas that
hand requests off, a decode router reading outstanding counts at each hand-off, the KV link's
queues, decode replicas taking transfers in as members, and the runs it leaves to the
replica loop (exact ties, pools that might bind). Fast equals exact on random workloads."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.cluster.link import LinkConfig
from sim.progress import Progress
from tests import test_lazy_decode as lazy
from tests.helpers import compose_cfg
from tests.test_array_cluster import files_on_both_loops
from tests.test_cluster_fast_exact import assert_fast_equals_exact

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

COUNT_ROUTERS = ["round_robin", "random", "least_outstanding", "power_of_two"]
DECODE_ROUTERS = [*COUNT_ROUTERS, "least_kv"]  # the decode router may read KV usage too
DISAGG = ["cluster=disaggregated"]
# The prefill pool's policy, over the run's fcfs (vLLM v1's prefix caching off: the random test
# draws it on for any pair).
PREFILL = {"fcfs": [], "sjf": ["+cluster.prefill.policy={name: sjf, predictor: noisy}"],
           "priority": ["+cluster.prefill.policy.name=priority", "workload.priorities=[1,1,2]"],
           "chunked_prefill": [("+cluster.prefill.policy={name: chunked_prefill, "
                                "enable_chunked_prefill: true, max_num_batched_tokens: 128, "
                                "max_num_seqs: 64}")],
           "vllm_v1": [("+cluster.prefill.policy={name: vllm_v1, enable_chunked_prefill: true, "
                        "kv_watermark: 0.0, max_num_batched_tokens: 128, max_num_seqs: 64}"),
                       "kv.enable_prefix_caching=false"]}
# The decode pool's policy (SJF and priority: requests finishing together leave in their
# running order; SJF's noisy predictor draws on the decode replica as each transfer arrives).
DECODE = {"fcfs": [], "chunked_prefill": [
    ("+cluster.decode.policy={name: chunked_prefill, enable_chunked_prefill: true, "
     "max_num_batched_tokens: 256}")],
    "sjf": ["+cluster.decode.policy={name: sjf, predictor: noisy}"],
    "priority": ["+cluster.decode.policy.name=priority", "workload.priorities=[1,1,2]"],
    "vllm_v1": [("+cluster.decode.policy={name: vllm_v1, enable_chunked_prefill: true, "
                 "kv_watermark: 0.0, max_num_batched_tokens: 512}"),
                "kv.enable_prefix_caching=false"]}
# The two pools on other hardware or parallelism (each prices its own steps; the link
# carries a transfer over the smaller side's GPUs).
SIDES = [[], ["cluster.prefill.tensor_parallel_size=2", "cluster.decode.hardware=h100_sxm"],
         ["cluster.decode.tensor_parallel_size=2", "cluster.prefill.hardware=a100_40gb"]]
# Pipeline stages of the prefill and the decode pool (tiny has two layers).
STAGES = [(1, 1), (2, 1), (1, 2), (2, 2)]
# Why the core may leave a random run to the replica loop.
STATED = ("exactly", "might run short", "at one instant",
          "does not fit its KV pool")  # (a pipelined replica's micro-batch)


def _trace(path: Path, rows: list[tuple[float, int, int]]) -> str:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"{t!r},{p},{o}\n" for t, p, o in rows))
    return f"workload.path={path}"


def _run(*overrides: str, out: Path | None = None) -> tuple[Simulation, pd.DataFrame, dict]:
    sim = Simulation(compose_cfg(*overrides), out)
    res = sim.run()
    reqs = pd.DataFrame(res.requests_sink.rows, columns=res.requests_sink.columns)
    return sim, reqs.sort_values("request_id").reset_index(drop=True), res.summary


@pytest.mark.parametrize("decode_router", DECODE_ROUTERS)
def test_default_workload_on_two_by_two_runs_on_the_core(decode_router):
    s = assert_fast_equals_exact([*DISAGG, "cluster.num_prefill_replicas=2",
                                  "cluster.num_decode_replicas=2",
                                  f"cluster.decode_router={decode_router}",
                                  "workload.num_requests=200", "workload.qps=30"])
    assert s["step_engine"] == "array_core", s["array_core_skipped"]
    assert s["num_decode_jumps"] > 0 and s["cluster"] == "disaggregated"
    assert s["num_kv_transfers"] == sum(r["routed"] for r in s["replicas"][2:]) > 0
    assert sum(r["routed"] for r in s["replicas"][:2]) == 200


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(2.0, 120.0), prefill=st.integers(1, 3),
       decode=st.integers(1, 3), router=st.sampled_from(COUNT_ROUTERS),
       decode_router=st.sampled_from(DECODE_ROUTERS),
       link=st.sampled_from(["nvlink", "infiniband", "pcie", "ethernet"]),
       scope=st.sampled_from(["replica", "cluster"]), latency=st.sampled_from([None, 0.0]),
       prefill_policy=st.sampled_from(sorted(PREFILL)),
       decode_policy=st.sampled_from(sorted(DECODE)),
       blocks=st.sampled_from([None, 40, 120, 400]), block_size=st.sampled_from([1, 4, 16]),
       sides=st.sampled_from(SIDES), caching=st.booleans(), stages=st.sampled_from(STAGES))
def test_random_deployments_fast_equal_exact(seed, qps, prefill, decode, router, decode_router,
                                             link, scope, latency, prefill_policy,
                                             decode_policy, blocks, block_size, sides, caching,
                                             stages):
    pool = [] if blocks is None else [f"kv.num_gpu_blocks_override={blocks * 16 // block_size}"]
    policies = [*PREFILL[prefill_policy], *DECODE[decode_policy]]
    if caching:  # (prefix caching on, with no prompt sharing a prefix)
        policies = [*(p for p in policies if "enable_prefix_caching" not in p),
                    "kv.enable_prefix_caching=true"]
    s = assert_fast_equals_exact([
        # (Pipelined replicas step many more times: fewer requests keep the test's time.)
        "model=tiny", f"seed={seed}", f"workload.qps={qps}",
        f"workload.num_requests={60 if stages == (1, 1) else 40}",
        "workload.prompt_len.max=300", "workload.output_len.max=200", "policy.max_num_seqs=16",
        *DISAGG, f"cluster.num_prefill_replicas={prefill}",
        f"cluster.num_decode_replicas={decode}", f"cluster.router={router}",
        f"cluster.decode_router={decode_router}", f"cluster.link.preset={link}",
        f"cluster.link.scope={scope}",
        *([] if latency is None else [f"cluster.link.latency_us={latency}"]),
        f"kv.block_size={block_size}", *pool,
        *dict.fromkeys(policies), *sides, f"cluster.prefill.pipeline_parallel_size={stages[0]}",
        f"cluster.decode.pipeline_parallel_size={stages[1]}"])
    # The core runs these unless a pool might bind (a small one), or two events the replica
    # loop orders by simpy's event order meet exactly.
    reason = s["array_core_skipped"]
    assert reason is None or any(x in reason for x in STATED), reason
    assert blocks is not None or reason is None or "might run short" not in reason


@pytest.mark.parametrize("stages", STAGES[1:])
def test_pipeline_stages_on_either_pool_run_on_the_core(tmp_path, stages):
    """A pipelined prefill replica hands each request off as its prompt's micro-batch leaves
    (its blocks held for the transfer, in every later row's blocks until it ends); a
    pipelined decode replica takes each transfer in among the requests not in flight, its
    blocks reserved until then. The files are the replica loop's."""
    layout = ["model=tiny", "seed=3", "workload.qps=80", "workload.num_requests=150",
              "workload.prompt_len.max=300", "workload.output_len.max=100", *DISAGG,
              "cluster.num_prefill_replicas=2", "cluster.num_decode_replicas=2",
              f"cluster.prefill.pipeline_parallel_size={stages[0]}",
              f"cluster.decode.pipeline_parallel_size={stages[1]}"]
    s = assert_fast_equals_exact(layout)
    assert s["step_engine"] == "array_core", s["array_core_skipped"]
    assert s["num_kv_transfers"] > 0
    files_on_both_loops(tmp_path, layout)


@pytest.mark.parametrize("prefill_policy", sorted(PREFILL))
def test_each_prefill_policy_runs_on_the_core(prefill_policy):
    """Chunked prefill's prompts span several steps there (a budget of 128 tokens), each
    holding its whole prompt's blocks until its transfer ends."""
    s = assert_fast_equals_exact([
        "model=tiny", "seed=7", "workload.qps=40", "workload.num_requests=80",
        "workload.prompt_len.max=300", "workload.output_len.max=100", *DISAGG,
        "cluster.num_prefill_replicas=2", "cluster.num_decode_replicas=2",
        *PREFILL[prefill_policy]])
    assert s["step_engine"] == "array_core", s["array_core_skipped"]
    assert s["num_kv_transfers"] > 0


def test_vllm_v1_with_its_prefix_cache_runs_on_the_core():
    """vLLM v1's defaults (prefix caching on) on both pools: with no prompt sharing a
    prefix, the cache changes nothing but the tokens looked up (every prompt once, on its
    prefill replica), and those figures are the replica loop's."""
    layout = ["model=tiny", "seed=5", "workload.qps=40", "workload.num_requests=120",
              "workload.prompt_len.max=300", "workload.output_len.max=100", "policy=vllm_v1",
              *DISAGG, "cluster.num_prefill_replicas=2", "cluster.num_decode_replicas=2"]
    s = assert_fast_equals_exact(layout)
    assert s["step_engine"] == "array_core", s["array_core_skipped"]
    assert s["enable_prefix_caching"] and s["prefix_cache_queries"] > 0
    _, _, loop = _run(*layout, "array_core=false")
    keys = ("prefix_cache_queries", "prefix_cache_hits", "kv_evictions")
    assert {k: s[k] for k in keys} == {k: loop[k] for k in keys}


@pytest.mark.parametrize("decode_policy", sorted(DECODE))
def test_each_decode_policy_runs_on_the_core(tmp_path, decode_policy):
    """A busy decode replica: requests often finish in the same step, and their
    requests.csv rows come in the decode policy's running order, as on the replica loop."""
    layout = ["model=tiny", "seed=11", "workload.qps=300", "workload.num_requests=150",
              "workload.prompt_len.max=200", "workload.output_len.max=200", *DISAGG,
              "cluster.num_decode_replicas=2", *DECODE[decode_policy]]
    s = assert_fast_equals_exact(layout)
    assert s["step_engine"] == "array_core", s["array_core_skipped"]
    files_on_both_loops(tmp_path, layout)
    orders = []
    for core in ("true", "false"):  # (written there by files_on_both_loops)
        rows = pd.read_csv(tmp_path / core / "requests.csv")
        orders.append({key: g["request_id"].tolist()
                       for key, g in rows.groupby(["replica_id", "finish_time"], sort=False)})
    assert orders[0] == orders[1]
    assert any(len(ids) > 1 for ids in orders[0].values())


def test_the_decode_router_reads_counts_at_the_hand_off(tmp_path):
    """One prefill replica, two decode replicas behind least_outstanding: request 0 decodes
    long on decode replica 1 (id 1), request 1 short on replica 2; request 2, handed off once
    request 1 has finished, goes where nothing is left (replica 2), not to the lowest index
    that counting finished requests would give."""
    trace = _trace(tmp_path / "t.csv", [(0.0, 40, 400), (0.0, 40, 3), (0.05, 40, 5)])
    layout = ["model=tiny", "workload=trace", trace, *DISAGG, "cluster.num_decode_replicas=2",
              "cluster.decode_router=least_outstanding"]
    sim, reqs, s = _run(*layout)
    assert s["step_engine"] == "array_core", sim.array_core_skipped
    assert reqs["decode_replica_id"].tolist() == [1, 2, 2]
    assert reqs["replica_id"].tolist() == [1, 2, 2]
    assert [r["routed"] for r in s["replicas"]] == [3, 1, 2]
    assert_fast_equals_exact(layout)


def test_a_request_whose_first_token_is_its_last_finishes_on_the_prefill_replica(tmp_path):
    trace = _trace(tmp_path / "t.csv", [(0.0, 40, 1), (0.01, 40, 6)])
    layout = ["model=tiny", "workload=trace", trace, *DISAGG]
    sim, reqs, s = _run(*layout)
    assert s["step_engine"] == "array_core", sim.array_core_skipped
    assert reqs["replica_id"].tolist() == [0, 1]
    assert reqs["decode_replica_id"].astype(str).tolist() == ["", "1"]
    assert reqs["kv_transfer_bytes"].astype(str).tolist()[0] == ""
    assert s["num_kv_transfers"] == 1
    assert_fast_equals_exact(layout)


def test_the_progress_line_moves_through_both_passes(tmp_path, monkeypatch):
    """The prefill pass shows its simulated time under its name and counts nothing; the
    decode pass counts every finished request, those whose first token was their last (on
    the prefill replica) included."""
    seen: list[tuple[str, int, float]] = []

    def update(self: Progress, done: int, t: float, label: str = "") -> None:
        if self._bar.total is not None:  # the run's line, not a replica's silent one
            seen.append((label, done, t))

    monkeypatch.setattr(Progress, "update", update)
    # (The line is updated every 1,024 arrivals or hand-offs and every 64 pauses.)
    rows = [(0.002 * k, 40 + k % 7, 1 if k % 5 == 0 else 3 + k % 4) for k in range(2100)]
    sim, reqs, s = _run("model=tiny", "workload=trace", _trace(tmp_path / "t.csv", rows),
                        *DISAGG, "cluster.num_prefill_replicas=2")
    assert s["step_engine"] == "array_core", sim.array_core_skipped
    prompts = [i for i, (label, _, _) in enumerate(seen) if label == "prefill pass"]
    decodes = [i for i, (label, _, _) in enumerate(seen) if label == ""]
    assert prompts and decodes and max(prompts) < min(decodes)
    assert {seen[i][1] for i in prompts} == {0} and max(seen[i][2] for i in prompts) > 0
    ones = int((reqs["output_len"] == 1).sum())
    assert ones == 420
    for i in decodes:  # the decode pass's count at its simulated time
        _, count, t = seen[i]
        decoded = ((reqs["output_len"] > 1) & (reqs["finish_time"].astype(float) <= t)).sum()
        assert count == ones + decoded


def test_a_decode_pool_that_might_bind_takes_the_replica_loop():
    """A decode pool too small for everything it is sent at full length: the core gives the
    run up at the hand-off that might not fit, and the replica loop's back-pressure and
    preemption decide instead."""
    layout = ["model=tiny", "workload.num_requests=60", "workload.qps=60", *DISAGG,
              "cluster.num_decode_replicas=2", "kv.num_gpu_blocks_override=60",
              "workload.prompt_len.max=300", "workload.output_len.max=200"]
    sim, _, s = _run(*layout)
    assert s["step_engine"] == "replica"
    assert "might run short" in sim.array_core_skipped
    assert assert_fast_equals_exact(layout)["array_core_skipped"] is not None


def test_a_hand_off_exactly_at_a_decode_step_end_takes_the_replica_loop(tmp_path):
    """Request 1's prompt step (alone on the prefill replica, started when it arrives) ends
    exactly as a decode step of request 0 ends: the decode router's count at that instant is
    simpy's order, the core leaves the run to the replica loop."""
    layout = ["model=tiny", "workload=trace", *DISAGG, "step_mode=exact"]
    alone = Simulation(compose_cfg(*layout, _trace(tmp_path / "one.csv",
                                                   [(0.0, 50, 200)]))).run()
    prompt = Simulation(compose_cfg(*layout, _trace(tmp_path / "p.csv",
                                                    [(0.0, 50, 100)]))).run()
    rows = alone.steps_sink.rows
    end = float(rows[40][2]) + float(rows[40][3])  # a decode step's end (rows 0: prefill)
    duration = float(prompt.steps_sink.rows[0][3])  # a 50-token prompt step
    # The arrival whose prompt step ends exactly there, if the subtraction allows it.
    arrival = end - duration
    if arrival + duration != end:
        pytest.skip("no arrival time whose prompt step ends exactly at the decode step's end")
    trace = _trace(tmp_path / "tie.csv", [(0.0, 50, 200), (arrival, 50, 100)])
    sim, _, s = _run(*layout[:-1], trace)
    assert s["step_engine"] == "replica"
    assert "exactly" in sim.array_core_skipped
    assert assert_fast_equals_exact([*layout[:-1], trace])["array_core_skipped"] is not None


@pytest.mark.parametrize(("preset", "latency_us", "stages"),
                         [("infiniband", None, 1), ("pcie", 200_000, 1), ("infiniband", None, 2)])
def test_a_transfer_arriving_exactly_at_a_decode_step_end(tmp_path, preset, latency_us,
                                                          stages):
    """A transfer lands on the decode replica at the very instant one of its steps ends (or,
    with pipeline stages, one of its micro-batches leaves; placed as
    tests/test_lazy_decode.py places it): the core leaves the run to the replica loop,
    which orders the two as simpy does."""
    layout = ["model=tiny", "workload=trace", *DISAGG, f"cluster.link.preset={preset}",
              f"cluster.decode.pipeline_parallel_size={stages}"]
    if latency_us is not None:
        layout.append(f"cluster.link.latency_us={latency_us}")
    link = LinkConfig(preset=preset, latency_us=latency_us)
    ends = lazy._decode_ends(tmp_path, layout)
    d, nbytes = lazy._first_step(tmp_path, layout, 64)
    send = nbytes / link.bandwidth_bytes_per_s
    a = lazy._before(ends[30], lambda a: ((a + d) + send) + link.latency_s)
    assert a is not None
    trace = _trace(tmp_path / "tie.csv", [(0.0, 50, 200), (a, 64, 30)])
    sim, _, s = _run(*layout, trace)
    assert s["step_engine"] == "replica"
    assert "reaches replica 1 exactly as" in sim.array_core_skipped
    assert ("micro-batches leaves" in sim.array_core_skipped) == (stages > 1)
    assert assert_fast_equals_exact([*layout, trace])["array_core_skipped"] is not None


@pytest.mark.parametrize("overrides, reason", [
    (["cluster.router=least_kv"], "cluster.router 'least_kv' reads more than outstanding"),
    (["cluster.decode_router=prefix_aware"],
     "cluster.decode_router 'prefix_aware' reads more than outstanding request counts and KV"),
    (["cluster.decode.pipeline_parallel_size=2", "kv.enable_prefix_caching=false",
      ("+cluster.decode.policy={name: vllm_v1, scheduling_policy: priority, "
       "enable_chunked_prefill: true, kv_watermark: 0.0}")],
     "the decode pool's pipeline stages under policy 'vllm_v1' with a waiting queue"),
    (["kv.enable_prefix_caching=true", "workload.shared_prefix_len=64"],
     "a shared prompt prefix with prefix caching on"),
    (["kv.enable_prefix_caching=false",
      "+cluster.decode.policy={name: sglang, schedule_policy: lpm, "
      "enable_chunked_prefill: true, kv_watermark: 0.0}"],
     "decode pool policy 'sglang': policy.schedule_policy=lpm"),
    (["+cluster.decode.policy={name: static}"],
     "the decode pool's policy 'static' reserves whole lengths"),
])
def test_deployments_the_core_leaves_to_the_replica_loop(overrides, reason):
    sim, _, s = _run("model=tiny", "workload.num_requests=20", *DISAGG, *overrides)
    assert s["step_engine"] == "replica"
    assert reason in sim.array_core_skipped


def test_files_of_a_deployment_on_the_core_match_the_replica_loop(tmp_path):
    """requests.csv (cluster columns included), steps.csv and summary.json, as files."""
    fast, slow = files_on_both_loops(tmp_path, [
        "model=tiny", *DISAGG, "cluster.num_prefill_replicas=2",
        "cluster.num_decode_replicas=3", "cluster.decode_router=power_of_two",
        "workload.num_requests=120", "workload.qps=60"])
    assert [r["role"] for r in fast["replicas"]] == [r["role"] for r in slow["replicas"]]
    for key in ("busy_fraction", "kv_peak_usage"):
        assert [r[key] for r in fast["replicas"]] == pytest.approx(
            [r[key] for r in slow["replicas"]], rel=1e-9)
    for key in ("num_kv_transfers", "kv_transfer_bytes", "kv_backpressure_count",
                "link_utilization_per_port", "mean_kv_transfer_time_ms",
                "p99_kv_transfer_time_ms", "mean_kv_backpressure_wait_ms", "kv_peak_usage",
                "completed", "median_ttft_ms", "median_tpot_ms"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-9), key
