"""Error bars: the step-time factor, the measured intervals behind it, and the headline
figures' intervals in summary.json."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.calibration import ShapeSpec, calibrate, predict, save_profile
from executors.cost_model import CostModelConfig, RooflineCostModel
from executors.step_terms import Coefficients, StepDecomposer
from executors.uncertainty import ratio_interval
from experiments.intervals import (
    HEADLINE,
    ErrorBarsConfig,
    step_time_interval,
    with_intervals,
)
from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.report import format_summary, intervals_figure
from sim.specs import load_hardware_spec, load_model_spec
from tests.helpers import ROOT, small_cfg

TRUE = Coefficients(s_per_step=8e-5, s_per_seq=1.2e-4, s_per_flop=9e-12,
                    s_per_weight_byte=7e-10, s_per_attn_flop=3.4e-11, s_per_diag_flop=3.6e-11,
                    s_per_kv_byte=6.6e-10, s_per_attn_kernel=1.3e-5, sharpness=1.0)


# ---- the step-time factor ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_step_time_factor_scales_every_priced_term(kind):
    """At TP 1 (no communication) and without swaps a step's whole time is priced, so a
    factor multiplies it, on every pricing path (one step, a decode run's arrays)."""
    model, hw = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    base = RooflineCostModel(model, hw)
    slow = RooflineCostModel(model, hw, config=CostModelConfig(step_time_factor=1.25))
    spec = {"decode": ShapeSpec("decode", num_decode_seqs=37, decode_context=900),
            "prefill": ShapeSpec("prefill", 2, 700),
            "mixed": ShapeSpec("mixed", 1, 300, 100, 7, 900)}[kind]
    plan = spec.plan()
    assert slow.execute(plan).duration == pytest.approx(1.25 * base.execute(plan).duration,
                                                        rel=1e-12)
    if kind == "decode":
        run = slow.decode_run_durations(37, 900 * 37, 900, 50)
        assert np.allclose(run, 1.25 * base.decode_run_durations(37, 900 * 37, 900, 50),
                           rtol=1e-12)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_step_time_factor_must_be_finite_and_positive(bad):
    with pytest.raises(ConfigError, match="executor.step_time_factor"):
        CostModelConfig(step_time_factor=bad)


# ---- the measured interval --------------------------------------------------------------------
def test_ratio_interval_is_the_central_quantiles():
    r = np.arange(1, 102) / 100.0  # 0.01 .. 1.01, evenly
    lo, hi = ratio_interval(r, 0.9)
    assert lo == pytest.approx(0.06, abs=0.006) and hi == pytest.approx(0.96, abs=0.006)
    # Weights: a ratio weighted 99 times outweighs the rest.
    w = np.ones(101)
    w[50] = 1000.0
    assert ratio_interval(r, 0.9, w) == pytest.approx((0.51, 0.51), abs=0.02)
    for bad in ([], [1.0, -1.0], [1.0, math.inf]):
        with pytest.raises(ValueError):
            ratio_interval(np.array(bad))


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=50),
       st.floats(0.05, 0.99))
@settings(max_examples=60, deadline=None)
def test_ratio_interval_lies_within_the_ratios_and_widens_with_level(ratios, level):
    r = np.array(ratios)
    lo, hi = ratio_interval(r, level)
    assert r.min() <= lo <= hi <= r.max()
    lo2, hi2 = ratio_interval(r, min(0.995, level + 0.004))
    assert lo2 <= lo + 1e-12 and hi2 >= hi - 1e-12


def _profile_rows(noise: float, seed: int = 0, sparse: bool = False,
                  ) -> tuple[list[dict], object]:
    """Profile rows of the tiny model priced by ``TRUE``, each time off by a lognormal factor
    of spread ``noise``: a dense grid of shapes, or a sparse one (``sparse``)."""
    model = load_model_spec("tiny")
    dec = StepDecomposer(model, attention_tile=1)
    if sparse:
        specs = [ShapeSpec("decode", num_decode_seqs=b, decode_context=c)
                 for b in (1, 2, 4, 8, 16, 32) for c in (16, 128, 512)]
        specs += [ShapeSpec("prefill", n, chunk, cached) for n in (1, 2)
                  for chunk in (8, 64, 256) for cached in (0, 128)]
    else:
        specs = [ShapeSpec("decode", num_decode_seqs=b, decode_context=c)
                 for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) for c in (16, 64, 128, 256, 512)]
        specs += [ShapeSpec("prefill", n, chunk, cached) for n in (1, 2, 3)
                  for chunk in (8, 32, 64, 128, 256) for cached in (0, 64, 128)]
    rng = np.random.default_rng(seed)
    rows = [{**sp.as_row(), "median_s": float(predict(TRUE, [dec.drivers(sp.shape())])[0]
                                              * math.exp(noise * rng.standard_normal()))}
            for sp in specs]
    return rows, model


@pytest.mark.slow
def test_calibrated_profile_carries_its_held_out_interval():
    """Rows off by a lognormal factor of spread 5% on a dense grid of shapes: the profile's
    90% interval is about the noise's own (exp(+-1.645 x 0.05) = 0.92 .. 1.09); exact rows
    give an interval at 1; a sparse grid, whose fit misprices the shapes it did not see by
    up to half, gets a wide one."""
    rows, model = _profile_rows(0.05)
    iv = calibrate(rows, model, attention_tile=1, sharpness=1.0).fit["step_time_interval"]
    assert iv["level"] == 0.9 and iv["bootstrap_fits"] >= 8 and iv["heldout"] == 47
    assert 0.87 < iv["lo"] < 0.96
    assert 1.04 < iv["hi"] < 1.14
    rows, model = _profile_rows(0.0)
    iv = calibrate(rows, model, attention_tile=1, sharpness=1.0).fit["step_time_interval"]
    assert 0.999 < iv["lo"] <= iv["hi"] < 1.001
    rows, model = _profile_rows(0.05, seed=1, sparse=True)
    iv = calibrate(rows, model, attention_tile=1, sharpness=1.0).fit["step_time_interval"]
    assert iv["hi"] - iv["lo"] > 0.4


# ---- where a run's interval comes from --------------------------------------------------------
def test_the_interval_comes_from_config_profile_or_roofline(tmp_path):
    cfg = small_cfg()
    bars = ErrorBarsConfig.from_dict(cfg["error_bars"])
    assert step_time_interval(cfg, bars) == (0.859, 1.271, "roofline")
    given_bars = ErrorBarsConfig.from_dict({**cfg["error_bars"], "step_time": [0.9, 1.2]})
    assert step_time_interval(cfg, given_bars) == (0.9, 1.2, "error_bars.step_time")
    assert step_time_interval(cfg, ErrorBarsConfig.from_dict({"enabled": False})) is None
    assert step_time_interval({**cfg, "executor": {"name": "real"}}, bars) is None
    # A profile: its fitted interval; one saved without it is refused by name.
    rows, model = _profile_rows(0.05)
    prof = calibrate(rows, model, attention_tile=1, sharpness=1.0)
    path = save_profile(prof, tmp_path / "p.yaml")
    tiny = small_cfg("model=tiny", f"executor.profile={path}")
    lo, hi, source = step_time_interval(tiny, bars)
    assert (lo, hi) == (prof.fit["step_time_interval"]["lo"], prof.fit["step_time_interval"]["hi"])
    assert source == str(path)
    del prof.fit["step_time_interval"]
    save_profile(prof, path)
    with pytest.raises(ConfigError, match="executor.profile.*step_time_interval"):
        step_time_interval(tiny, bars)


@pytest.mark.parametrize(("section", "field"), [
    ("bad", "error_bars"),
    ({"enabled": "yes"}, "error_bars.enabled"),
    ({"step_time": [1.2, 0.9]}, "error_bars.step_time"),
    ({"step_time": [0.0, 1.0]}, "error_bars.step_time"),
    ({"step_time": 1.1}, "error_bars.step_time"),
    ({"roofline_step_time": [0.9, math.inf]}, "error_bars.roofline_step_time"),
    ({"level": 0.95}, "error_bars.level"),
])
def test_bad_error_bars_config_names_the_field(section, field):
    with pytest.raises(ConfigError) as e:
        ErrorBarsConfig.from_dict(section)
    assert e.value.field == field


# ---- the figures' intervals -------------------------------------------------------------------
def test_every_headline_figure_gets_an_interval_that_holds_it():
    cfg = small_cfg("workload.num_requests=150", "workload.qps=12")
    summary = Simulation(cfg, None).run().summary
    out = with_intervals(cfg, summary)
    keys = list(out)
    for key in HEADLINE:
        if summary.get(key) is None:
            continue
        lo, hi = out[f"{key}_lo"], out[f"{key}_hi"]
        assert lo <= summary[key] <= hi, key
        # Beside their figure, in that order.
        assert keys.index(f"{key}_lo") == keys.index(key) + 1
        assert keys.index(f"{key}_hi") == keys.index(key) + 2
    # Slower steps: longer latencies; a run that is not saturated keeps its throughput's
    # interval narrow.
    assert out["p90_ttft_ms_hi"] > summary["p90_ttft_ms"] > out["p90_ttft_ms_lo"]
    assert out["mean_tpot_ms_hi"] > summary["mean_tpot_ms"] > out["mean_tpot_ms_lo"]
    assert (out["error_bars_step_time_lo"], out["error_bars_step_time_hi"]) == (0.859, 1.271)
    assert out["error_bars_source"] == "roofline"
    assert "90% intervals (step time x0.859..x1.271, roofline)" in format_summary(out)
    assert "90% intervals" not in format_summary(summary)
    fig = intervals_figure(out)
    assert fig.data[0].x == ("mean", "median", "p90", "p99")
    assert fig.data[0].error_y.array[2] == pytest.approx(out["p90_ttft_ms_hi"]
                                                         - out["p90_ttft_ms"])
    assert intervals_figure(summary) is None
    # The other figures stay as they were.
    assert {k: v for k, v in out.items() if k in summary} == summary
    # Off: nothing added.
    assert with_intervals({**cfg, "error_bars": {"enabled": False}}, summary) is summary


@pytest.mark.slow
def test_the_command_writes_intervals_and_refuses_a_bad_section(tmp_path):
    out = tmp_path / "run"
    ok = subprocess.run(
        [sys.executable, "-m", "experiments.run", "workload.num_requests=40",
         "workload.qps=10", "progress=false", f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["p90_ttft_ms_lo"] <= summary["p90_ttft_ms"] <= summary["p90_ttft_ms_hi"]
    assert "90% intervals" in ok.stdout + ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "experiments.run", "workload.num_requests=5",
         "error_bars.step_time=[1.3,0.8]", f"hydra.run.dir={tmp_path / 'bad'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("config error: error_bars.step_time:")
    assert "Traceback" not in bad.stderr
