"""Decode jumps (step_mode=fast) must reproduce step-by-step simulation (step_mode=exact)."""

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation, SimulationResult
from policies import POLICIES
from tests.helpers import assert_approx, compose_cfg, free_queues

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

JUMPING = [n for n in POLICIES.names() if POLICIES.get(n).supports_decode_jumps]
# Options that exercise a policy's own decisions (priority classes, preemptive SJF).
EXTRA = {
    "priority": ("workload.priorities=[1,1,2]",),
    "sjf": ("policy.preemptive=true", "policy.predictor=noisy"),
    "chunked_prefill": ("policy.max_num_batched_tokens=256", "policy.max_num_seqs=64"),
    "vllm_v1": ("policy.max_num_batched_tokens=256", "policy.max_num_seqs=64",
                "workload.shared_prefix_len=50", "workload.num_prefix_groups=2"),
    # Pausing under KV pressure (guaranteed_no_evict never pauses: tests/test_trtllm.py).
    "trtllm": ("policy.capacity_scheduler_policy=max_utilization", "policy.max_num_seqs=64",
               "policy.max_num_batched_tokens=512", "policy.enable_chunked_prefill=true"),
    # Prompts chunked at 128 tokens, radix-cache hits, and new_token_ratio's admissions.
    "sglang": ("policy.chunked_prefill_size=128", "policy.max_num_seqs=64",
               "workload.shared_prefix_len=50", "workload.num_prefix_groups=2"),
}
# Policies without swap to host memory: their runs always recompute.
NO_SWAP = ("vllm_v1", "trtllm", "sglang")


# Step-by-step runs by their overrides: ``array_core`` only chooses the fast engine, so the
# fast runs of both engines (the ``core`` parameter below) meet one reference run.
_EXACT: dict[tuple[str, ...], tuple[SimulationResult, pd.DataFrame, pd.DataFrame]] = {}


def _run(mode: str, overrides: list[str]):
    key = tuple(o for o in overrides if not o.startswith("array_core="))
    if mode == "exact" and key in _EXACT:
        return _EXACT.pop(key)
    res = Simulation(compose_cfg(f"step_mode={mode}", *overrides)).run()
    reqs = pd.DataFrame(res.requests_sink.rows, columns=res.requests_sink.columns)
    steps = pd.DataFrame(res.steps_sink.rows, columns=res.steps_sink.columns)
    out = res, reqs.sort_values("request_id").reset_index(drop=True), steps
    if mode == "exact" and len(overrides) > len(key):  # a pair's first run: kept for the second
        _EXACT[key] = out
        while len(_EXACT) > 16:  # runs whose pair never comes (a single test selected)
            del _EXACT[next(iter(_EXACT))]
    return out


def _assert_same(overrides: list[str]) -> dict:
    """The fast run's summary, once it has the exact run's schedule and block ids."""
    return _same_runs(overrides)[0].summary


def _same_runs(overrides: list[str]) -> tuple[SimulationResult, SimulationResult]:
    """The fast and the exact run, once they have the same schedule and block ids."""
    fast_res, rf, sf = _run("fast", overrides)
    exact_res, re_, se = _run("exact", overrides)
    fast, exact = fast_res.summary, exact_res.summary
    # The same schedule: every step's shape and timing, and every request's timestamps.
    cols = ["batch_size", "prefill_tokens", "decode_tokens", "sampled", "num_waiting",
            "num_running", "num_swapped", "kv_blocks_used", "recomputed", "swapped_out",
            "swap_out_blocks", "swap_in_blocks"]
    assert len(sf) == len(se)
    assert (sf[cols].to_numpy() == se[cols].to_numpy()).all()
    for c in ("time", "duration"):
        a, b = sf[c].astype(float).to_numpy(), se[c].astype(float).to_numpy()
        assert_approx(a, b, rel=1e-9, abs=1e-12)
    for c in ("first_scheduled_time", "first_token_time", "finish_time", "ttft", "tpot",
              "e2e_latency"):
        a = pd.to_numeric(rf[c]).to_numpy(dtype=float)
        b = pd.to_numeric(re_[c]).to_numpy(dtype=float)
        assert_approx(a, b, rel=1e-9, abs=1e-12, nan_ok=True, what=c)
    same = ["request_id", "status", "output_len", "num_preemptions", "num_swaps", "num_recomputes",
            "num_cached_tokens"]
    assert rf[same].equals(re_[same])
    for key in ("p99_itl_ms", "mean_tpot_ms", "num_preemptions", "kv_peak_usage", "num_swaps",
                "num_recomputes", "num_swap_fallbacks", "prefix_cache_queries",
                "prefix_cache_hits", "kv_evictions"):
        assert fast[key] == pytest.approx(exact[key], rel=1e-9), key
    # requests.csv in the same order (a step's finishers in its row order).
    assert ([r[0] for r in fast_res.requests_sink.rows]
            == [r[0] for r in exact_res.requests_sink.rows])
    # The same block ids handed out in the same order (tests/test_cluster_fast_exact.py).
    free = free_queues(fast_res)
    if free is not None:  # None on the array core (no block ids)
        assert free == free_queues(exact_res)
    return fast_res, exact_res


@pytest.mark.parametrize("policy", JUMPING)
@pytest.mark.parametrize("core", ["true", "false"])  # the array core where it applies, or not
def test_default_workload_fast_equals_exact(policy, core):
    s = _assert_same([f"policy={policy}", "workload.num_requests=300", "workload.qps=8",
                      f"array_core={core}", *EXTRA.get(policy, ())])
    assert s["num_decode_jumps"] > 0


@pytest.mark.parametrize("policy", JUMPING)
@pytest.mark.parametrize("core", ["true", "false"])  # the array core where it applies, or not
def test_preemption_heavy_case_fast_equals_exact(policy, core):
    s = _assert_same([f"policy={policy}", "model=tiny", "kv.num_gpu_blocks_override=30",
                      f"array_core={core}",
                      "workload.qps=30", "workload.num_requests=60",
                      "workload.prompt_len.max=200", "workload.output_len.max=150",
                      *EXTRA.get(policy, ())])
    # Static batching reserves KV up front and never preempts.
    assert (s["num_preemptions"] > 0) == (policy != "static") and s["num_decode_jumps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", JUMPING)
@settings(max_examples=9, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), blocks=st.integers(40, 400), qps=st.floats(1.0, 60.0),
       swap=st.booleans())
def test_random_small_workloads_under_kv_pressure(policy, seed, blocks, qps, swap):
    # The replica loop's decode jumps (the array core's pools that bind:
    # tests/test_array_core.py).
    _assert_same([
        f"policy={policy}", "model=tiny", f"seed={seed}", f"kv.num_gpu_blocks_override={blocks}",
        "array_core=false",
        "kv.num_cpu_blocks=64", f"workload.qps={qps}", "workload.num_requests=40",
        "workload.prompt_len.max=200", "workload.output_len.max=120",
        f"policy.preemption_mode={'swap' if swap and policy not in NO_SWAP else 'recompute'}",
        *EXTRA.get(policy, ()),
    ])


@pytest.mark.parametrize("policy,load", [
    ("fcfs", ("workload.qps=3", "workload.num_requests=60", "kv.num_gpu_blocks_override=120")),
    ("chunked_prefill", ("workload.qps=3", "workload.num_requests=60",
                         "kv.num_gpu_blocks_override=120")),
    # One batch of all requests at once: nothing waits while its members finish.
    ("static", ("workload.qps=1000", "workload.num_requests=12", "kv.num_gpu_blocks_override=2000")),
    # Runs kept in the policy's own order (Policy.decode_run_key); noisy predictions reorder
    # SJF's as they are used up.
    ("sjf", ("workload.qps=3", "workload.num_requests=60", "kv.num_gpu_blocks_override=120",
             "policy.predictor=noisy")),
    ("sjf", ("workload.qps=1000", "workload.num_requests=12", "kv.num_gpu_blocks_override=2000",
             "policy.predictor=noisy")),
    ("priority", ("workload.qps=3", "workload.num_requests=60", "kv.num_gpu_blocks_override=120",
                  "workload.priorities=[2,1,1,0]")),
])
def test_jumps_past_finishes_equal_exact_with_the_same_blocks(policy, load):
    """Nothing waits, so decode jumps run past finishes (members leave at the end of their
    last step); the schedule, timestamps, free block queue and peak KV use are exact. (The
    replica loop's jumps: a pool that cannot bind would take the array core.)"""
    overrides = [f"policy={policy}", "model=tiny", "workload.output_len.max=120",
                 "array_core=false", *load]
    fast, exact = _same_runs(overrides)  # the free block queues too
    assert fast.replicas[0].num_jump_stops > 0
    assert fast.summary["kv_peak_usage"] == exact.summary["kv_peak_usage"]


@pytest.mark.parametrize("load", [
    ("workload.qps=3", "workload.num_requests=60", "kv.num_gpu_blocks_override=120"),
    # All at once: long jumps whose later stretches need new blocks after the stops.
    ("workload.qps=1000", "workload.num_requests=12", "kv.num_gpu_blocks_override=2000"),
])
def test_state_seen_at_a_jump_stop_is_step_by_step(monkeypatch, load):
    """When members finish inside a jump past finishes, what the replica shows at that moment
    (KV blocks in use, who runs, their counters) is what step-by-step simulation shows: a
    jump's later blocks and steps are not taken ahead of its stops."""
    from sim.replica import Replica

    def observe(mode: str) -> tuple[dict, int]:
        seen: dict[float, tuple] = {}
        finish = Replica._finish

        def spy(self, req, now):
            finish(self, req, now)
            running = {r.request_id: r.num_output_tokens for r in self.queues.running}
            # After the last finish at a time (members finishing together may go in another
            # order; times agree to rounding).
            seen[round(now, 9)] = (self.kv.num_used_blocks, running)

        monkeypatch.setattr(Replica, "_finish", spy)
        # The replica loop's jump stops (the array core has no Replica to watch).
        res = Simulation(compose_cfg(f"step_mode={mode}", "policy=fcfs", "model=tiny",
                                     "array_core=false", "workload.output_len.max=120",
                                     *load)).run()
        monkeypatch.setattr(Replica, "_finish", finish)
        return seen, res.replicas[0].num_jump_stops

    fast, stops = observe("fast")
    exact, _ = observe("exact")
    assert stops > 0 and fast.keys() == exact.keys()
    for t, (used, running) in fast.items():
        used_exact, running_exact = exact[t]
        assert used == used_exact, t
        assert running.keys() == running_exact.keys(), t
        # Exact mode applies a step's rows in order, so rows after the last one finishing
        # have not counted this step's token yet when it finishes; nothing is further ahead.
        for rid, n in running.items():
            assert n - running_exact[rid] in (0, 1), (t, rid)


@pytest.mark.parametrize("seed,qps,aging", [(0, 20, 0.3), (1, 60, 1.0), (4, 20, 0.3)])
@pytest.mark.parametrize("preemptive", [False, True])
def test_sjf_aging_deadlines_stop_jumps(seed, qps, aging, preemptive):
    """SJF's aging puts a waiting request first once it has waited ``aging_s``: a deadline of
    the policy's own (``Policy.next_decision_time``) that no arrival or finish marks. Jumps
    must stop at it, or fast mode admits the aged request later than step-by-step (these
    cases took 1 to 11 steps more or fewer before they did)."""
    s = _assert_same(["policy=sjf", "model=tiny", f"seed={seed}", "kv.num_gpu_blocks_override=60",
                      f"workload.qps={qps}", "workload.num_requests=80",
                      "workload.prompt_len.max=400", "workload.output_len.max=300",
                      f"policy.aging_s={aging}", "policy.max_num_seqs=8",
                      f"policy.preemptive={str(preemptive).lower()}"])
    assert s["num_decode_jumps"] > 0


def _assert_same_blocks_and_finish_order(overrides: list[str]) -> None:
    """``_assert_same`` (the same free block queue too), and the same ``requests.csv`` row
    order."""
    fast, exact = _same_runs(overrides)
    assert fast.summary["num_decode_jumps"] > 0
    assert ([r[0] for r in fast.requests_sink.rows]
            == [r[0] for r in exact.requests_sink.rows])


def _sjf_running(specs, predictor="noisy"):
    """SJF's policy and running requests (id, arrival, predicted total, generated)."""
    from policies.base import make_policy
    from sim.request import Request

    reqs = []
    for rid, arrival, predicted, generated in specs:
        r = Request(rid, arrival, 4, 500)
        r.extra = {"predicted_output_len": predicted}
        r.num_output_tokens = generated
        reqs.append(r)
    policy = make_policy({"name": "sjf", "predictor": predictor})
    return policy, sorted(reqs, key=policy.running_key)


@pytest.mark.parametrize("specs,limit,expected", [
    # Remaining predictions 5 and 9 (unclamped for 4 and 8 more steps): the order holds.
    ([(0, 0.0, 15, 10), (1, 1.0, 9, 0)], 50, 50),
    # 1 arrived later but predicts less: first until 0's key is clamped too, in step 3
    # (0: 13 - (10 + 2) = 1), where arrival order puts 0 first: two steps keep the order.
    ([(0, 0.0, 13, 10), (1, 1.0, 7, 6)], 50, 2),
    ([(0, 0.0, 13, 10), (1, 1.0, 7, 6)], 2, 2),
    # Fractional predictions: 0's keys are 3.5, 2.5, 1.5, then clamped from step 4.
    ([(0, 0.0, 3.5, 0), (1, 1.0, 1.0, 0)], 50, 3),
    # Both clamped from the start (predictions used up): arrival order, for good.
    ([(0, 0.0, 2, 5), (1, 1.0, 3, 9)], 50, 50),
    # Clamped together but already in arrival order: nothing changes.
    ([(0, 0.0, 4, 0), (1, 1.0, 6, 1)], 50, 50),
    # A third request changes place only when the latest-arriving short one is caught up.
    ([(0, 0.0, 40, 0), (1, 1.0, 12, 0), (2, 2.0, 3, 0)], 100, 11),
])
def test_sjf_decode_order_steps(specs, limit, expected):
    """SJF's running order changes while it decodes when a prediction is used up (its key
    is clamped at 1 and it then goes by arrival among the clamped ones); a decode jump must
    end before the first step whose order differs (``Policy.decode_order_steps``)."""
    policy, running = _sjf_running(specs)
    assert policy.decode_order_steps(running, limit) == expected
    same = [_sjf_order(policy, running, j) == _sjf_order(policy, running, 1)
            for j in range(1, limit + 1)]
    assert same == [True] * expected + [False] * (limit - expected)


def _sjf_order(policy, running, j, present=None):
    """The order SJF gives ``running`` in decode step j (brute force from its own keys)."""
    for r in running:
        r.num_output_tokens += j - 1
    out = [r.request_id for r in sorted(running, key=policy.running_key)
           if present is None or r.request_id in present]
    for r in running:
        r.num_output_tokens -= j - 1
    return out


def test_sjf_decode_order_steps_counts_only_requests_still_running():
    """1 arrived later but is first (2 to go against 3); it leaves after step 2, so 0 is
    alone when its own prediction is used up in step 3: the order never changes."""
    policy, running = _sjf_running([(0, 0.0, 3, 0), (1, 1.0, 2, 0)])
    assert [r.request_id for r in running] == [1, 0]
    assert policy.decode_order_steps(running, 50) == 2  # if both stayed
    assert policy.decode_order_steps(running, 50, [2, 3]) == 50  # 1's last step is 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(1.0, 30.0), st.integers(0, 20),
                          st.integers(1, 40)), min_size=2, max_size=7),
       st.integers(2, 40), st.booleans())
def test_sjf_decode_order_steps_matches_brute_force(specs, limit, oracle):
    """Random predictions, progress and last steps: the steps returned are exactly those in
    which the requests still running go in step 1's order. With the oracle predictor (the
    prediction is the true length, each request's last step) the order never changes."""
    rows = [(i, float(a), float(out + left) if oracle else pred, out)
            for i, (a, pred, out, left) in enumerate(specs)]
    policy, running = _sjf_running(rows, "oracle" if oracle else "noisy")
    by_id = {i: left for i, (_, _, _, left) in enumerate(specs)}
    last = [by_id[r.request_id] for r in running] if oracle else [
        by_id[r.request_id] % 25 + 1 for r in running]
    got = policy.decode_order_steps(running, limit, last)
    expected = limit
    for j in range(2, limit + 1):
        present = {r.request_id for r, lj in zip(running, last) if lj >= j}
        if _sjf_order(policy, running, j, present) != [
                i for i in _sjf_order(policy, running, 1) if i in present]:
            expected = j - 1
            break
    assert got == expected


@pytest.mark.parametrize("seed,blocks,qps,mode", [
    (4243, 188, 41.43, "swap"), (6176, 47, 13.629, "recompute")])
def test_sjf_noisy_predictions_same_blocks_and_finish_order(seed, blocks, qps, mode):
    """With noisy predictions SJF's running order changes as predictions are used up; jumps
    end there, so fast mode hands out the same block ids and finishes requests in the same
    order as step by step (these two cases differed before)."""
    overrides = ["policy=sjf", "policy.predictor=noisy", "model=tiny", f"seed={seed}",
                 f"kv.num_gpu_blocks_override={blocks}", "kv.num_cpu_blocks=64", f"workload.qps={qps}",
                 "workload.num_requests=40", "workload.prompt_len.max=200",
                 "workload.output_len.max=120", f"policy.preemption_mode={mode}"]
    _assert_same_blocks_and_finish_order(overrides)


@pytest.mark.parametrize("extra", [
    ("policy=sjf",), ("policy=sjf", "policy.preemptive=true"),
    ("policy=priority", "workload.priorities=[0,1,2]"),
    ("policy=priority", "workload.priorities=[0,1,2]", "policy.preemption_mode=swap"),
])
@pytest.mark.parametrize("seed,blocks,qps", [(0, 40, 40.0), (1, 400, 12.0)])
def test_orders_the_run_keeps_fast_equals_exact(extra, seed, blocks, qps):
    """SJF with the oracle and priority never reorder while decoding, so they take their
    running order from the decode run instead of sorting it (``order_fixed_while_decoding``)
    and walk preemption victims only while ``may_preempt`` allows: the same schedule, block
    ids and finish order as step by step, under KV pressure and preemption."""
    overrides = [*extra, "model=tiny", f"seed={seed}", f"kv.num_gpu_blocks_override={blocks}",
                 "kv.num_cpu_blocks=64", f"workload.qps={qps}", "workload.num_requests=60",
                 "workload.prompt_len.max=200", "workload.output_len.max=120",
                 "policy.max_num_seqs=16"]
    _assert_same_blocks_and_finish_order(overrides)
