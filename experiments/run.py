"""The main job: one simulation configured by Hydra.

    python -m experiments.run                       # the embedded default
    python -m experiments.run policy=fcfs hardware=h100_sxm model=llama3_70b \
        cluster.tensor_parallel_size=4 workload.qps=8 workload.num_requests=500
    python -m experiments.run -m workload.qps=2,4,8  # a multirun sweep

Writes requests.csv, steps.csv, summary.json and report.html into Hydra's output folder, each
under a ``.partial`` name until it is complete. With the cost model, summary.json carries a
90% interval beside each headline figure (experiments/intervals.py: two more runs at the ends
of the cost model's measured step-time error). A folder that holds another run's outputs is
refused unless ``overwrite=true``. SIGINT or SIGTERM stops the run at once: the rows so far
and a summary marked ``"status": "interrupted"`` are kept, and the process exits 130 / 143
with one line. A file that cannot be written ends the run with one line naming it (exit 1); a
bad config value, trace file or override (one Hydra refuses too) with one ``config error:``
line (exit 2).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.hydra_errors import hydra_errors_as_config_errors
from experiments.intervals import HEADLINE
from experiments.sweep import DEFAULT_OBJECTIVE
from sim import stop as sim_stop
from sim.errors import ConfigError, RunInterrupted, exit_on_config_error, exit_with, require
from sim.outputs import PARTIAL, write_atomic

log = logging.getLogger(__name__)

# What a run writes into its folder; finding any of them there means another run's outputs.
OUTPUT_FILES = ("summary.json", "requests.csv", "steps.csv", "report.html")
LOCK = ".run.lock"  # held while a run writes into the folder


def claim_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Make ``out_dir`` this run's alone: refuse a folder holding another run's outputs (or
    one being written by a run now) unless ``overwrite``, which clears them first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(p.name for p in out_dir.iterdir()
                   if p.name in OUTPUT_FILES or p.name.endswith(PARTIAL) or p.name == LOCK)
    if found and not overwrite:
        busy = " (a run is writing there now)" if LOCK in found else ""
        raise ConfigError("hydra.run.dir", (
            f"{out_dir} holds another run's outputs ({', '.join(found)}){busy}; choose another "
            f"folder or set overwrite=true"))
    for name in found:
        if name != LOCK:
            (out_dir / name).unlink()
    flags = os.O_CREAT | os.O_WRONLY | (0 if overwrite else os.O_EXCL)
    try:
        os.close(os.open(out_dir / LOCK, flags))
    except FileExistsError:  # another run claimed it a moment ago
        raise ConfigError("hydra.run.dir", f"{out_dir}: another run is writing there now; "
                          f"choose another folder") from None


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM ask the run to stop where its state is whole (``sim.stop``); it
    then raises ``RunInterrupted``, keeping what it wrote. A second signal stops it at once."""
    def request_stop(signum: int, frame: object) -> None:
        if sim_stop.requested:  # now, wherever the run is: its files stay .partial
            raise KeyboardInterrupt
        sim_stop.requested = signum

    before = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        sim_stop.requested = 0
        for s, handler in before.items():
            signal.signal(s, handler)


#: The summary.json figures a job may return as its ``objective``: the headline figures, their
#: error bars' ends, and the run's counts (tests/test_sweep.py checks that runs write each).
OBJECTIVES: tuple[str, ...] = (
    *HEADLINE, *(f"{k}_{end}" for k in HEADLINE for end in ("lo", "hi")),
    *(f"std_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")),
    "completed", "rejected", "num_preemptions", "num_swaps", "num_recomputes", "kv_peak_usage",
    "prefix_cache_hit_rate", "kv_offload_hit_rate", "total_input_tokens", "total_output_tokens")


def objective_name(cfg: dict) -> str:
    """The ``objective`` config value, checked before any job runs."""
    name = cfg.get("objective") or DEFAULT_OBJECTIVE
    require(name in OBJECTIVES, "objective",
            f"{name!r} is not a figure a job can return; known: {', '.join(OBJECTIVES)}")
    return str(name)


def objective_value(summary: dict, name: str) -> float:
    """The summary figure ``name`` (an ``OBJECTIVES`` entry), as the number an optimizing
    sweeper minimizes or maximizes: NaN for a job that failed or a figure with no value (a
    goodput without SLOs, error bars turned off)."""
    value = summary.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def run(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return run_job(cfg)
    # In a sweep a failed job (its one line already printed) is recorded and the others run;
    # experiments/sweep.py gathers every job's outcome when the sweep ends.
    try:
        return run_job(cfg)
    except (SystemExit, Exception) as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        code = e.code if isinstance(e, SystemExit) else 1
        error = (getattr(e, "message", None) or f"exit code {code}" if isinstance(e, SystemExit)
                 else f"{type(e).__name__}: {e}")
        out_dir = Path(hc.runtime.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / "failed.json", json.dumps(
            {"overrides": list(hc.overrides.task), "exit_code": code, "error": error}) + "\n")
        print(f"job {hc.job.num} ({' '.join(hc.overrides.task)}) failed: {error}; the sweep "
              f"goes on", file=sys.stderr)
        return {}


def resolved(cfg: DictConfig) -> dict:
    """``cfg`` as plain data with its interpolations resolved; one that does not resolve is a
    ``ConfigError`` on its key."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(getattr(e, "full_key", None) or "config",
                          str(e).strip().splitlines()[0]) from None


def run_job(cfg: DictConfig) -> dict:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    # A sweep's reports share one plotly.min.js on disk, kept in the sweep's folder.
    js_dir = (Path(HydraConfig.get().sweep.dir) if HydraConfig.get().mode == RunMode.MULTIRUN
              else None)
    with exit_on_config_error():
        container = resolved(cfg)
        objective_name(container)
        claim_output_dir(out_dir, bool(container.get("overwrite", False)))
    try:
        # Imported here, not at start-up: the simulator, pandas and plotly take about a second
        # to import, and a command refused by Hydra, by the checks above or by the config's
        # own check needs none of them (pandas and plotly: the report's).
        from experiments.intervals import ErrorBarsConfig, step_time_interval, with_intervals
        from experiments.simulation import Simulation

        with exit_on_config_error():
            sim = Simulation(container, out_dir)
            bars = step_time_interval(container, ErrorBarsConfig.from_dict(
                container.get("error_bars")))
        from sim.report import format_summary, write_report

        result = None
        try:
            with stop_on_signals(), exit_on_config_error():
                result = sim.run()
                if bars is not None:
                    result.summary = with_intervals(container, result.summary)
                    sim.write_summary(result.summary)
            write_report(out_dir, result.summary, sim.report, js_dir)
        except RunInterrupted as e:
            if result is None:
                print(f"interrupted by {e}: the rows so far and summary.json (status "
                      f"\"interrupted\") are in {out_dir}", file=sys.stderr)
            else:  # during the error bars' runs: the run itself is whole
                write_report(out_dir, result.summary, sim.report, js_dir)
                print(f"interrupted by {e} during the error bars' runs: the run's outputs, "
                      f"without intervals, are in {out_dir}", file=sys.stderr)
            # Everything is written and closed: leave now, without tearing down a large
            # run's objects one by one (seconds for millions of requests).
            (out_dir / LOCK).unlink(missing_ok=True)
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(128 + e.signum)
        except OSError as e:
            exit_with(1, f"write error: {e.filename or out_dir}: {e.strerror or e}")
    finally:
        (out_dir / LOCK).unlink(missing_ok=True)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # which of the sweep's jobs this summary is
        log.info("job %d: %s", hc.job.num, " ".join(hc.overrides.task))
    # Logged: to the console and to the folder's run.log.
    log.info(format_summary(result.summary))
    log.info(f"outputs: {out_dir}")
    return result.summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """One job; returns its ``objective`` figure (what Hydra's optimizing sweepers read)."""
    summary = run(cfg)
    # Checked before the job ran: a sweep's refused job returns NaN here, not an error.
    return objective_value(summary, str(cfg.get("objective") or DEFAULT_OBJECTIVE))


if __name__ == "__main__":
    with hydra_errors_as_config_errors():
        main()
