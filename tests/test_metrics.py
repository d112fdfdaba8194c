"""Latency summaries: exact percentiles and the bounded streaming histogram."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.metrics as metrics_module
from experiments.simulation import run_simulation
from sim.metrics import MetricsCollector, StreamingQuantiles, latency_stats
from sim.request import Request
from tests.helpers import small_cfg


def test_streaming_quantiles_are_within_relative_accuracy():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.lognormal(-4, 1.0, 300_000), rng.uniform(0.2, 0.3, 1000)])
    sq = StreamingQuantiles(relative_accuracy=1e-3, flush_every=50_000)
    for chunk in np.array_split(values, 37):
        sq.extend(chunk)
    got, exact = sq.stats("itl"), latency_stats("itl", values)
    assert len(sq) == len(values)
    assert got["mean_itl_ms"] == pytest.approx(exact["mean_itl_ms"], rel=1e-9)
    assert got["std_itl_ms"] == pytest.approx(exact["std_itl_ms"], rel=1e-6)
    for k in ("median", "p90", "p99"):
        assert got[f"{k}_itl_ms"] == pytest.approx(exact[f"{k}_itl_ms"], rel=1.1e-3), k


def test_streaming_itl_summary_matches_exact_run():
    res = run_simulation(small_cfg())
    exact, gaps = res.summary, np.frombuffer(res.metrics.itl, dtype=np.float64) * 1000
    stream = run_simulation(small_cfg("itl_quantiles=streaming", "record_steps=false")).summary
    assert stream["mean_itl_ms"] == pytest.approx(exact["mean_itl_ms"], rel=1e-9)
    for k, q in (("median", 50), ("p90", 90), ("p99", 99)):
        # Within 0.1% of a sample next to the exact percentile (which interpolates).
        lo, hi = np.percentile(gaps, q, method="lower"), np.percentile(gaps, q, method="higher")
        assert lo * (1 - 2e-3) <= stream[f"{k}_itl_ms"] <= hi * (1 + 2e-3), k
    assert stream["median_ttft_ms"] == exact["median_ttft_ms"]
    assert stream["num_steps"] == exact["num_steps"]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30),
       flush_every=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_extend_groups_bins_exactly_like_one_extend_per_group(sizes, flush_every, seed):
    values = np.random.default_rng(seed).lognormal(-4, 1.0, sum(sizes))
    ends = np.cumsum(sizes)
    one, bulk = (StreamingQuantiles(flush_every=flush_every) for _ in range(2))
    one.extend(values[:3])  # a partly filled buffer to start from
    bulk.extend(values[:3])
    for group in np.split(values, ends[:-1]):
        one.extend(group)
    bulk.extend_groups(values, ends)
    # The same batches: the same float sums, bit for bit.
    assert (one.count, one._sum, one._dev_sum, one._dev_sumsq) == (
        bulk.count, bulk._sum, bulk._dev_sum, bulk._dev_sumsq)
    assert np.array_equal(one._counts, bulk._counts)
    assert one._buffer == bulk._buffer
    assert one.stats("itl") == bulk.stats("itl")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), flush_a=st.integers(1, 5000), flush_b=st.integers(1, 5000),
       seed=st.integers(0, 2**16))
def test_histogram_does_not_depend_on_the_batch_size(n, flush_a, flush_b, seed):
    # The binning batch size is a speed knob (cache-sized batches): bins, count and
    # percentiles are the same for any, mean and std the same but for the sums' rounding.
    # Values straddle the histogram's range (below min_value, above max_value) too.
    rng = np.random.default_rng(seed)
    values = np.concatenate([rng.lognormal(-4, 2.0, n), [0.0, 1e-12, 2e5][:n % 4]])
    a, b = StreamingQuantiles(flush_every=flush_a), StreamingQuantiles(flush_every=flush_b)
    for chunk in np.array_split(values, 1 + n % 7):
        a.extend(chunk)
        b.extend(chunk)
    sa, sb = a.stats("itl"), b.stats("itl")
    assert np.array_equal(a._counts, b._counts) and a.count == b.count == len(values)
    for k in ("median", "p90", "p99"):
        assert sa[f"{k}_itl_ms"] == sb[f"{k}_itl_ms"], k
    assert sa["mean_itl_ms"] == pytest.approx(sb["mean_itl_ms"], rel=1e-12)
    assert sa["std_itl_ms"] == pytest.approx(sb["std_itl_ms"], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("itl", ["exact", "streaming"])
def test_itl_gaps_are_each_requests_own_diff_in_finishing_order(monkeypatch, itl):
    # Small batches so that the gaps are taken in several passes, one boundary on a batch end.
    monkeypatch.setattr(metrics_module, "_ITL_BATCH", 7)
    rng = np.random.default_rng(3)
    m, expected = MetricsCollector(itl), []
    for i, n in enumerate([1, 5, 2, 1, 9, 3, 7, 1, 4, 12, 2]):
        req = Request(i, float(i), 4, n)
        for t in np.cumsum(rng.uniform(0.01, 0.05, n)) + i:
            req.record_token(float(t))
        req.finish_time = req.last_token_time
        m.on_finished(req)
        expected.append(np.diff(np.frombuffer(req.token_times, dtype=np.float64)))
    gaps = np.concatenate(expected)
    if itl == "exact":
        assert np.frombuffer(m.itl, dtype=np.float64).tobytes() == gaps.tobytes()
    else:
        ref = StreamingQuantiles()
        for g in expected:
            if len(g):
                ref.extend(g)
        assert m.summary()["mean_itl_ms"] == ref.stats("itl")["mean_itl_ms"]
        assert len(m.itl) == len(gaps)
    assert m.summary()["completed"] == 11


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=300))
def test_latency_stats_percentiles_are_numpys_one_by_one(values):
    arr = np.array(values)
    got = latency_stats("x", arr)
    for key, q in (("median", 50), ("p90", 90), ("p99", 99)):
        assert got[f"{key}_x_ms"] == float(np.percentile(arr * 1000.0, q)), key


def test_streaming_std_of_steady_gaps_is_accurate():
    """Token gaps of a steady decode batch barely vary (43 ms, spread 1e-7 of it): the
    streaming std must not cancel away (a one-pass sum of squares lost 8 digits there),
    across several flushes."""
    rng = np.random.default_rng(3)
    v = 0.043 + 4.3e-9 * rng.standard_normal(300_000)
    sq = StreamingQuantiles(flush_every=70_000)
    sq.extend(v)
    got = sq.stats("itl")
    assert got["std_itl_ms"] == pytest.approx(float(v.std()) * 1000, rel=1e-9)
    assert got["mean_itl_ms"] == pytest.approx(float(v.mean()) * 1000, rel=1e-12)


def test_goodput_counts_requests_within_every_slo_given():
    """benchmark_serving's --goodput: TTFT, TPOT and E2E each within its SLO (ms); a single
    token has no TPOT to miss."""
    from array import array

    m = MetricsCollector(slos={"ttft_ms": 100, "tpot_ms": 20})
    m.first_arrival = 0.0
    m.add_finished(10, 0.0, 0.05, 0.25, array("d", [0.1, 0.15, 0.25]))  # TPOT 66 ms: missed
    m.add_finished(10, 1.0, 1.2, 1.2, array("d"))  # TTFT 200 ms: missed
    m.add_finished(10, 2.0, 2.09, 2.12, array("d", [2.11, 2.12]))  # both met
    m.add_finished(10, 3.0, 3.01, 4.0, array("d"))  # one token: met (no E2E SLO)
    s = m.summary()
    assert s["duration"] == pytest.approx(4.0)
    assert s["request_goodput"] == pytest.approx(2 / 4.0)
    assert MetricsCollector().summary()["request_goodput"] is None


def test_summary_states_the_offered_load_and_goodput(tmp_path):
    from experiments.simulation import Simulation
    from tests.helpers import compose_cfg

    s = Simulation(compose_cfg("model=tiny", "workload.num_requests=50", "workload.arrival=gamma",
                               "workload.cv=2", "goodput={ttft_ms: 1000000}")).run().summary
    assert (s["request_rate"], s["burstiness"], s["max_concurrency"]) == (5.0, 0.25, None)
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])


def test_goodput_is_the_same_on_the_array_core_and_the_replica_loop():
    from experiments.simulation import Simulation
    from tests.helpers import compose_cfg

    base = ["model=tiny", "workload.num_requests=300", "workload.prompt_len.max=1000",
            "workload.output_len.max=500", "goodput={ttft_ms: 0.45, tpot_ms: 0.37}"]
    core = Simulation(compose_cfg(*base)).run().summary
    loop = Simulation(compose_cfg(*base, "array_core=false")).run().summary
    assert (core["step_engine"], loop["step_engine"]) == ("array_core", "replica")
    assert 0 < core["request_goodput"] == loop["request_goodput"] < core["request_throughput"]
