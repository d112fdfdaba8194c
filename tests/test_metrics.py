"""Latency summaries: exact percentiles and the bounded streaming histogram."""

import numpy as np
import pytest

from sim.metrics import StreamingQuantiles, latency_stats
from sim.simulation import run_simulation
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
