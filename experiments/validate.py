"""Validate the calibrated cost model against the real executor on one workload and policy.

    python -m experiments.validate                                  # fcfs, tiny model, CPU
    python -m experiments.validate -m policy=fcfs,chunked_prefill,sjf
    python -m experiments.validate kv.num_gpu_blocks_override=64              # preemption-heavy
    python -m experiments.validate validate.profile=outputs/tiny_cpu.yaml validate.interleave=false
    python -m experiments.validate validate.qps=auto                 # at 0.85 x saturation
    python -m experiments.validate --config-name validate_gpu       # Llama-3-8B on a GPU

0. With ``validate.qps: auto``, measures the saturation throughput of the real executor on
   this workload (``experiments/analysis/saturation.py``: two probe runs offered more than
   it serves) and runs everything below at ``validate.saturation_fraction`` of it
   (``saturation.json``).
   ``validate.hardware: auto`` prices the simulation with the ``conf/hardware`` spec of the
   GPU the real executor runs on.
1. Profiles the real executor over ``profile`` (the grid, in shuffled rounds), unless
   ``validate.profile`` names a fitted profile.
2. Between the profile's rounds (``validate.interleave``, so that on a shared host the profile
   and the runs sample the same machine states), runs the workload through the real executor
   (``executor=real``, ``conf/validate.yaml``) ``validate.real_repeats`` times, recording every
   step (``executors/recording.py``), alternating with ``validate.calibration_runs`` recorded
   runs under other seeds. The comparison uses each statistic's median over the real runs and
   reports their range: measured step times drive a real run's clock, so each run's schedule
   and latencies differ, and near saturation the queue amplifies a few percent of step-time
   noise into tens of percent of latency.
3. Fits the profile rows (``executors.calibration.calibrate``), then refits them with the
   calibration runs' steps (``calibrate(steps=...)``, fitted at their mean): a serving run's
   steps carry what isolated shapes cannot (host work between steps, step history). The
   refitted profile is left at the median calibration run's speed
   (``validate.calibration_level``: ``median``, or ``mean`` for the pooled fit).
4. Runs the workload through ``executor=cost_model executor.profile=<file>`` with the real
   runs' KV pool sizes (a free simulation, whose schedule may diverge from the real ones), with
   the refitted profile (``sim``) and the profile alone (``sim_profile``).
5. Replays each real run's recorded steps through the cost model with the schedule held fixed:
   per-step error and the latencies of the real schedule under predicted step times.
6. Simulates each real run again with the profile scaled by the host's speed during it
   (``validate.host_speed``, ``experiments/host_speed.py``) and compares it with its own run:
   the ``paired`` columns, a diagnostic that separates a shared host's drifting speed from
   what the simulator gets wrong.

``validate.pin_cpu`` pins the process to one core while it profiles and runs the real executor
(no migration between cores' private caches). ``validate.policy_overrides.<policy name>`` holds
the policy settings the validation workload needs (a chunk budget that makes
``chunked_prefill`` chunk these short prompts); they are merged into ``policy``.

Writes into the Hydra folder: ``validation.csv`` (metric, statistic, real median and range,
simulated, replayed, relative errors), ``validation.json`` (that plus each run's and the
step-time figures), ``validation.html`` (the CDFs overlaid, predicted vs measured step times),
``replay_steps.csv`` (each real run's steps: shape, measured and predicted seconds, run),
``calibration_steps.csv`` (the same for the calibration runs, priced by the simulated
profile, with each run's seed), and ``real/``, ``real_2/``..., ``calibration/``..., ``sim/``,
``saturation/``, ``saturation_2/`` and ``saturation.json`` (``qps: auto``),
``sim_profile/``, ``paired/real``, ``paired/real_2``... (each run's ``requests.csv``,
``steps.csv``, ``summary.json``; a paired run's scaled ``hardware_profile.yaml``), plus
``profile.csv``, ``hardware_profile.yaml`` and ``hardware_profile_serving.yaml``. Prints the
table.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from executors.recording import RecordingExecutor, Replay, is_serving_step, replay
from executors.step_terms import ATTENTION_TILE
from experiments.host_speed import neighbour_speeds, scaled_profile, speed_ratio
from experiments.analysis.saturation import DEFAULT_FRACTION, Saturation, find_saturation
from experiments.analysis.validate_config import (
    TARGET_STATS,
    _options,
    _sim_cfg,
    apply_policy_overrides,
    command_line_policy_keys,
    cost_model_section,
)
from sim.errors import ConfigError, exit_on_config_error, require
from sim.metrics import latency_stats

log = logging.getLogger(__name__)

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
STATS = (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
#: A table row's (metric, stat) labels -> the summary key they come from.
SUMMARY_KEY = {(label, s_label): f"{s}_{m}_ms" for m, label in METRICS for s, s_label in STATS}
THROUGHPUTS = ("request_throughput", "output_throughput")
RUN_KEYS = ("num_steps", "num_preemptions", "simulated_duration_s", "wall_time_s",
            "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_e2el_ms",
            "p90_e2el_ms")
#: ``validate.calibration_runs``: the i-th runs the workload with seed ``seed + this + i``.
CALIBRATION_SEED_OFFSET = 1000


@dataclass
class ValidationResult:
    rows: list[dict[str, Any]]  # one per (metric, statistic) and throughput
    real: dict[str, Any]  # each numeric summary key's median over the real runs
    sim: dict[str, Any]
    replayed: dict[str, Any] | None  # each key's median over the replayed runs
    replay: Replay | None  # every run's steps pooled (step-time figures)
    profile_path: Path
    profile_fit: dict[str, Any] = field(default_factory=dict)  # the profile simulated with
    # The profile's own fit on its rows alone (the "held-out shapes" MAPE); the same as
    # ``profile_fit`` when no serving steps were refitted.
    shapes_fit: dict[str, Any] = field(default_factory=dict)
    real_runs: list[dict[str, Any]] = field(default_factory=list)  # each real run's summary
    replays: list[Replay] = field(default_factory=list)  # each real run's replay
    # Each calibration run's steps priced by the simulated profile (``calibration_steps.csv``):
    # whether a seed's step mix or the host's speed during the run moves its pricing error;
    # and each one's seed, as the run reported it.
    calibration_replays: list[Replay] = field(default_factory=list)
    calibration_seeds: list[int] = field(default_factory=list)
    # Each real run simulated at the host's speed of its time (experiments/host_speed.py):
    # the summaries (one per real run, in order) and how the speeds were taken.
    paired_runs: list[dict[str, Any]] = field(default_factory=list)
    host_speed: dict[str, Any] = field(default_factory=dict)
    qps: float | None = None  # the offered load validated (workload.qps)
    saturation: Saturation | None = None  # how qps was chosen (validate.qps: auto)

    def error(self, metric: str, stat: str, kind: str = "sim") -> float:
        """Relative error in percent (``kind``: sim, replay or paired) of one table row."""
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


#: Coverage asked of the reference's interval (``median_interval``).
REFERENCE_LEVEL = 0.95


def reference_order(n: int, level: float = REFERENCE_LEVEL) -> tuple[int, float]:
    """(k, coverage) of the order-statistic interval for the median of ``n`` values: the k-th
    smallest to the k-th largest value covers the population median with probability
    ``1 - 2 P(Binomial(n, 1/2) < k)``; k is the largest whose coverage is at least ``level``
    (with too few values for the level, k = 1, the range, at its own coverage)."""
    from scipy.stats import binom

    if n < 1:
        raise ValueError("the reference's interval needs at least one run")
    k = 1
    while k < (n + 1) // 2 and 1.0 - 2.0 * binom.cdf(k, n, 0.5) >= level:
        k += 1
    return k, float(1.0 - 2.0 * binom.cdf(k - 1, n, 0.5))


def median_interval(values: Sequence[float], level: float = REFERENCE_LEVEL,
                    ) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of the population ``values``
    were drawn from: (lo, hi, coverage), lo and hi the k-th smallest and k-th largest value
    (``reference_order``). How far the reference, the runs' median, may lie from the median
    of the runs the host would give: the real runs' noise, which no simulator can remove."""
    v = sorted(float(x) for x in values)
    if any(math.isnan(x) for x in v):
        raise ValueError("median_interval: a run's figure is NaN")
    k, coverage = reference_order(len(v), level)
    return v[k - 1], v[len(v) - k], coverage


def _rel(pred: float, ref: float) -> float:
    return 100.0 * (pred / ref - 1.0) if ref else float("nan")


def median_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary of several runs: every numeric key's median (others from the first run).
    Each statistic is a median on its own: the result need not be any one run's summary."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = float(np.median(values))
    return out


def error_table(real: dict[str, Any], sim: dict[str, Any], replayed: dict[str, Any] | None,
                real_runs: Sequence[dict[str, Any]] = (),
                replayed_runs: Sequence[dict[str, Any]] = (),
                paired_runs: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Rows (metric, stat, real, real_min, real_max, real_lo, real_hi, sim, sim_err_pct,
    replay, replay_err_pct, paired, paired_err_pct); latencies in ms. ``real`` is the
    reference (the runs' median, ``median_summary``); ``real_min`` / ``real_max`` are the
    range over ``real_runs`` (``real`` itself without them) and ``real_lo`` / ``real_hi`` the
    reference's own interval (``median_interval``: where the median of the host's runs lies,
    at ``REFERENCE_LEVEL``). ``replay_err_pct`` is the median over runs of each replay
    against its own run when ``replayed_runs`` (one per real run) is given, else ``replayed``
    against ``real``. ``paired_runs`` (one simulation per real run at that run's host speed,
    ``experiments/host_speed.py``) give ``paired`` (their median) and ``paired_err_pct`` (the
    median over runs of each against its own run)."""
    for name, other in (("replayed", replayed_runs), ("paired", paired_runs)):
        if other and len(other) != len(real_runs):
            raise ValueError(f"{len(other)} {name} runs for {len(real_runs)} real runs")
    rows = []
    keys = [(label, s_label, f"{s}_{m}_ms") for m, label in METRICS for s, s_label in STATS]
    keys += [(t, "", t) for t in THROUGHPUTS]
    for metric, stat, key in keys:
        values = [float(r[key]) for r in real_runs] or [float(real[key])]
        lo, hi, _ = median_interval(values)
        row = {"metric": metric, "stat": stat, "real": real[key], "real_min": min(values),
               "real_max": max(values), "real_lo": lo, "real_hi": hi, "sim": sim[key],
               "sim_err_pct": _rel(sim[key], real[key])}
        if replayed is not None:
            row["replay"] = replayed[key]
            if replayed_runs:
                row["replay_err_pct"] = float(np.median(
                    [_rel(p[key], r[key]) for p, r in zip(replayed_runs, real_runs)]))
            else:
                row["replay_err_pct"] = _rel(replayed[key], real[key])
        if paired_runs:
            row["paired"] = float(np.median([float(p[key]) for p in paired_runs]))
            row["paired_err_pct"] = float(np.median(
                [_rel(p[key], r[key]) for p, r in zip(paired_runs, real_runs)]))
        rows.append(row)
    return rows


def spread_pct(row: dict[str, Any]) -> float:
    """The real runs' range (max - min) relative to their median, in percent."""
    return 100.0 * (row["real_max"] - row["real_min"]) / row["real"] if row["real"] else 0.0


def reference_pct(row: dict[str, Any]) -> tuple[float, float]:
    """The reference's interval (``real_lo``, ``real_hi``) as errors from the reference, in
    percent: a simulated figure with an error inside it is as close as the runs can tell."""
    return _rel(row["real_lo"], row["real"]), _rel(row["real_hi"], row["real"])


def in_reference(row: dict[str, Any]) -> bool:
    """Whether the simulated figure lies inside the reference's interval."""
    return bool(row["real_lo"] <= row["sim"] <= row["real_hi"])


def format_table(result: ValidationResult) -> str:
    has_replay = result.replayed is not None
    has_paired = bool(result.paired_runs)
    n = max(1, len(result.real_runs))
    head = (f"{'metric':<20} {'stat':<5} {'real':>10} {'spread%':>7} {'ref%':>9} {'sim':>10} "
            f"{'err%':>7}")
    if has_replay:
        head += f" {'replay':>10} {'err%':>7}"
    if has_paired:
        head += f" {'paired':>10} {'err%':>7}"
    lines = [result.saturation.describe()] if result.saturation is not None else []
    lines.append(head)
    for r in result.rows:
        lo, hi = reference_pct(r)
        line = (f"{r['metric']:<20} {r['stat']:<5} {r['real']:>10.2f} {spread_pct(r):>7.1f} "
                f"{f'{lo:+.0f}/{hi:+.0f}':>9} {r['sim']:>10.2f} {r['sim_err_pct']:>+7.1f}")
        if has_replay:
            line += f" {r['replay']:>10.2f} {r['replay_err_pct']:>+7.1f}"
        if has_paired:
            line += f" {r['paired']:>10.2f} {r['paired_err_pct']:>+7.1f}"
        lines.append(line)
    lines.append("(latencies in ms, throughputs per second; err% = simulated / real - 1)")
    if "sim_profile" in result.rows[0]:
        lines.append("profile only (before the refit with serving steps), err%: " + ", ".join(
            f"{r['metric']} {r['stat']} {r['sim_profile_err_pct']:+.1f}" for r in result.rows
            if r["stat"] in ("p50", "p90")))
    if n > 1:
        lines.append(f"real: median of {n} runs; spread% = (max - min) / median over the runs; "
                     f"replay err%: median over the runs of each replay vs its own run")
        coverage = reference_order(n)[1]
        inside = sum(in_reference(r) for r in result.rows
                     if (r["metric"], r["stat"]) in TARGET_STATS)
        lines.append(f"ref% = the reference's own interval as errors (order statistics of the "
                     f"{n} runs, coverage {100 * coverage:.1f}%): the simulated p50/p90 TTFT, "
                     f"TPOT and E2E lie inside it in {inside} of 6")
    hs = result.host_speed
    if has_paired:
        f = hs["factors"]
        lines.append(f"paired (a diagnostic): each real run simulated at the host's speed "
                     f"(validate.host_speed={hs['mode']}: x{min(f):.3f} to x{max(f):.3f} the "
                     f"profile's step times), err% = median over the runs of each vs its own run")
    elif hs.get("skipped"):
        lines.append(f"paired: not run ({hs['skipped']})")
    if result.replay is not None:
        rp = result.replay
        lines.append(f"replay: {len(rp.measured)} steps, step-time MAPE {rp.step_mape():.2f}%, "
                     f"busy time {rp.measured.sum():.3f} s measured vs "
                     f"{rp.predicted.sum():.3f} s predicted ({rp.busy_error():+.2f}%)")
    f, shapes = result.profile_fit, result.shapes_fit or result.profile_fit
    if shapes:
        lines.append(f"profile {result.profile_path}: the profile's own fit, held-out "
                     f"step-time MAPE {shapes.get('mape_heldout_pct')}% "
                     f"({shapes.get('rows_heldout')} shapes)")
    if f and f.get("steps_heldout"):
        lines.append(f"  refitted with serving steps: held-out steps MAPE "
                     f"{f['mape_steps_heldout_pct']}%, busy {f['busy_steps_heldout_pct']:+}% "
                     f"({f['steps_heldout']} steps); the profile's held-out shapes "
                     f"{f.get('mape_heldout_pct')}%")
    return "\n".join(lines)


def summary_table(folders: Sequence[str | Path], target_pct: float = 5.0) -> str:
    """One table over finished validations (their Hydra folders, named by their last path
    part): the six target figures per configuration as the docs quote them, then per
    configuration the offered load (and how it was chosen), the held-out step-time MAPE, the
    replayed busy time and the preemptions.

        python -c "from experiments.validate import summary_table as t; print(t(['outputs/gpu6/fcfs']))"
    """
    import pandas as pd

    lines = [f"{'config':<10} {'stat':<9} {'real':>9} {'spread%':>8} {'ref%':>9} {'sim':>9} "
             f"{'err%':>7} {'replay err%':>11} {'paired err%':>11}"]
    notes = []
    for folder in map(Path, folders):
        name = folder.name
        csv, js = folder / "validation.csv", folder / "validation.json"
        if not (csv.exists() and js.exists()):
            notes.append(f"{name}: not finished (no validation.csv / validation.json)")
            continue
        rows = pd.read_csv(csv)
        doc = json.loads(js.read_text())
        within = within_paired = inside = 0
        runs = doc.get("real_runs") or []
        # One run places the median nowhere: no interval then.
        n_runs = len(runs) or int(doc.get("real_repeats", 1))
        has_ref = n_runs >= 2 and ("real_lo" in rows or bool(runs))
        for metric, stat in TARGET_STATS:
            r = rows[(rows.metric == metric) & (rows.stat == stat)].iloc[0].to_dict()
            within += abs(r["sim_err_pct"]) <= target_pct
            if has_ref and "real_lo" not in r:  # saved before the interval: from the runs
                key = SUMMARY_KEY[(metric, stat)]
                r["real_lo"], r["real_hi"], _ = median_interval([run[key] for run in runs])
            ref = " " * 9
            if has_ref:
                inside += in_reference(r)
                ref = "{:>9}".format("{:+.0f}/{:+.0f}".format(*reference_pct(r)))
            replay = f"{r['replay_err_pct']:>+11.1f}" if "replay_err_pct" in r else " " * 11
            paired = ""
            if "paired_err_pct" in r:
                paired = f" {r['paired_err_pct']:>+11.1f}"
                within_paired += abs(r["paired_err_pct"]) <= target_pct
            lines.append(f"{name:<10} {metric + ' ' + stat:<9} {r['real']:>9.2f} "
                         f"{spread_pct(r):>8.0f} {ref} {r['sim']:>9.2f} "
                         f"{r['sim_err_pct']:>+7.1f} {replay}{paired}")
        sat = doc.get("saturation")
        how = (f"auto: {sat['fraction']:g} x saturation {sat['saturation_throughput']:.2f}"
               if sat else "workload.qps")
        fit = doc.get("shapes_fit") or doc.get("profile_fit") or {}
        hs = doc.get("host_speed") or {}
        paired_note = (f" (paired at the host's speed: {within_paired}, host_speed="
                       f"{hs.get('mode')})" if "paired_err_pct" in rows else "")
        ref_note = (f", {inside} inside the reference's interval (ref%, coverage "
                    f"{100 * reference_order(n_runs)[1]:.1f}%)" if has_ref else "")
        notes.append(
            f"{name}: {within} of {len(TARGET_STATS)} within {target_pct:g}%{paired_note}"
            f"{ref_note}; "
            f"{doc['policy']} "
            f"at {doc['qps']:.2f} req/s ({how}) on {doc.get('device')} (hardware="
            f"{doc.get('hardware')}); held-out step-time MAPE {fit.get('mape_heldout_pct')}% "
            f"({fit.get('rows_heldout')} shapes); replay busy "
            f"{doc.get('replay_busy_error_pct', float('nan')):+.2f}%{level_note(hs)}; "
            f"preemptions real "
            f"{[r.get('num_preemptions') for r in doc['real_runs']]} sim "
            f"{doc.get('sim_num_preemptions')}")
    return "\n".join(lines + notes)


def level_note(host_speed: dict[str, Any]) -> str:
    """``, real runs' median time vs the profile +X% (+: slower)``: the median over the real
    runs of measured / predicted step time (``host_speed.own``, priced by the simulated
    profile) minus one. The refit leaves the profile at the calibration runs' median speed
    (``validate.calibration_level=median``), so this is how far the validated runs' host
    speed lay from the calibration runs'; near saturation the queue multiplies it about
    fourfold into latency. Empty without the real runs' speeds (``validate.host_speed=none``)."""
    own = host_speed.get("own")
    if not own:
        return ""
    gap = 100.0 * (float(np.median(own)) - 1.0)
    return f", real runs' median time vs the profile {gap:+.2f}% (+: slower)"


# ---- the runs ---------------------------------------------------------------------------------
def resolve_hardware(base: dict[str, Any], opts: dict[str, Any]) -> None:
    """``validate.hardware: auto``: replace ``base["hardware"]`` by the ``conf/hardware`` spec
    whose ``display_name`` is the real executor's GPU (e.g. ``NVIDIA H200`` -> ``h200``); the
    simulated runs are priced on it. On a CPU the composed spec stays (a fitted profile prices
    every step; the spec only names the run). A GPU no spec names is an error."""
    if opts.get("hardware") != "auto":
        return
    from executors.real import device_name
    from sim.specs import known_hardware, load_hardware_spec

    name = device_name(base["executor"].get("device") or base.get("device"))
    if name == "cpu":
        log.info("validate.hardware=auto: the real executor runs on the CPU; keeping "
                 "hardware=%s", base["hardware"].get("name"))
        return
    for hw in known_hardware():
        spec = load_hardware_spec(hw)
        if spec.display_name.strip().lower() == name.strip().lower():
            log.info("validate.hardware=auto: %s is conf/hardware/%s.yaml", name, hw)
            base["hardware"] = dataclasses.asdict(spec)
            return
    raise ConfigError("validate.hardware", f"auto: no conf/hardware/*.yaml has display_name "
                      f"{name!r}, the GPU the real executor runs on (known: "
                      f"{', '.join(known_hardware())}); pass hardware=<name> "
                      f"validate.hardware=null")


def choose_qps(base: dict[str, Any], opts: dict[str, Any], out_dir: Path) -> Saturation | None:
    """``validate.qps: auto``: measure the saturation (``experiments/analysis/saturation.py``)
    with real runs of ``base`` (its KV pool, or ``validate.saturation_num_gpu_blocks``), set
    ``base["workload"]["qps"]`` to the chosen load and write ``saturation.json`` at once (a
    validation cut short still has it)."""
    if opts.get("qps") != "auto":
        return None
    probe_cfg = copy.deepcopy(base)
    if opts.get("saturation_num_gpu_blocks") is not None:
        probe_cfg["kv"]["num_gpu_blocks_override"] = int(opts["saturation_num_gpu_blocks"])

    def run(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
        return real_run(cfg, out)[0].summary

    sat = find_saturation(probe_cfg, run, out_dir,
                          float(opts.get("saturation_fraction", DEFAULT_FRACTION)))
    base["workload"]["qps"] = sat.qps
    doc = {**sat.as_dict(), "probe_num_gpu_blocks": probe_cfg["kv"].get("num_gpu_blocks_override"),
           "num_requests": base["workload"].get("num_requests")}
    (out_dir / "saturation.json").write_text(json.dumps(doc, indent=2) + "\n")
    log.info("%s", sat.describe())
    return sat


@contextmanager
def pinned_to(core: int | None) -> Iterator[None]:
    """Run the body on one core only (``os.sched_setaffinity``), then restore the affinity."""
    if core is None:
        yield
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("validate.pin_cpu", "this platform has no os.sched_setaffinity")
    before = os.sched_getaffinity(0)
    require(core in before, "validate.pin_cpu",
            f"core {core} is not one this process may run on: {sorted(before)}")
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def fit_profile_here(cfg: dict[str, Any], out_dir: Path, statistic: str = "median_s",
                     after_round: Callable[[int, int], None] | None = None,
                     ) -> tuple[Path, dict[str, Any]]:
    """Profile the configured (real) executor over ``profile`` and fit ``statistic``; returns
    the profile (its ``source`` is the profile CSV written beside it). ``after_round(r,
    rounds)`` runs after each profile round (``validate.interleave``)."""
    from executors.calibration import calibrate, save_profile
    from experiments.profile import ProfileGrid, build_executor, profile_executor, write_csv

    grid = ProfileGrid.from_dict(dict(cfg.get("profile") or {}))
    sim_cfg = _sim_cfg(cfg)
    executor, model, meta = build_executor(sim_cfg)
    block_size = int(sim_cfg["kv"]["block_size"])
    seed = int((cfg.get("validate") or {}).get("seed_profile", 0))
    hook = None
    if after_round is not None:
        require(grid.order == "rounds", "validate.interleave", "needs profile.order=rounds")

        def hook(r: int) -> None:
            after_round(r, grid.repeats)
    try:
        rows = profile_executor(executor, model, grid, block_size, meta, seed, hook)
    finally:
        _release(executor)  # its KV pool, before the remaining runs allocate theirs
    csv = write_csv(rows, out_dir / "profile.csv")
    tp = int(sim_cfg.get("cluster", {}).get("tensor_parallel_size", 1))
    prof = calibrate(rows, model, tp, block_size, source=str(csv), statistic=statistic,
                     attention_tile=getattr(executor, "attention_tile", ATTENTION_TILE))
    path = save_profile(prof, out_dir / "hardware_profile.yaml")
    return path, prof.fit


def serving_steps(steps: Sequence[Any]) -> list[tuple[Any, float]]:
    """(shape, seconds) of recorded steps the fit can use: steps that run rows and move no KV
    between pools (swap copies are priced from the spec, not fitted)."""
    return [(s.shape, s.duration) for s in steps if is_serving_step(s)]


def refit_on_serving_steps(base: dict[str, Any], profile_path: Path, out_dir: Path,
                           recorded: Sequence[tuple[Any, list]], statistic: str,
                           level: str = "median") -> tuple[Path, dict[str, Any]]:
    """Refit the profile's rows together with the steps of ``recorded`` calibration runs
    (``executors.calibration.calibrate(steps=...)``), left at the ``level`` run's speed
    (``validate.calibration_level``); returns ``hardware_profile_serving.yaml``."""
    from executors.calibration import calibrate, load_profile, read_profile_csv, save_profile
    from sim.specs import model_spec_from

    given = load_profile(profile_path)
    source = Path(given.source or "")
    if not source.is_file():
        raise ConfigError("validate.calibration_runs", f"refitting needs the profile's rows, but "
                          f"{profile_path} names no readable source CSV ({str(source)!r})")
    rows = read_profile_csv(source)
    per_run = [serving_steps(rec) for _, rec in recorded]
    steps = [st for run in per_run for st in run]
    runs = [i for i, run in enumerate(per_run) for _ in run]
    model = model_spec_from(dict(base["model"]), "model config")
    tp = int(base.get("cluster", {}).get("tensor_parallel_size", 1))
    prof = calibrate(rows, model, tp, int(base["kv"]["block_size"]), source=str(source),
                     steps=steps, statistic=statistic,
                     # The knee the rows chose: the steps adjust prices, not the roofline shape.
                     sharpness=given.coefficients.sharpness,
                     attention_tile=int(given.fit.get("attention_tile", ATTENTION_TILE)),
                     step_runs=runs, run_level=level)
    path = save_profile(prof, out_dir / "hardware_profile_serving.yaml")
    log.info("refitted on %d profile rows and %d serving steps: %s", len(rows), len(steps),
             prof.fit)
    return path, prof.fit


def real_run(cfg: dict[str, Any], out_dir: Path) -> tuple[Any, list]:
    """One recorded run of the real executor (a fresh one): the result (with its requests)
    and the recorded steps; outputs in ``out_dir``."""
    from experiments.simulation import Simulation

    sim = Simulation(cfg, out_dir, keep_requests=True)
    recorder = RecordingExecutor(sim.executor)
    sim.replace_executor(recorder)
    try:
        res = sim.run()
    finally:
        # The result keeps the executor (and every run is kept): its KV pool goes now.
        _release(recorder.inner)
    log.info("%s: %d steps in %.2f s simulated, E2E p50 %.1f ms", out_dir.name,
             len(recorder.steps), res.summary["simulated_duration_s"],
             res.summary["median_e2el_ms"])
    return res, recorder.steps


def _release(executor: Any) -> None:
    """Free an executor's KV storage if it has any to free (``RealExecutor.release``)."""
    release = getattr(executor, "release", None)
    if callable(release):
        release()


class RunSchedule:
    """The recorded runs of one validation: ``calibration_runs`` under other seeds
    (``seed + CALIBRATION_SEED_OFFSET + i``: other arrivals and prompts) and ``real_repeats``
    of the validated workload, alternating, in ``calibration/``, ``calibration_2/``... and
    ``real/``, ``real_2/``... ``run_after(r, rounds)`` runs those due after profile round r
    of ``rounds`` (spread evenly over the rounds); ``run_rest()`` any left."""

    def __init__(self, base: dict[str, Any], out_dir: Path, repeats: int,
                 calibration: int) -> None:
        seed = int(base.get("seed", 0))
        # Other arrivals and prompts, the same model: the real executor's random weights keep
        # the validated run's seed (one copy shared by every run, executors/real/weights.py).
        executor = dict(base.get("executor") or {})
        if executor.get("name") == "real" and executor.get("weight_seed") is None:
            executor["weight_seed"] = seed
        cal = [("calibration", i, {**base, "seed": seed + CALIBRATION_SEED_OFFSET + i,
                                   "executor": executor})
               for i in range(calibration)]
        real = [("real", i, base) for i in range(repeats)]
        self.jobs = [job for pair in zip(cal, real) for job in pair]
        self.jobs += cal[len(real):] + real[len(cal):]
        self.out_dir = out_dir
        self.done: dict[str, list[tuple[Any, list]]] = {"calibration": [], "real": []}

    def _run(self, k: int) -> None:
        name, i, cfg = self.jobs[k]
        self.done[name].append(real_run(cfg, self.out_dir / (name if i == 0
                                                             else f"{name}_{i + 1}")))

    def run_after(self, r: int, rounds: int) -> None:
        n = len(self.jobs)
        for k in range(n):
            due = -(-(k + 1) * rounds // (n + 1))  # ceil((k + 1) rounds / (n + 1)), 1..rounds
            if due == r and not self._is_done(k):
                self._run(k)

    def run_rest(self) -> None:
        for k in range(len(self.jobs)):
            if not self._is_done(k):
                self._run(k)

    def _is_done(self, k: int) -> bool:
        name, i, _ = self.jobs[k]
        return len(self.done[name]) > i


def validate(cfg: dict[str, Any], out_dir: Path,
             command_line: set[str] | None = None) -> ValidationResult:
    """Real runs (recorded), profile (given or fitted here), simulated run, replays.
    ``command_line``: the policy keys the command line set (``apply_policy_overrides``)."""
    opts = _options(cfg)
    base = _sim_cfg(cfg)
    apply_policy_overrides(base, opts.get("policy_overrides"), command_line)
    require(str(base["executor"].get("name")) == "real", "executor",
            "validate runs the real executor first: use executor=real (conf/validate.yaml)")
    out_dir.mkdir(parents=True, exist_ok=True)
    resolve_hardware(base, opts)
    with pinned_to(opts.get("pin_cpu")):
        saturation = choose_qps(base, opts, out_dir)
        result = _validate(cfg, base, opts, out_dir)
    result.qps = float(base["workload"]["qps"])
    result.saturation = saturation
    write_outputs(result, out_dir, base)
    return result


def _validate(cfg: dict[str, Any], base: dict[str, Any], opts: dict[str, Any],
              out_dir: Path) -> ValidationResult:
    from executors.calibration import load_profile
    from experiments.simulation import Simulation

    statistic = f"{opts.get('fit_statistic', 'median')}_s"
    schedule = RunSchedule(base, out_dir, int(opts.get("real_repeats", 1)),
                           int(opts.get("calibration_runs", 0)))
    interleave = bool(opts.get("interleave", False))
    # The profile first (or interleaved): a profiling pass after the real runs would measure
    # a warmer process.
    if opts.get("profile"):
        from workloads.base import resolve_path

        require(not interleave, "validate.interleave", "needs the profile measured here "
                                                       "(validate.profile=null)")
        profile_path = resolve_path(str(opts["profile"]), "validate.profile")
        fit = load_profile(profile_path).fit
    else:
        profile_path, fit = fit_profile_here(cfg, out_dir, statistic,
                                             schedule.run_after if interleave else None)
    shapes_fit = dict(fit)
    schedule.run_rest()
    runs = schedule.done["real"]
    real = runs[0][0]
    summaries = [r.summary for r, _ in runs]

    def simulate(profile: Path, name: str) -> Simulation:
        sim_cfg = copy.deepcopy(base)
        sim_cfg["executor"] = cost_model_section(profile, opts.get("cost_model"))
        # The same KV pools as the real run (the cost model's memory planner would size them
        # from the hardware spec, not from the real executor's device and dtype).
        sim_cfg["kv"] = {**sim_cfg["kv"], "num_gpu_blocks_override": real.memory.num_gpu_blocks,
                         "num_cpu_blocks": real.memory.num_cpu_blocks}
        return Simulation(sim_cfg, out_dir / name, keep_requests=True)

    profile_only = None
    if schedule.done["calibration"]:
        # The profile's own simulation too: what the serving steps changed.
        profile_only = simulate(profile_path, "sim_profile").run().summary
        profile_path, fit = refit_on_serving_steps(base, profile_path, out_dir,
                                                   schedule.done["calibration"], statistic,
                                                   str(opts.get("calibration_level", "median")))
    simulated = simulate(profile_path, "sim")
    sim = simulated.run()

    reps: list[Replay] = []
    replayed_runs: list[dict[str, Any]] = []
    if opts.get("replay", True):
        for res, steps in runs:
            arrivals = {r.request_id: r.arrival_time for r in res.requests}
            done = {r.request_id for r in res.requests if r.status.name == "FINISHED"}
            reps.append(replay(steps, simulated.executor, arrivals))
            replayed_runs.append(replay_summary(reps[-1], {k: arrivals[k] for k in done}, done))
    # The calibration runs' steps as the simulated profile prices them (no token times).
    calibration_reps = [replay(steps, simulated.executor, {})
                        for _, steps in schedule.done["calibration"]]
    calibration_seeds = [int(res.summary["seed"]) for res, _ in schedule.done["calibration"]]
    paired, host = pair_by_host_speed(str(opts.get("host_speed", "own")), schedule,
                                      simulated.executor, profile_path, simulate, out_dir)
    real_median = median_summary(summaries)
    replayed = median_summary(replayed_runs) if replayed_runs else None
    rows = error_table(real_median, sim.summary, replayed, summaries, replayed_runs, paired)
    if profile_only is not None:
        for row, base_row in zip(rows, error_table(real_median, profile_only, None)):
            row["sim_profile"] = base_row["sim"]
            row["sim_profile_err_pct"] = base_row["sim_err_pct"]
    return ValidationResult(rows, real_median, sim.summary, replayed, pooled(reps),
                            profile_path, fit, shapes_fit, real_runs=summaries, replays=reps,
                            calibration_replays=calibration_reps,
                            calibration_seeds=calibration_seeds, paired_runs=paired,
                            host_speed=host)


def pair_by_host_speed(mode: str, schedule: RunSchedule, executor: Any, profile_path: Path,
                       simulate: Callable[[Path, str], Any], out_dir: Path,
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``validate.host_speed`` (``experiments/host_speed.py``): simulate each real run with
    the profile scaled by the host's speed during it, priced against ``executor`` (the
    simulated profile): ``own``, its own recorded steps; ``neighbours``, the calibration runs
    just before and after it. Returns the paired runs' summaries (in real-run order)
    and what was measured (``validation.json``'s ``host_speed``)."""
    if mode == "none":
        return [], {"mode": mode}
    runs = schedule.done["real"]
    own = [speed_ratio(steps, executor) for _, steps in runs]
    cal = {i: speed_ratio(steps, executor)
           for i, (_, steps) in enumerate(schedule.done["calibration"])}
    info: dict[str, Any] = {"mode": mode, "own": own,
                            "calibration": [cal[i] for i in sorted(cal)]}
    if mode == "neighbours":
        if not cal:
            info["skipped"] = ("validate.host_speed=neighbours needs calibration runs "
                               "(validate.calibration_runs=0)")
            log.info("paired runs skipped: %s", info["skipped"])
            return [], info
        near = neighbour_speeds([(name, i) for name, i, _ in schedule.jobs], cal)
        factors = [near[i] for i in range(len(runs))]
    else:
        factors = own
    info["factors"] = factors
    summaries = []
    for i, factor in enumerate(factors):
        name = "paired/real" if i == 0 else f"paired/real_{i + 1}"
        scaled = scaled_profile(profile_path, factor,
                                out_dir / name / "hardware_profile.yaml")
        summaries.append(simulate(scaled, name).run().summary)
    log.info("paired runs (host_speed=%s): speed x%.3f to x%.3f", mode, min(factors),
             max(factors))
    return summaries, info


def pooled(reps: Sequence[Replay]) -> Replay | None:
    """Every run's steps in one ``Replay`` (step-time figures; token times are per run)."""
    if not reps:
        return None
    if len(reps) == 1:
        return reps[0]
    return Replay([s for r in reps for s in r.steps],
                  np.concatenate([r.measured for r in reps]),
                  np.concatenate([r.predicted for r in reps]))


# ---- outputs ----------------------------------------------------------------------------------
def write_outputs(result: ValidationResult, out_dir: Path, cfg: dict[str, Any]) -> None:
    import pandas as pd

    pd.DataFrame(result.rows).to_csv(out_dir / "validation.csv", index=False)
    doc: dict[str, Any] = {
        "policy": result.real.get("policy"), "model": result.real.get("model"),
        "profile": str(result.profile_path), "profile_fit": result.profile_fit,
        "shapes_fit": result.shapes_fit or result.profile_fit,
        "rows": result.rows,
        "real_repeats": max(1, len(result.real_runs)),
        # How often real_lo..real_hi covers the median of the host's runs (2 runs or more).
        "reference_coverage": (reference_order(len(result.real_runs))[1]
                               if len(result.real_runs) >= 2 else None),
        "real_runs": [{k: s.get(k) for k in RUN_KEYS} for s in result.real_runs],
        # Each real run simulated at its time's host speed (experiments/host_speed.py).
        "host_speed": result.host_speed,
        "paired_runs": [{k: s.get(k) for k in RUN_KEYS} for s in result.paired_runs],
        "real_num_preemptions": result.real.get("num_preemptions"),
        "sim_num_preemptions": result.sim.get("num_preemptions"),
        "real_num_steps": result.real.get("num_steps"),
        "sim_num_steps": result.sim.get("num_steps"),
        "real_simulated_duration_s": result.real.get("simulated_duration_s"),
        "real_wall_time_s": result.real.get("wall_time_s"),
        "device": result.real.get("hardware"),  # what the real executor ran on
        "hardware": cfg.get("hardware", {}).get("name"),  # the spec the simulation used
        "qps": result.qps,
        "qps_mode": "auto" if result.saturation is not None else "workload.qps",
        "saturation": result.saturation.as_dict() if result.saturation is not None else None,
    }
    if result.replays:
        doc["replay_runs"] = [{"steps": len(r.measured), "step_mape_pct": r.step_mape(),
                               "busy_error_pct": r.busy_error()} for r in result.replays]
    if result.replay is not None:
        rp = result.replay
        doc.update({"replay_steps": len(rp.measured), "replay_step_mape_pct": rp.step_mape(),
                    "replay_busy_error_pct": rp.busy_error(),
                    "replay_busy_measured_s": float(rp.measured.sum()),
                    "replay_busy_predicted_s": float(rp.predicted.sum())})
    (out_dir / "validation.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    if result.replays:
        frames = [replay_frame(r).assign(run=i + 1) for i, r in enumerate(result.replays)]
        pd.concat(frames, ignore_index=True).to_csv(out_dir / "replay_steps.csv", index=False)
    if result.calibration_replays:
        frames = [replay_frame(r).assign(run=i + 1, seed=seed) for i, (r, seed) in
                  enumerate(zip(result.calibration_replays, result.calibration_seeds))]
        pd.concat(frames, ignore_index=True).to_csv(out_dir / "calibration_steps.csv",
                                                    index=False)
    (out_dir / "validation.html").write_text(_page(result, out_dir))


def replay_frame(rep: Replay) -> Any:
    """One row per recorded step: its shape, measured and predicted seconds."""

    import pandas as pd

    df = pd.DataFrame([s.shape._asdict() for s in rep.steps])
    df["measured_s"] = rep.measured
    df["predicted_s"] = rep.predicted
    df["error_pct"] = 100.0 * rep.step_errors
    return df


def _page(result: ValidationResult, out_dir: Path) -> str:
    import html

    import pandas as pd
    import plotly.graph_objects as go

    from sim.report import html_page, latency_cdf_figure

    frames = {"real": pd.read_csv(out_dir / "real" / "requests.csv")}
    for i in range(2, len(result.real_runs) + 1):
        frames[f"real {i}"] = pd.read_csv(out_dir / f"real_{i}" / "requests.csv")
    frames["simulated"] = pd.read_csv(out_dir / "sim" / "requests.csv")
    if result.replays:
        frames["replayed"] = _replayed_requests(result.replays[0], frames["real"])
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
            with exit_on_config_error():
                keys = command_line_policy_keys(HydraConfig.get().overrides.task)
                result = validate(OmegaConf.to_container(cfg, resolve=True), out_dir, keys)
        except Exception as e:
            # On a remote GPU the traceback may scroll away: say what failed and where the
            # finished runs are (each run's folder is complete once its summary.json exists).
            print(f"validate failed: {type(e).__name__}: {e}\nfinished runs so far: {out_dir}",
                  file=sys.stderr)
            raise
        print(f"{result.real.get('policy')} (enable_chunked_prefill="
              f"{cfg.policy.get('enable_chunked_prefill')}), {result.real.get('completed'):.0f} "
              f"requests at {result.qps:.2f} req/s on {result.real.get('hardware')} "
              f"(kv.num_gpu_blocks_override={result.real.get('kv_num_gpu_blocks', 0):.0f}), preemptions real "
              f"{[r.get('num_preemptions') for r in result.real_runs]} sim "
              f"{result.sim.get('num_preemptions')}")
        print(format_table(result))
        print(f"outputs: {out_dir}")

    _main()


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
