"""Validation: recording and replaying steps, the error table, and the whole loop (profile the
real executor on a small grid, fit, simulate, replay, compare) on the tiny model on CPU."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from executors.recording import RecordingExecutor, replay
from experiments.validate import error_table, replay_summary, validate
from sim.errors import ConfigError
from sim.simulation import Simulation
from tests.helpers import CONF, compose_cfg

LOOP_WORKLOAD = ("model=tiny", "workload.num_requests=60", "workload.qps=40",
                 "workload.prompt_len.median=120", "workload.prompt_len.max=512",
                 "workload.output_len.median=20", "workload.output_len.max=100",
                 "policy.max_num_batched_tokens=1024", "kv.num_gpu_blocks=96")


def _recorded_run(*overrides: str):
    sim = Simulation(compose_cfg("step_mode=exact", *LOOP_WORKLOAD, *overrides),
                     keep_requests=True)
    rec = RecordingExecutor(sim.executor)
    sim.replace_executor(rec)
    return sim, rec, sim.run()


def test_replay_with_the_recording_executor_reproduces_the_run():
    """Replaying recorded steps through the executor that ran them gives back every step's
    duration and the run's latencies exactly: the replayed timeline only differs from a run
    through the prices of its steps."""
    sim, rec, res = _recorded_run()
    assert len(rec.steps) == res.summary["num_steps"] > 0
    arrivals = {r.request_id: r.arrival_time for r in res.requests}
    done = {r.request_id for r in res.requests if r.status.name == "FINISHED"}
    assert len(done) == 60
    rep = replay(rec.steps, rec.inner, arrivals)
    np.testing.assert_array_equal(rep.predicted, rep.measured)
    assert rep.step_mape() == 0.0 and rep.busy_error() == 0.0
    for r in res.requests:
        assert rep.token_times[r.request_id] == pytest.approx(list(r.token_times), abs=1e-12)
    got = replay_summary(rep, {k: arrivals[k] for k in done}, done)
    for key in ("median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "p90_e2el_ms",
                "request_throughput", "output_throughput"):
        assert got[key] == pytest.approx(res.summary[key], rel=1e-9), key


def test_replay_of_a_preempting_run_keeps_tokens_and_arrivals():
    """Recompute preemption re-prefills: tokens already emitted keep their steps."""
    sim, rec, res = _recorded_run("kv.num_gpu_blocks=24", "workload.qps=200")
    assert res.summary["num_preemptions"] > 0
    arrivals = {r.request_id: r.arrival_time for r in res.requests}
    rep = replay(rec.steps, rec.inner, arrivals)
    for r in res.requests:
        assert rep.token_times[r.request_id] == pytest.approx(list(r.token_times), abs=1e-12)


def test_replay_needs_a_cost_model():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="Opaque cannot price"):
        replay([], Opaque(), {})


def test_error_table_rows_and_signs():
    keys = {f"{s}_{m}_ms": 10.0 for m in ("ttft", "tpot", "itl", "e2el")
            for s in ("mean", "median", "p90", "p99")}
    real = {**keys, "request_throughput": 5.0, "output_throughput": 50.0}
    sim = {**{k: 11.0 for k in keys}, "request_throughput": 4.0, "output_throughput": 50.0}
    rows = error_table(real, sim, None)
    assert len(rows) == 4 * 4 + 2
    assert [(r["metric"], r["stat"]) for r in rows[:5]] == [
        ("TTFT", "mean"), ("TTFT", "p50"), ("TTFT", "p90"), ("TTFT", "p99"), ("TPOT", "mean")]
    assert rows[0]["sim_err_pct"] == pytest.approx(10.0)
    assert rows[-2]["sim_err_pct"] == pytest.approx(-20.0) and "replay" not in rows[0]


def _validate_cfg(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="validate", overrides=list(overrides))
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("hydra", None)
    return out


def test_validate_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="validate.bogus"):
        validate(_validate_cfg("+validate.bogus=1"), tmp_path)
    with pytest.raises(ConfigError, match="executor: validate runs the real executor"):
        validate(_validate_cfg("executor=cost_model"), tmp_path)


# A grid covering the loop workload's steps, small enough for CI (~10 s of profiling).
SMALL_GRID = ("profile.decode_batch_sizes=[1,4,12]", "profile.decode_contexts=[32,160]",
              "profile.prefill_chunks=[16,128,512]", "profile.prefill_cached=[0]",
              "profile.prefill_batch_sizes=[1,3]", "profile.mixed_decode_batch_sizes=[4]",
              "profile.mixed_decode_contexts=[64]", "profile.mixed_prefill_chunks=[64]",
              "profile.warmup=1", "profile.repeats=3")


def test_whole_loop_on_the_real_cpu_executor(tmp_path):
    """Profile the real executor (tiny model, CPU) on a small grid, fit, run the workload
    through both, replay; loose bounds (shared CI machines are noisy): the tight figures come
    from the benchmark in docs/calibration.md."""
    pytest.importorskip("torch")
    cfg = _validate_cfg(*SMALL_GRID, "workload.num_requests=60", "workload.qps=30",
                        "policy.max_num_batched_tokens=1024")
    res = validate(cfg, tmp_path)
    assert res.real["completed"] == res.sim["completed"] == 60
    assert res.profile_fit["mape_heldout_pct"] < 30.0
    assert abs(res.replay.busy_error()) < 40.0
    assert res.replay.step_mape() < 60.0
    for metric in ("TPOT", "E2E"):
        assert abs(res.error(metric, "p50")) < 50.0, metric
        assert abs(res.error(metric, "p50", "replay")) < 50.0, metric
    assert abs(res.error("request_throughput", "")) < 15.0
    table = pd.read_csv(tmp_path / "validation.csv")
    assert list(table.columns) == ["metric", "stat", "real", "sim", "sim_err_pct", "replay",
                                   "replay_err_pct"]
    assert len(table) == 18
    doc = json.loads((tmp_path / "validation.json").read_text())
    assert doc["replay_steps"] == res.real["num_steps"]
    steps = pd.read_csv(tmp_path / "replay_steps.csv")
    assert len(steps) == res.real["num_steps"] and (steps.measured_s > 0).all()
    page = (tmp_path / "validation.html").read_text()
    assert "Latency CDFs" in page and "replayed" in page
    for sub in ("real", "sim"):
        assert (tmp_path / sub / "requests.csv").exists()
    assert (tmp_path / "profile.csv").exists() and (tmp_path / "hardware_profile.yaml").exists()


def test_real_executor_measurement_options():
    pytest.importorskip("torch")
    import gc
    import platform

    from executors.real.config import RealExecutorConfig
    from executors.real.host_memory import keep_freed_host_memory

    with pytest.raises(ConfigError, match="executor.timer"):
        RealExecutorConfig(timer="bogus")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert keep_freed_host_memory() is True
    # defer_gc leaves the collector as it found it, around every step.
    from experiments.validate import _sim_cfg

    sim = Simulation(_sim_cfg(_validate_cfg("workload.num_requests=5", "executor.timer=wall")))
    assert gc.isenabled()
    sim.run()
    assert gc.isenabled()
