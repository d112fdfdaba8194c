"""Gathers a multirun sweep of the main job (``python -m experiments.run -m ...``) into one
table when the sweep ends (a Hydra callback, ``hydra.callbacks.gather_sweep``).

Each job's folder holds its ``summary.json``, or ``failed.json`` when the job failed (a config
error or a write error: the job's one-line message went to stderr and its ``run.log``; the
other jobs still ran). ``sweep.csv`` and ``sweep.md`` in the sweep folder get one row per job:
its number, the values it swept (the overrides that differ between jobs), its status and its
headline figures. The table is printed;
if any job failed the command exits 1.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.common import markdown_table
from sim.outputs import write_atomic

# The headline figures of each job's summary.json, in table order.
FIGURES = ("completed", "rejected", "request_throughput", "request_goodput", "output_throughput",
           "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms",
           "num_preemptions")


def gather(sweep_dir: Path) -> pd.DataFrame:
    """One row per job folder of ``sweep_dir`` (numbered subfolders), in job order."""
    rows: list[dict[str, Any]] = []
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                  key=lambda p: int(p.name))
    for job in jobs:
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = (list(OmegaConf.load(overrides_file)) if overrides_file.exists() else [])
        row: dict[str, Any] = {"job": int(job.name)}
        row.update(o.split("=", 1) for o in map(str, overrides) if "=" in o)
        summary, failed = job / "summary.json", job / "failed.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            row["status"] = s.get("status", "complete")
            row.update({k: s.get(k) for k in FIGURES})
        else:
            row["status"] = "failed"
            if failed.exists():
                row["error"] = json.loads(failed.read_text()).get("error")
        rows.append(row)
    table = pd.DataFrame(rows)
    # The override columns whose value is the same in every job say nothing about the sweep.
    fixed = [c for c in table.columns[1:table.columns.get_loc("status")]
             if table[c].nunique(dropna=False) == 1] if "status" in table else []
    return table.drop(columns=fixed) if len(table) > 1 else table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


class GatherSweep(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        table = gather(sweep_dir)
        if table.empty:
            return
        write_atomic(sweep_dir / "sweep.csv", table.to_csv(index=False))
        text = markdown_table([{k: _cell(v) for k, v in r.items()}
                               for r in table.to_dict("records")])
        write_atomic(sweep_dir / "sweep.md", text + "\n")
        print(f"\nsweep: {len(table)} jobs -> {sweep_dir / 'sweep.csv'}\n{text}")
        failed = int((table["status"] == "failed").sum())
        if failed:
            print(f"{failed} of {len(table)} jobs failed (their errors: the error column, and "
                  f"each job's run.log)", file=sys.stderr)
            raise SystemExit(1)
