"""Validation on a GPU, checked without one: the saturation finder behind ``validate.qps: auto``
against an executor whose saturation is computed by hand, the GPU preset
(``conf/validate_gpu.yaml``) run end to end on the CPU with CPU overrides, its memory budget on
an 80 GB H100, and the CUDA-side choices that can be checked on a CPU."""

from __future__ import annotations

import json

import pytest

import experiments.validate as validate_mod
from experiments.profile import ProfileGrid, blocks_needed
from experiments.analysis.saturation import BURST_QPS, find_saturation
from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.specs import load_model_spec
from tests.harness import RecordingExecutor
from tests.helpers import compose_cfg, compose_named

STEP = 0.01  # seconds per step of the fixed-time executor
PER_STEP = 10  # prompts of 100 tokens per step under a 1,000-token budget


def _fixed_cfg(n: int = 100) -> dict:
    """Requests that each finish in the one step that prefills them (100-token prompts, one
    output token), constant arrivals: every step serves up to PER_STEP of them."""
    cfg = compose_cfg("model=tiny", f"workload.num_requests={n}", "workload.arrival=constant",
                      "policy.max_num_batched_tokens=1000", "kv.num_gpu_blocks_override=4096",
                      "step_mode=exact")
    cfg["workload"]["prompt_len"] = {"dist": "fixed", "value": 100}
    cfg["workload"]["output_len"] = {"dist": "fixed", "value": 1}
    return cfg


def _fixed_run(cfg: dict, out) -> dict:
    sim = Simulation(cfg, out)
    sim.replace_executor(RecordingExecutor(step_time=STEP))
    return sim.run().summary


def served_rate(arrivals: list[float], step: float, per_step: int) -> float:
    """Completed / makespan of a server that, whenever idle or done with a step, runs one step
    of ``step`` seconds for up to ``per_step`` of the requests arrived by then (an oracle
    written apart from the simulator)."""
    t, i, n = arrivals[0], 0, len(arrivals)
    while i < n:
        t = max(t, arrivals[i])
        j = i
        while j < n and j - i < per_step and arrivals[j] <= t:
            j += 1
        t += step
        i = j
    return n / (t - arrivals[0])


def test_saturation_of_a_fixed_step_server(tmp_path):
    n = 100
    sat = find_saturation(_fixed_cfg(n), _fixed_run, tmp_path, fraction=0.85)
    burst, served = sat.probes
    # All at once: the first request runs alone (the others arrive a nanosecond later), then
    # ten per step: 11 steps.
    assert burst.offered_qps == BURST_QPS and burst.completed == n
    assert burst.throughput == pytest.approx(n / (11 * STEP), rel=1e-6)
    assert burst.throughput == pytest.approx(
        served_rate([(i + 1) / BURST_QPS for i in range(n)], STEP, PER_STEP), rel=1e-9)
    # Offered that rate evenly: ~9 arrive per step, and the last ones drain after the arrivals.
    rate = burst.throughput
    assert served.offered_qps == rate
    expect = served_rate([(i + 1) / rate for i in range(n)], STEP, PER_STEP)
    assert served.throughput == pytest.approx(expect, rel=1e-9)
    assert served.throughput < served.offered_qps  # over capacity for 100 requests
    assert sat.throughput == served.throughput and sat.qps == pytest.approx(0.85 * expect)
    doc = sat.as_dict()
    assert doc["qps"] == sat.qps and [p["offered_qps"] for p in doc["probes"]] == [BURST_QPS, rate]
    for sub in ("saturation", "saturation_2"):
        assert json.loads((tmp_path / sub / "summary.json").read_text())["completed"] == n


def test_saturation_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="validate.saturation_fraction"):
        find_saturation(_fixed_cfg(), _fixed_run, tmp_path, fraction=1.5)
    trace = _fixed_cfg()
    trace["workload"] = {"name": "trace", "path": "x.csv"}
    with pytest.raises(ConfigError, match="validate.qps: auto needs a synthetic workload"):
        find_saturation(trace, _fixed_run, tmp_path)
    with pytest.raises(ConfigError, match="completed 0 requests"):
        find_saturation(_fixed_cfg(), lambda c, o: {"completed": 0, "request_throughput": 0.0},
                        tmp_path)


_cfg = compose_named


def test_new_validate_options_are_checked(tmp_path):
    for bad, match in (("validate.qps=90", "validate.qps: must be auto .* workload.qps"),
                       ("validate.saturation_fraction=0", "validate.saturation_fraction"),
                       ("validate.saturation_num_gpu_blocks=0",
                        "validate.saturation_num_gpu_blocks"),
                       ("validate.hardware=h200", "validate.hardware")):
        with pytest.raises(ConfigError, match=match):
            validate_mod.validate(_cfg("validate", bad), tmp_path)


def test_hardware_auto_picks_the_gpus_spec(monkeypatch):
    import executors.real

    base = validate_mod._sim_cfg(_cfg("validate_gpu"))
    for device, expect in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_sxm"),
                           ("cpu", "h100_sxm")):
        monkeypatch.setattr(executors.real, "device_name", lambda d, name=device: name)
        cfg = validate_mod._sim_cfg(_cfg("validate_gpu"))
        validate_mod.resolve_hardware(cfg, {"hardware": "auto"})
        assert cfg["hardware"]["name"] == expect, device
    monkeypatch.setattr(executors.real, "device_name", lambda d: "NVIDIA GeForce RTX 4090")
    with pytest.raises(ConfigError, match="validate.hardware: auto: no conf/hardware"):
        validate_mod.resolve_hardware(base, {"hardware": "auto"})
    validate_mod.resolve_hardware(base, {"hardware": None})  # the composed one stays
    assert base["hardware"]["name"] == "h100_sxm"


def test_gpu_preset_fits_an_h100_and_covers_its_workload():
    """What the preset asks of the GPU: the weights, the profiler's pool and a run's pool
    side by side (interleaved runs) within an 80 GB H100, and a profile grid reaching the
    workload's recompute chunks."""
    cfg = _cfg("validate_gpu")
    model = load_model_spec("llama3_8b")
    assert (cfg["model"]["name"], cfg["executor"]["dtype"], cfg["executor"]["timer"],
            cfg["device"]) == ("llama3_8b", "bf16", "wall", "cuda")
    assert cfg["validate"]["qps"] == "auto" and cfg["validate"]["hardware"] == "auto"
    grid = ProfileGrid.from_dict(cfg["profile"])
    shapes = grid.shapes(model.max_model_len)
    assert len(shapes) == 116
    w = cfg["workload"]
    assert max(grid.prefill_chunks) >= w["prompt_len"]["max"] + w["output_len"]["max"]
    block = model.kv_bytes_per_token * cfg["kv"]["block_size"]
    pools = (blocks_needed(shapes, 16) + cfg["kv"]["num_gpu_blocks_override"]) * block
    activations = 2 * 2**30  # an 8,192-token prefill's live tensors and the logits, rounded up
    assert cfg["kv"]["num_gpu_blocks_override"] == cfg["validate"]["saturation_num_gpu_blocks"] == 8192
    assert (model.weight_bytes() + pools + activations) / 2**30 < 70  # of ~79 GiB
    # The preemption-heavy pool (docs) holds several of the longest requests.
    longest = -(-(w["prompt_len"]["max"] + w["output_len"]["max"]) // 16)
    assert 384 >= 4 * longest


@pytest.mark.slow
def test_gpu_preset_runs_end_to_end_on_the_cpu(tmp_path):
    """conf/validate_gpu.yaml with CPU overrides and tiny counts: qps auto (two probes),
    hardware auto (kept on a CPU), interleaved profile, real, calibration and simulated runs."""
    pytest.importorskip("torch")
    from tests.test_validate import SMALL_GRID

    # 20 requests: every run still takes hundreds of steps (the preset's 64-token outputs),
    # and nothing below depends on how fast the host ran them.
    cfg = _cfg("validate_gpu", "device=cpu", "model=tiny", "executor.timer=cpu",
               "executor.kernels=torch", "executor.dtype=fp32", "workload.num_requests=20",
               "validate.real_repeats=2", "validate.calibration_runs=1",
               "validate.saturation_num_gpu_blocks=512", *SMALL_GRID)
    res = validate_mod.validate(cfg, tmp_path)
    sat = res.saturation
    assert sat is not None and len(sat.probes) == 2
    assert sat.probes[1].offered_qps == sat.probes[0].throughput
    assert res.qps == pytest.approx(0.85 * sat.probes[1].throughput)
    assert res.real["completed"] == res.sim["completed"] == 20
    assert res.real["kv_num_gpu_blocks"] == 512 and res.real["hardware"] == "cpu"
    doc = json.loads((tmp_path / "validation.json").read_text())
    assert doc["qps_mode"] == "auto" and doc["qps"] == pytest.approx(res.qps)
    assert doc["saturation"]["probes"][0]["offered_qps"] == BURST_QPS
    assert (doc["device"], doc["hardware"]) == ("cpu", "h100_sxm")
    saved = json.loads((tmp_path / "saturation.json").read_text())
    assert saved["qps"] == pytest.approx(res.qps) and saved["probe_num_gpu_blocks"] == 512
    for sub in ("saturation", "saturation_2", "real", "real_2", "calibration", "sim"):
        assert (tmp_path / sub / "summary.json").exists(), sub
    assert "qps auto:" in validate_mod.format_table(res)
    table = validate_mod.summary_table([tmp_path, tmp_path / "cut_short"]).splitlines()
    assert len([line for line in table if line.startswith(tmp_path.name[:10])]) == 6 + 1
    assert f"fcfs at {res.qps:.2f} req/s (auto: 0.85 x saturation" in table[-2]
    assert table[-1] == "cut_short: not finished (no validation.csv / validation.json)"


def test_cuda_side_choices_checkable_on_a_cpu():
    pytest.importorskip("torch")
    from executors.real.config import LlamaArgs
    from executors.real.executor import prefill_attention_tile
    from executors.real.weights import clear_shared_weights, shared_random_weights

    # Triton's prefill tile is 64 // group tokens: full 64-token tiles only without grouping.
    assert prefill_attention_tile("torch", 1) == 1
    assert prefill_attention_tile("triton", 1) == 64
    assert prefill_attention_tile("triton", 4) == 1  # Llama-3-8B: 16-token tiles
    import torch

    args = LlamaArgs.from_spec(load_model_spec("tiny"))
    a = shared_random_weights(args, torch.float32, "cpu", 0)
    assert shared_random_weights(args, torch.float32, "cpu", 0) is a
    b = shared_random_weights(args, torch.float32, "cpu", 1)
    assert b is not a and not torch.equal(a.embed, b.embed)
    clear_shared_weights()
    assert shared_random_weights(args, torch.float32, "cpu", 1) is not b


def test_a_released_real_executor_holds_no_kv_and_runs_no_step():
    pytest.importorskip("torch")
    from sim.kv_manager import KVBlockManager
    from sim.plan import ScheduledRequest, StepPlan

    sim = Simulation(compose_cfg("executor=real", "device=cpu", "model=tiny",
                                 "kv.num_gpu_blocks_override=8", "workload.num_requests=2"))
    ex = sim.executor
    ex.init_kv_cache(8, 2, 16)
    kv = KVBlockManager(8, 16)
    kv.allocate_slots(0, 5)
    ex.add_request(0, [1, 2, 3, 4, 5])
    plan = StepPlan([ScheduledRequest(0, 0, 5, kv.block_table(0), True)])
    assert len(ex.execute(plan).sampled_token_ids) == 1
    ex.release()
    assert ex.runner.gpu_cache == [] and ex.runner.cpu_cache == [] and not ex.runner.tokens
    assert ex.model is None and ex.runner.model is None  # replaced shared weights can go
    with pytest.raises(RuntimeError, match="released"):
        ex.execute(plan)


def test_every_run_of_a_validation_serves_one_copy_of_the_weights():
    """Calibration runs use other seeds (other arrivals and prompts) but the same model: one
    weights object for the profiler and every run, which are all kept until the end (on a
    GPU, a copy per seed would be 15 GiB each for Llama-3-8B)."""
    pytest.importorskip("torch")
    from experiments.profile import build_executor
    from experiments.validate import RunSchedule

    base = compose_cfg("executor=real", "device=cpu", "model=tiny", "seed=3",
                       "workload.num_requests=2")
    profiler, _, _ = build_executor(base)
    kept = [Simulation(cfg).executor
            for _, _, cfg in RunSchedule(base, None, repeats=3, calibration=2).jobs]
    assert {cfg["seed"] for _, _, cfg in RunSchedule(base, None, 3, 2).jobs} == {3, 1003, 1004}
    assert {id(ex.model.weights) for ex in [profiler, *kept]} == {id(profiler.model.weights)}
    # A run without validation's pin keeps its own seed's weights.
    other = Simulation(compose_cfg("executor=real", "device=cpu", "model=tiny", "seed=4",
                                   "workload.num_requests=2")).executor
    assert other.model.weights is not profiler.model.weights
