"""Co-located replicas on the array core (sim/array_cluster.py): routing on outstanding
counts and KV usage at each arrival, replicas that pause at every arrival not yet routed,
and the runs it leaves to the replica loop. Fast equals exact on random workloads, every
router that reads only those, every policy the core runs, pools that bind (recompute and
swap)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import assert_fast_equals_exact

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

LOAD_ROUTERS = ["round_robin", "random", "least_outstanding", "power_of_two", "least_kv"]
POLICY_EXTRA = {"fcfs": [], "sjf": ["policy.predictor=noisy"], "priority": [],
                "chunked_prefill": ["policy.max_num_batched_tokens=256"],
                "sglang": ["policy.max_num_batched_tokens=256", "policy.chunked_prefill_size=100",
                           "policy.max_num_seqs=64"]}


def _trace(path: Path, rows: list[tuple[float, int, int]]) -> str:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"{t!r},{p},{o}\n" for t, p, o in rows))
    return f"workload.path={path}"


def _run(*overrides: str) -> tuple[Simulation, pd.DataFrame, dict]:
    sim = Simulation(compose_cfg(*overrides))
    res = sim.run()
    reqs = pd.DataFrame(res.requests_sink.rows, columns=res.requests_sink.columns)
    return sim, reqs.sort_values("request_id").reset_index(drop=True), res.summary


@pytest.mark.parametrize("router", LOAD_ROUTERS)
def test_default_workload_on_four_replicas_runs_on_the_core(router):
    s = assert_fast_equals_exact(["cluster.num_replicas=4", f"cluster.router={router}",
                                  "workload.num_requests=300", "workload.qps=30"])
    assert s["step_engine"] == "array_core", s["array_core_skipped"]
    assert s["num_decode_jumps"] > 0 and s["cluster"] == "colocated"
    assert sum(r["routed"] for r in s["replicas"]) == 300


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(2.0, 80.0), replicas=st.integers(2, 4),
       router=st.sampled_from(LOAD_ROUTERS), policy=st.sampled_from(sorted(POLICY_EXTRA)),
       blocks=st.sampled_from([None, 60, 120, 400]), swap=st.booleans(),
       block_size=st.sampled_from([1, 4, 16]))
def test_random_clusters_fast_equal_exact(seed, qps, replicas, router, policy, blocks, swap,
                                          block_size):
    pool = [] if blocks is None else [f"kv.num_gpu_blocks_override={blocks * 16 // block_size}"]
    s = assert_fast_equals_exact([
        "model=tiny", f"seed={seed}", f"workload.qps={qps}", "workload.num_requests=60",
        "workload.prompt_len.max=300", "workload.output_len.max=200",
        f"cluster.num_replicas={replicas}", f"cluster.router={router}", f"policy={policy}",
        f"kv.block_size={block_size}", *pool, *POLICY_EXTRA[policy],
        f"policy.preemption_mode={'swap' if swap and policy != 'sglang' else 'recompute'}"])
    # The core runs these unless a pool binds where it cannot preempt as the policy does
    # (swap under chunked prefill; SGLang's retraction, given up where it comes), or a
    # request arrives exactly at a step's end.
    reason = s["array_core_skipped"]
    assert reason is None or "exactly" in reason or blocks is not None and (
        "the KV pool can bind" in reason or "does not fit its KV pool" in reason), reason


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 120), st.integers(1, 60)),
                     min_size=1, max_size=40),
       replicas=st.integers(2, 3), router=st.sampled_from(LOAD_ROUTERS),
       policy=st.sampled_from(sorted(POLICY_EXTRA)))
def test_bursts_of_equal_arrival_times_fast_equal_exact(tmp_path_factory, rows, replicas,
                                                        router, policy):
    # Arrival times on a 5 ms grid: many requests arrive together, and the router takes
    # each in turn before any replica plans.
    times = sorted(t * 0.005 for t, _, _ in rows)
    trace = _trace(tmp_path_factory.mktemp("burst") / "trace.csv",
                   [(t, p, o) for t, (_, p, o) in zip(times, rows)])
    s = assert_fast_equals_exact(["model=tiny", "workload=trace", trace,
                                  f"cluster.num_replicas={replicas}", f"cluster.router={router}",
                                  f"policy={policy}", *POLICY_EXTRA[policy]])
    assert s["array_core_skipped"] is None or "exactly" in s["array_core_skipped"]


def _around_one_step(tmp_path: Path, layout: list[str], replicas: tuple[int, int]):
    """Request 0 (one 100-token step, its only one) and request 1 (a 50-token prompt, a
    long answer) arrive together; request 2 just before request 0's step ends, then just
    after: for each, the run on the core, whose request 2 went to ``replicas[0]``, then
    ``replicas[1]``. Yields (trace override, requests, summary, that replica)."""
    one_step = Simulation(compose_cfg("model=tiny", "workload=trace", _trace(
        tmp_path / "one.csv", [(0.0, 100, 1)]))).run()
    end = float(one_step.requests_sink.rows[0][11])  # request 0's finish_time
    for arrival, replica in zip((end * 0.999, end * 1.001), replicas):
        trace = _trace(tmp_path / "t.csv", [(0.0, 100, 1), (0.0, 50, 400), (arrival, 50, 5)])
        sim, reqs, s = _run(*layout, trace)
        assert s["step_engine"] == "array_core", sim.array_core_skipped
        assert reqs["replica_id"].tolist() == [0, 1, replica]
        yield trace, reqs, s, replica


def test_outstanding_counts_at_the_arrival_decide(tmp_path):
    """Three replicas behind least_outstanding: request 2 goes to the idlest replica with
    the lowest index, counting request 0 as finished only if its one step ended before
    request 2 arrived."""
    layout = ["model=tiny", "workload=trace", "cluster.num_replicas=3",
              "cluster.router=least_outstanding"]
    for _, reqs, s, replica in _around_one_step(tmp_path, layout, (2, 0)):
        assert reqs["prefill_replica_id"].tolist() == [0, 1, replica]
        assert [r["routed"] for r in s["replicas"]] == ([2, 1, 0] if replica == 0 else [1, 1, 1])


def test_kv_usage_of_the_step_in_progress_decides(tmp_path):
    """Two replicas behind least_kv: request 2 goes where fewer blocks are in use as it
    arrives. During request 0's one step (its prompt's 7 blocks, held until the step ends,
    where it finishes) that is replica 1, decoding a 50-token prompt (4 blocks); just after
    it, idle replica 0. Request 1 arrives with request 0 and goes to replica 1: replica 0 has
    not planned yet, so both are empty and the outstanding counts decide."""
    layout = ["model=tiny", "workload=trace", "cluster.num_replicas=2",
              "cluster.router=least_kv"]
    for trace, _, _, _ in _around_one_step(tmp_path, layout, (1, 0)):
        assert assert_fast_equals_exact([*layout, trace])["step_engine"] == "array_core"


def test_an_arrival_exactly_at_a_step_end_takes_the_replica_loop(tmp_path):
    """Which of the two events the router sees first is simpy's order: the core leaves
    such a run to the replica loop, and says why."""
    layout = ["model=tiny", "workload=trace", "cluster.num_replicas=2",
              "cluster.router=least_outstanding"]
    alone = Simulation(compose_cfg("step_mode=exact", *layout, _trace(
        tmp_path / "one.csv", [(0.0, 50, 200)]))).run()
    starts = [float(row[2]) for row in alone.steps_sink.rows]
    trace = _trace(tmp_path / "tie.csv", [(0.0, 50, 200), (starts[40], 50, 100)])
    sim, _, s = _run(*layout, trace)
    assert s["step_engine"] == "replica"
    assert "exactly as a step of replica 0 ends" in sim.array_core_skipped
    assert assert_fast_equals_exact([*layout, trace])["array_core_skipped"] is not None


def test_the_fallback_rewrites_the_files(tmp_path):
    """A run that leaves the core part-way writes the replica loop's files, whole."""
    layout = ["model=tiny", "workload=trace", "cluster.num_replicas=2"]
    alone = Simulation(compose_cfg("step_mode=exact", *layout, _trace(
        tmp_path / "one.csv", [(0.0, 50, 200)]))).run()
    starts = [float(row[2]) for row in alone.steps_sink.rows]
    trace = _trace(tmp_path / "tie.csv", [(0.0, 50, 200), (starts[40], 50, 100)])
    out = tmp_path / "out"
    sim = Simulation(compose_cfg(*layout, trace), out)
    s = sim.run().summary
    assert s["step_engine"] == "replica"
    reqs = pd.read_csv(out / "requests.csv")
    steps = pd.read_csv(out / "steps.csv")
    assert sorted(reqs["request_id"]) == [0, 1] and len(steps) == s["num_steps"]
    assert not list(out.glob("*.partial"))


@pytest.mark.parametrize("overrides, reason", [
    (["cluster.router=prefix_aware"],
     "router 'prefix_aware' reads more than outstanding request counts and KV usage"),
    (["cluster.pipeline_parallel_size=2", "policy=sglang"],
     "pipeline stages under policy 'sglang'"),
])
def test_clusters_the_core_leaves_to_the_replica_loop(overrides, reason):
    base = [] if overrides[0].startswith("cluster=") else ["cluster.num_replicas=2"]
    sim, _, s = _run("model=tiny", "workload.num_requests=20", *base, *overrides)
    assert s["step_engine"] == "replica"
    assert reason in sim.array_core_skipped


def files_on_both_loops(tmp_path: Path, layout: list[str]) -> tuple[dict, dict]:
    """Run ``layout`` on the array core and on the replica loop (``array_core=false``),
    writing files; assert that requests.csv (cluster columns included) and steps.csv (each
    replica's rows) match to 1e-9 relative and the per-replica counts are equal. The two
    summaries."""
    runs = {}
    for core in ("true", "false"):
        out = tmp_path / core
        runs[core] = Simulation(compose_cfg(*layout, f"array_core={core}"), out).run().summary
        runs[core + "_req"] = pd.read_csv(out / "requests.csv").sort_values("request_id")
        runs[core + "_steps"] = pd.read_csv(out / "steps.csv").sort_values(
            ["replica_id", "step"], kind="stable")
    assert runs["true"]["step_engine"] == "array_core"
    assert runs["false"]["step_engine"] == "replica"
    a, b = runs["true_req"].reset_index(drop=True), runs["false_req"].reset_index(drop=True)
    assert list(a.columns) == list(b.columns)
    pd.testing.assert_frame_equal(a, b, rtol=1e-9)
    a, b = runs["true_steps"].reset_index(drop=True), runs["false_steps"].reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, rtol=1e-9)
    for key in ("routed", "num_steps"):
        assert ([r[key] for r in runs["true"]["replicas"]]
                == [r[key] for r in runs["false"]["replicas"]])
    return runs["true"], runs["false"]


def test_files_of_a_cluster_on_the_core_match_the_replica_loop(tmp_path):
    """requests.csv (cluster columns included), steps.csv and summary.json, as files."""
    files_on_both_loops(tmp_path, ["model=tiny", "cluster.num_replicas=3",
                                   "cluster.router=power_of_two", "workload.num_requests=80",
                                   "workload.qps=40"])


def test_replicas_run_to_their_ends_in_time_order(tmp_path):
    """Once every request is routed the replicas still go on in time order (the one that
    plans first each time): the last row of steps.csv ends the run's last step, and no
    row starts after it ends (what the report's timeline reads)."""
    out = tmp_path / "out"
    s = Simulation(compose_cfg("model=tiny", "cluster.num_replicas=3",
                               "workload.num_requests=120", "workload.qps=200",
                               "workload.output_len.max=400"), out).run().summary
    assert s["step_engine"] == "array_core"
    steps = pd.read_csv(out / "steps.csv")
    ends = steps["time"] + steps["duration"]
    assert ends.iloc[-1] == ends.max() == pytest.approx(s["simulated_duration_s"], rel=1e-12)
    assert (steps["time"] <= ends.iloc[-1]).all()
    # Every replica's rows in its own order, and the replicas' last rows in the order
    # their last steps end.
    assert all((g["step"].diff().dropna() == 1).all() for _, g in steps.groupby("replica_id"))
    last_rows = sorted(g.index[-1] for _, g in steps.groupby("replica_id"))
    assert len(last_rows) == 3 and ends[last_rows].is_monotonic_increasing
