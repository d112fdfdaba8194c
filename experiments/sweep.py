"""Gathers a multirun sweep of the main job (``python -m experiments.run -m ...``) into one
table when the sweep ends (a Hydra callback, ``hydra.callbacks.gather_sweep``).

Each job's folder holds its ``summary.json``, or ``failed.json`` when the job failed (a config
error or a write error: the job's one-line message went to stderr and its ``run.log``; the
other jobs still ran). In the sweep folder:

* ``sweep.csv``: one row per job: its number, the values it swept (the overrides that differ
  between jobs), its status, its ``error`` (empty unless it failed), then every key of its
  summary.json (nested ones as JSON text);
* ``sweep.md``: the same rows with the headline figures only, as printed;
* ``sweep.html``: the ``objective`` figure against each swept key.

If any job failed the command exits 1. Works with any launcher (``hydra/launcher=joblib`` or
``ray`` run the jobs in parallel): the jobs' folders are all it reads.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from sim.errors import ConfigError
from sim.outputs import write_atomic
from sim.report_options import report_options

# pandas, plotly and the simulator are imported where a sweep is gathered, not at start-up:
# Hydra makes this callback for every run of the main job, most of which are no sweep.
if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

#: The figure a job returns and sweep.html draws when ``objective`` is not set.
DEFAULT_OBJECTIVE = "p99_ttft_ms"
# The headline figures of each job's summary.json, in table order.
FIGURES = ("completed", "rejected", "request_throughput", "request_goodput", "output_throughput",
           "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms",
           "num_preemptions")


def gather(sweep_dir: Path) -> pd.DataFrame:
    """One row per job folder of ``sweep_dir`` (numbered subfolders), in job order."""
    import pandas as pd

    heads: list[dict[str, Any]] = []  # job, overrides, status, error
    figures: list[dict[str, Any]] = []  # the job's summary.json but its status
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                  key=lambda p: int(p.name))
    for job in jobs:
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = (list(OmegaConf.load(overrides_file)) if overrides_file.exists() else [])
        head: dict[str, Any] = {"job": int(job.name)}
        head.update(o.split("=", 1) for o in map(str, overrides) if "=" in o)
        head["status"], head["error"] = "failed", ""
        summary, failed = job / "summary.json", job / "failed.json"
        s: dict[str, Any] = {}
        if summary.exists():
            s = json.loads(summary.read_text())
            head["status"] = s.pop("status", "complete")
        elif failed.exists():
            head["error"] = json.loads(failed.read_text()).get("error") or ""
        heads.append(head)
        figures.append({k: json.dumps(v) if isinstance(v, (dict, list)) else v
                        for k, v in s.items()})
    table = pd.DataFrame(heads)
    # The override columns whose value is the same in every job say nothing about the sweep.
    if len(table) > 1:
        table = table.drop(columns=[c for c in table.columns[1:table.columns.get_loc("status")]
                                    if table[c].nunique(dropna=False) == 1])
    # A swept key that is also a summary key (``policy``) keeps its override column.
    rest = pd.DataFrame(figures, index=table.index)
    return pd.concat([table, rest.drop(columns=[c for c in rest if c in table])], axis=1)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def swept_keys(table: pd.DataFrame) -> list[str]:
    """The override columns ``gather`` kept: those between ``job`` and ``status``."""
    return list(table.columns[1:table.columns.get_loc("status")])


def _axis(values: pd.Series) -> pd.Series:
    """Swept values as numbers where they all are (a numeric axis), else as text."""
    import pandas as pd

    numbers = pd.to_numeric(values, errors="coerce")
    return numbers if numbers.notna().all() else values.astype(str)


def sweep_figure(table: pd.DataFrame, objective: str) -> go.Figure:
    """``objective`` against each swept key, one panel per key; with two or more keys, each
    panel has one line per value of the first other key."""
    import pandas as pd
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = swept_keys(table) or ["job"]
    y = pd.to_numeric(table.get(objective, pd.Series(index=table.index, dtype=float)),
                      errors="coerce")
    fig = make_subplots(rows=len(keys), cols=1, subplot_titles=[
        f"{objective} against {k}" for k in keys], vertical_spacing=0.3 / len(keys))
    for i, key in enumerate(keys, start=1):
        others = [k for k in keys if k != key]
        axis = _axis(table[key])
        lines = [("", table.index)]
        if others:  # one line per value of the first other key, in its axis order
            by = _axis(table[others[0]])
            lines = [(v, by.index[by == v]) for v in sorted(by.unique())]
        for value, rows in lines:
            x = axis[rows]
            order = x.sort_values().index
            fig.add_trace(go.Scatter(
                x=x[order], y=y[order], mode="lines+markers",
                name=f"{others[0]}={value}" if others else objective,
                legendgroup=f"{i}", legendgrouptitle_text=(
                    f"panel {i}: by {others[0]}" if others else None),
                hovertext=[f"job {j}" for j in table.loc[order, "job"]]), i, 1)
        fig.update_xaxes(title_text=key, row=i, col=1)
        fig.update_yaxes(title_text=objective, tickformat=",~r", row=i, col=1)
    fig.update_layout(height=360 * len(keys), title=f"Sweep: {objective}",
                      legend={"groupclick": "toggleitem"})
    return fig


class GatherSweep(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments.common import markdown_table
        from sim.report import write_page

        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        table = gather(sweep_dir)
        if table.empty:
            return
        write_atomic(sweep_dir / "sweep.csv", table.to_csv(index=False))
        shown = [c for c in table.columns if c in ("job", "status", "error", *swept_keys(table),
                                                   *FIGURES)]
        if not (table["error"] != "").any():
            shown.remove("error")
        text = markdown_table([{k: _cell(v) for k, v in r.items()}
                               for r in table[shown].to_dict("records")])
        write_atomic(sweep_dir / "sweep.md", text + "\n")
        objective = str(config.get("objective") or DEFAULT_OBJECTIVE)
        try:  # the jobs' reports and this page share the sweep folder's plotly.min.js
            plotly_js = report_options(config.get("report")).plotly_js
        except ConfigError:  # every job has already failed on it
            plotly_js = "inline"
        write_page(sweep_dir / "sweep.html", f"Sweep of {len(table)} jobs",
                   [sweep_figure(table, objective)],
                   f"<p>{sweep_dir}: the table is sweep.csv</p>", plotly_js)
        print(f"\nsweep: {len(table)} jobs -> {sweep_dir / 'sweep.csv'}\n{text}")
        failed = int((table["status"] == "failed").sum())
        if failed:
            print(f"{failed} of {len(table)} jobs failed (their errors: the error column, and "
                  f"each job's run.log)", file=sys.stderr)
            raise SystemExit(1)
