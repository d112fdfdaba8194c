"""Validate the calibrated cost model against the real executor on one workload and policy.

    python -m experiments.validate                                  # fcfs, tiny model, CPU
    python -m experiments.validate validate.profile=outputs/tiny_cpu.yaml
    python -m experiments.validate -m policy=fcfs policy.chunked_prefill=true,false
    python -m experiments.validate kv.num_gpu_blocks=48              # preemption-heavy

1. Runs the workload through the real executor (``executor=real``, ``conf/validate.yaml``),
   recording every step (``executors/recording.py``).
2. Fits a hardware profile on the fly (profiles the same real executor over ``profile``, the
   grid, then ``executors.calibration.calibrate``), unless ``validate.profile`` names one.
3. Runs the same workload through ``executor=cost_model executor.profile=<file>`` with the real
   run's KV pool sizes: a free simulation, whose schedule may diverge from the real one.
4. Replays the recorded steps through the same cost model with the schedule held fixed: per-step
   error and the latencies of the real schedule under predicted step times.

Writes into the Hydra folder: ``validation.csv`` (metric, statistic, real, simulated, replayed,
relative errors), ``validation.json`` (that plus the step-time figures), ``validation.html``
(the CDFs overlaid, predicted vs measured step times), and ``real/``, ``sim/`` (each run's
``requests.csv``, ``steps.csv``, ``summary.json``), plus ``profile.csv`` and
``hardware_profile.yaml`` when profiled here. Prints the table.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from executors.recording import RecordingExecutor, Replay, replay
from sim.errors import ConfigError, require
from sim.metrics import latency_stats

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
STATS = (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
THROUGHPUTS = ("request_throughput", "output_throughput")
OPTIONS = {"profile", "replay", "cost_model", "seed_profile"}


@dataclass
class ValidationResult:
    rows: list[dict[str, Any]]  # one per (metric, statistic) and throughput
    real: dict[str, Any]  # summaries
    sim: dict[str, Any]
    replayed: dict[str, Any] | None
    replay: Replay | None
    profile_path: Path
    profile_fit: dict[str, Any] = field(default_factory=dict)

    def error(self, metric: str, stat: str, kind: str = "sim") -> float:
        """Relative error in percent (``kind``: sim or replay) of one table row."""
        for r in self.rows:
            if r["metric"] == metric and r["stat"] == stat:
                return float(r[f"{kind}_err_pct"])
        raise KeyError((metric, stat))


# ---- summaries --------------------------------------------------------------------------------
def replay_summary(rep: Replay, arrivals: dict[int, float], completed: set[int]) -> dict[str, Any]:
    """The ``summary.json`` latency and throughput keys of the replayed timeline (the same
    definitions as ``sim.metrics.MetricsCollector``)."""
    ttft, tpot, e2el, itl = [], [], [], []
    out_tokens = 0
    last = 0.0
    for rid in sorted(completed):
        t = np.asarray(rep.token_times.get(rid, []), dtype=float)
        if not len(t):
            raise ValueError(f"request {rid} finished in the real run but sampled no token in "
                             f"the recorded steps")
        a = arrivals[rid]
        ttft.append(t[0] - a)
        e2el.append(t[-1] - a)
        if len(t) > 1:
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
            itl.extend(np.diff(t))
        out_tokens += len(t)
        last = max(last, float(t[-1]))
    dur = max(0.0, last - min(arrivals.values())) if arrivals else 0.0
    s: dict[str, Any] = {"completed": len(completed),
                         "request_throughput": len(completed) / dur if dur else 0.0,
                         "output_throughput": out_tokens / dur if dur else 0.0}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        s.update(latency_stats(name, np.asarray(values, dtype=float)))
    return s


def _rel(pred: float, ref: float) -> float:
    return 100.0 * (pred / ref - 1.0) if ref else float("nan")


def error_table(real: dict[str, Any], sim: dict[str, Any],
                replayed: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rows (metric, stat, real, sim, sim_err_pct, replay, replay_err_pct); latencies in ms."""
    rows = []
    keys = [(label, s_label, f"{s}_{m}_ms") for m, label in METRICS for s, s_label in STATS]
    keys += [(t, "", t) for t in THROUGHPUTS]
    for metric, stat, key in keys:
        row = {"metric": metric, "stat": stat, "real": real[key], "sim": sim[key],
               "sim_err_pct": _rel(sim[key], real[key])}
        if replayed is not None:
            row["replay"] = replayed[key]
            row["replay_err_pct"] = _rel(replayed[key], real[key])
        rows.append(row)
    return rows


def format_table(result: ValidationResult) -> str:
    has_replay = result.replayed is not None
    head = f"{'metric':<20} {'stat':<5} {'real':>10} {'sim':>10} {'err%':>7}"
    if has_replay:
        head += f" {'replay':>10} {'err%':>7}"
    lines = [head]
    for r in result.rows:
        line = (f"{r['metric']:<20} {r['stat']:<5} {r['real']:>10.2f} {r['sim']:>10.2f} "
                f"{r['sim_err_pct']:>+7.1f}")
        if has_replay:
            line += f" {r['replay']:>10.2f} {r['replay_err_pct']:>+7.1f}"
        lines.append(line)
    lines.append("(latencies in ms, throughputs per second; err% = simulated / real - 1)")
    if result.replay is not None:
        rp = result.replay
        lines.append(f"replay: {len(rp.measured)} steps, step-time MAPE {rp.step_mape():.2f}%, "
                     f"busy time {rp.measured.sum():.3f} s measured vs "
                     f"{rp.predicted.sum():.3f} s predicted ({rp.busy_error():+.2f}%)")
    f = result.profile_fit
    if f:
        lines.append(f"profile {result.profile_path}: held-out step-time MAPE "
                     f"{f.get('mape_heldout_pct')}% ({f.get('rows_heldout')} shapes)")
    return "\n".join(lines)


# ---- the runs ---------------------------------------------------------------------------------
def _options(cfg: dict[str, Any]) -> dict[str, Any]:
    opts = dict(cfg.get("validate") or {})
    unknown = sorted(set(opts) - OPTIONS)
    if unknown:
        raise ConfigError(f"validate.{unknown[0]}",
                          f"unknown option; known: {', '.join(sorted(OPTIONS))}")
    return opts


def _sim_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    """The main job's config: everything but this script's own sections."""
    out = {k: copy.deepcopy(v) for k, v in cfg.items() if k not in ("validate", "profile",
                                                                      "hydra")}
    out["progress"] = bool(cfg.get("progress", False))
    return out


def cost_model_section(profile: Path, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``conf/executor/cost_model.yaml`` with the profile and ``validate.cost_model`` applied."""
    with (ROOT / "conf" / "executor" / "cost_model.yaml").open() as f:
        section = dict(yaml.safe_load(f) or {})
    section.update(overrides or {})
    section["profile"] = str(profile)
    return section


def fit_profile_here(cfg: dict[str, Any], out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Profile the configured (real) executor over ``profile`` and fit; returns the profile."""
    from executors.calibration import calibrate, save_profile
    from experiments.profile import ProfileGrid, build_executor, profile_executor, write_csv

    grid = ProfileGrid.from_dict(dict(cfg.get("profile") or {}))
    sim_cfg = _sim_cfg(cfg)
    executor, model, meta = build_executor(sim_cfg)
    block_size = int(sim_cfg["kv"]["block_size"])
    seed = int((cfg.get("validate") or {}).get("seed_profile", 0))
    rows = profile_executor(executor, model, grid, block_size, meta, seed)
    csv = write_csv(rows, out_dir / "profile.csv")
    tp = int(sim_cfg.get("cluster", {}).get("tensor_parallel", 1))
    prof = calibrate(rows, model, tp, block_size, source=str(csv))
    path = save_profile(prof, out_dir / "hardware_profile.yaml")
    return path, prof.fit


def validate(cfg: dict[str, Any], out_dir: Path) -> ValidationResult:
    """Real run (recorded), profile (given or fitted here), simulated run, replay."""
    from executors.calibration import load_profile
    from sim.simulation import Simulation

    opts = _options(cfg)
    base = _sim_cfg(cfg)
    require(str(base["executor"].get("name")) == "real", "executor",
            "validate runs the real executor first: use executor=real (conf/validate.yaml)")
    out_dir.mkdir(parents=True, exist_ok=True)

    # The profile first: a profiling pass after the real run would measure a warmer process.
    if opts.get("profile"):
        from workloads.base import resolve_path

        profile_path = resolve_path(str(opts["profile"]), "validate.profile")
        fit = load_profile(profile_path).fit
    else:
        profile_path, fit = fit_profile_here(cfg, out_dir)

    real_sim = Simulation(base, out_dir / "real", keep_requests=True)
    recorder = RecordingExecutor(real_sim.executor)
    real_sim.replace_executor(recorder)
    real = real_sim.run()
    log.info("real run: %d steps in %.1f s simulated", len(recorder.steps),
             real.summary["simulated_duration_s"])

    sim_cfg = copy.deepcopy(base)
    sim_cfg["executor"] = cost_model_section(profile_path, opts.get("cost_model"))
    # The same KV pools as the real run (the cost model's memory planner would size them from
    # the hardware spec, not from the real executor's device and dtype).
    sim_cfg["kv"] = {**sim_cfg["kv"], "num_gpu_blocks": real.memory.num_gpu_blocks,
                     "num_cpu_blocks": real.memory.num_cpu_blocks}
    simulated = Simulation(sim_cfg, out_dir / "sim", keep_requests=True)
    sim = simulated.run()

    rep = replayed = None
    if opts.get("replay", True):
        arrivals = {r.request_id: r.arrival_time for r in real.requests}
        done = {r.request_id for r in real.requests if r.status.name == "FINISHED"}
        rep = replay(recorder.steps, simulated.executor, arrivals)
        replayed = replay_summary(rep, {k: arrivals[k] for k in done}, done)
    rows = error_table(real.summary, sim.summary, replayed)
    result = ValidationResult(rows, real.summary, sim.summary, replayed, rep, profile_path, fit)
    write_outputs(result, out_dir, base)
    return result


# ---- outputs ----------------------------------------------------------------------------------
def write_outputs(result: ValidationResult, out_dir: Path, cfg: dict[str, Any]) -> None:
    import pandas as pd

    pd.DataFrame(result.rows).to_csv(out_dir / "validation.csv", index=False)
    doc: dict[str, Any] = {
        "policy": result.real.get("policy"), "model": result.real.get("model"),
        "profile": str(result.profile_path), "profile_fit": result.profile_fit,
        "rows": result.rows,
        "real_num_preemptions": result.real.get("num_preemptions"),
        "sim_num_preemptions": result.sim.get("num_preemptions"),
        "real_num_steps": result.real.get("num_steps"),
        "sim_num_steps": result.sim.get("num_steps"),
        "real_simulated_duration_s": result.real.get("simulated_duration_s"),
        "real_wall_time_s": result.real.get("wall_time_s"),
    }
    if result.replay is not None:
        rp = result.replay
        doc.update({"replay_steps": len(rp.measured), "replay_step_mape_pct": rp.step_mape(),
                    "replay_busy_error_pct": rp.busy_error(),
                    "replay_busy_measured_s": float(rp.measured.sum()),
                    "replay_busy_predicted_s": float(rp.predicted.sum())})
    (out_dir / "validation.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    if result.replay is not None:
        replay_frame(result.replay).to_csv(out_dir / "replay_steps.csv", index=False)
    (out_dir / "validation.html").write_text(_page(result, out_dir))


def replay_frame(rep: Replay) -> Any:
    """One row per recorded step: its shape, measured and predicted seconds."""
    import dataclasses

    import pandas as pd

    df = pd.DataFrame([dataclasses.asdict(s.shape) for s in rep.steps])
    df["measured_s"] = rep.measured
    df["predicted_s"] = rep.predicted
    df["error_pct"] = 100.0 * rep.step_errors
    return df


def _page(result: ValidationResult, out_dir: Path) -> str:
    import html

    import pandas as pd
    import plotly.graph_objects as go

    from sim.report import latency_cdf_figure, html_page

    frames = {"real": pd.read_csv(out_dir / "real" / "requests.csv"),
              "simulated": pd.read_csv(out_dir / "sim" / "requests.csv")}
    if result.replay is not None:
        frames["replayed"] = _replayed_requests(result.replay, frames["real"])
    figures = [latency_cdf_figure(frames, "Latency CDFs: real executor vs calibrated simulator")]
    if result.replay is not None:
        rp = result.replay
        hi = float(max(rp.measured.max(), rp.predicted.max())) * 1e3 if len(rp.measured) else 1
        fig = go.Figure([go.Scattergl(x=rp.measured * 1e3, y=rp.predicted * 1e3, mode="markers",
                                      marker=dict(size=4, opacity=0.5), name="steps"),
                         go.Scatter(x=[0, hi], y=[0, hi], mode="lines", name="y = x")])
        fig.update_layout(title=f"Replayed steps: predicted vs measured (MAPE "
                                f"{rp.step_mape():.1f}%)", height=500,
                          xaxis_title="measured (ms)", yaxis_title="predicted (ms)")
        figures.append(fig)
    title = (f"Validation: {result.real.get('model')} / {result.real.get('policy')} / "
             f"{result.real.get('completed')} requests")
    return html_page(title, figures, f"<pre>{html.escape(format_table(result))}</pre>")


def _replayed_requests(rep: Replay, real: Any) -> Any:
    """A requests table (the columns the CDF figure reads) for the replayed timeline."""
    import pandas as pd

    done = real[real["status"] == "finished"]
    rows = []
    for rid, arrival in zip(done["request_id"], done["arrival_time"]):
        t = rep.token_times.get(int(rid), [])
        if not t:
            continue
        tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
        rows.append({"status": "finished", "ttft": t[0] - arrival, "tpot": tpot,
                     "e2e_latency": t[-1] - arrival})
    return pd.DataFrame(rows, columns=["status", "ttft", "tpot", "e2e_latency"])


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(version_base="1.3", config_path="../conf", config_name="validate")
    def _main(cfg: DictConfig) -> None:
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            result = validate(OmegaConf.to_container(cfg, resolve=True), out_dir)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"{result.real.get('policy')} (chunked_prefill="
              f"{cfg.policy.get('chunked_prefill')}), {result.real.get('completed')} requests, "
              f"preemptions real {result.real.get('num_preemptions')} sim "
              f"{result.sim.get('num_preemptions')}")
        print(format_table(result))
        print(f"outputs: {out_dir}")

    _main()


if __name__ == "__main__":
    main()
