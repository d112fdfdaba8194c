"""Helpers the experiment scripts share: run one in-memory simulation from a config dict with
overrides, and score requests against latency SLOs."""

from __future__ import annotations

import copy
import csv
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from experiments.simulation import Simulation, SimulationResult
from sim.errors import ConfigError, exit_on_config_error
from sim.progress import job_bar
from sim.request import Request, RequestStatus

log = logging.getLogger("experiments")


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``override`` merged in (mappings recursively)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def simulate(cfg: dict[str, Any]) -> SimulationResult:
    """One full simulation, nothing written to disk, finished/rejected requests kept."""
    cfg = {**cfg, "progress": False}
    return Simulation(cfg, None, keep_requests=True).run()


def slo_attainment(requests: Iterable[Request], total: int, ttft_s: float, tpot_s: float) -> float:
    """DistServe's attainment: the fraction of all ``total`` requests that finished with
    TTFT <= ``ttft_s`` and TPOT <= ``tpot_s`` (a one-token output has no TPOT and meets it);
    rejected requests miss."""
    ok = 0
    for r in requests:
        if r.status is not RequestStatus.FINISHED:
            continue
        tpot = r.tpot
        if r.ttft <= ttft_s and (tpot is None or tpot <= tpot_s):
            ok += 1
    return ok / total


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` (dicts with the same keys) as a CSV file with a header."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_tables(out_dir: Path, runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """``runs.csv`` (one row per simulation), ``results.csv`` and ``results.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "runs.csv", runs)
    write_csv(out_dir / "results.csv", rows)
    (out_dir / "results.md").write_text(markdown_table(rows) + "\n")


def validation_files(folder: Path, names: Sequence[str], what: str) -> list[Path]:
    """``folder``'s files ``names`` (relative paths), all present, or a config error naming
    the first missing: ``folder`` is not ``what`` (a saved / finished validation)."""
    paths = [folder / name for name in names]
    for name, path in zip(names, paths):
        if not path.is_file():
            raise ConfigError("folder", f"{folder} is not {what}: {name} is missing "
                              "(experiments/validate.py writes it)")
    return paths


def markdown_table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def run_hydra_experiment(cfg: DictConfig,
                         run: Callable[[dict[str, Any], Path], list[dict[str, Any]]]) -> None:
    """The body of an experiment's Hydra main: run it into Hydra's output folder, print the
    table, and turn a config error into a one-line message and exit code 2."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    out = Path(HydraConfig.get().runtime.output_dir)
    with exit_on_config_error():
        rows = run(container, out)
    # Logged: to the console and to the folder's run.log.
    log.info(markdown_table(rows))
    log.info(f"outputs: {out}")


def run_jobs(fn: Callable[[Any], dict[str, Any]], jobs: list[Any],
             workers: int, progress: bool = True) -> list[dict[str, Any]]:
    """``fn`` over ``jobs``, in ``workers`` processes when more than one; the results in job
    order. A progress bar on stderr (``progress``) and a log line per finished job
    (``[k/n] jobs done, ... s``, in run.log too) show how far it got."""
    n, t0 = len(jobs), time.perf_counter()
    results: list[dict[str, Any]] = [{}] * n
    # Log lines are written above the bar, not through it.
    with job_bar(n, progress) as bar, logging_redirect_tqdm():

        def finished(k: int) -> None:
            bar.update(1)
            log.info("[%d/%d] jobs done, %.0f s", k, n, time.perf_counter() - t0)

        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                index = {pool.submit(fn, j): i for i, j in enumerate(jobs)}
                for k, future in enumerate(as_completed(index), start=1):
                    results[index[future]] = future.result()
                    finished(k)
            return results
        for i, job in enumerate(jobs):
            results[i] = fn(job)
            finished(i + 1)
    return results
