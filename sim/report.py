"""The run's human-facing outputs: a short text summary and an offline plotly page.

Pages load plotly.js either from ``plotly.min.js`` written once into their folder
(``report.plotly_js=directory``, the default) or carry it inline (``inline``). Figures use
thousands separators and never exponent notation, one colour per curve label (plotly's Dark24,
then dashes), and a legend per panel.
"""

from __future__ import annotations

import html
import math
import os
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from sim.outputs import PARTIAL, write_atomic
from sim.report_options import PLOTLY_JS_MODES, ReportOptions

MAX_POINTS = 600  # per curve: keeps the page small for million-request runs
PLOTLY_JS_FILE = "plotly.min.js"  # beside the pages that load it (report.plotly_js=directory)
PALETTE = tuple(qualitative.Dark24)
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
HOVER_FORMAT = ",.4~r"  # d3: 4 significant digits, thousands separators, never an exponent


def format_summary(s: dict[str, Any]) -> str:
    par = f"TP{s.get('tensor_parallel_size', 1)}"
    if s.get("pipeline_parallel_size", 1) > 1:
        par += f" PP{s['pipeline_parallel_size']}"
    if "cluster" in s:  # cluster runs only
        par += f", {s['cluster']} x{s['num_replicas']}"
    head = (f"{s.get('model')} on {s.get('hardware')} ({par}), "
            f"policy {s.get('policy')}, executor {s.get('executor')}")
    lines = [head,
             (f"  completed {s['completed']}  rejected {s['rejected']}  preemptions "
              f"{s['num_preemptions']}  steps {s.get('num_steps', 0)}"),
             (f"  throughput {s['request_throughput']:.2f} req/s  {s['output_throughput']:.0f} "
              f"out tok/s  {s['total_token_throughput']:.0f} tok/s"),
             f"  {'metric':<6} {'mean':>10} {'median':>10} {'p90':>10} {'p99':>10}  (ms)"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"  {m:<6} " + " ".join(
            f"{s[f'{k}_{m}_ms']:>10.1f}" for k in ("mean", "median", "p90", "p99")))
    pools = _pools(s)
    blocks = (f"{s['kv_num_gpu_blocks']} blocks x {s['kv_block_size']} tokens" if len(pools) < 2
              else f"{s['kv_block_size']}-token blocks (per pool below)")
    lines.append(f"  KV: {blocks}, peak "
                 f"usage {100 * s['kv_peak_usage']:.1f}%;  simulated {s['simulated_duration_s']:.1f} s "
                 f"in {s['wall_time_s']:.2f} s wall")
    if s.get("enable_prefix_caching"):
        lines.append(f"  prefix cache: hit rate {100 * s['prefix_cache_hit_rate']:.1f}% "
                     f"({s['prefix_cache_hits']} of {s['prefix_cache_queries']} prompt tokens), "
                     f"{s['kv_evictions']} evictions")
    if s.get("kv_num_offload_blocks"):
        lines.append(f"  offload tier: {s['kv_num_offload_blocks']} blocks, "
                     f"{s['kv_offload_stores']} stored, {s['kv_offload_loads']} loaded "
                     f"(hit rate {100 * s['kv_offload_hit_rate']:.1f}% of prompt tokens)")
    if len(pools) > 1:  # the head names the first pool's hardware only
        lines.append("  pools: " + ", ".join(
            f"{n} {role} on {hw} (TP{tp}{f' PP{pp}' if pp > 1 else ''}, {kv} KV blocks)"
            for (role, hw, tp, pp, kv), n in pools.items()))
    intervals = format_intervals(s)
    if intervals:
        lines.append(intervals)
    return "\n".join(lines)


def format_intervals(s: dict[str, Any]) -> str | None:
    """The error bars' line of a summary (p90 latencies and output throughput with their
    intervals), or None for a summary without them."""
    if "error_bars_level" not in s:
        return None

    def span(key: str, unit: str, digits: int = 1) -> str:
        return (f"{key.removesuffix('_ms')} [{s[f'{key}_lo']:,.{digits}f}, "
                f"{s[f'{key}_hi']:,.{digits}f}]{unit}")

    figures = [span(k, " ms") for k in ("p90_ttft_ms", "p90_tpot_ms", "p90_e2el_ms")
               if f"{k}_lo" in s]
    if "output_throughput_lo" in s:
        figures.append(span("output_throughput", " tok/s", 0))
    return (f"  {s['error_bars_level']:.0%} intervals (step time x{s['error_bars_step_time_lo']:.3f}"
            f"..x{s['error_bars_step_time_hi']:.3f}, {s['error_bars_source']}): "
            + ", ".join(figures))


def _pools(s: dict[str, Any]) -> dict[tuple[Any, ...], int]:
    """Replicas of a cluster run grouped by (role, hardware, TP, PP, KV blocks), counted."""
    pools: dict[tuple[Any, ...], int] = {}
    for r in s.get("replicas", []):
        key = (r["role"], r["hardware"], r["tensor_parallel_size"], r["pipeline_parallel_size"],
               r["kv_num_gpu_blocks"])
        pools[key] = pools.get(key, 0) + 1
    return pools


def line_style(i: int) -> dict[str, str]:
    """The line of the ``i``-th labelled curve: a colour of its own for the first 24 labels,
    then the colours again with another dash, so no two labels share a line."""
    return {"color": PALETTE[i % len(PALETTE)],
            "dash": DASHES[(i // len(PALETTE)) % len(DASHES)]}


def format_number(x: Any) -> str:
    """A table cell: integers with thousands separators, other numbers to 4 significant digits
    in plain decimals (``10,470``, ``27.04``, ``0.0234``); never exponent notation."""
    if x is None or isinstance(x, (bool, np.bool_)) or not isinstance(x, (Real, np.number)):
        return "" if x is None else str(x)
    v = float(x)
    if math.isnan(v):
        return ""
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(x, (Integral, np.integer)) or v.is_integer():
        return f"{int(v):,}"
    decimals = min(12, max(0, 3 - math.floor(math.log10(abs(v)))))
    text = f"{v:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def readable_axes(fig: go.Figure) -> go.Figure:
    """Every axis: plain numbers with thousands separators (``20,000``, not ``2e+4`` or
    ``20k``), hover values to 4 significant digits."""
    for update in (fig.update_xaxes, fig.update_yaxes):
        update(exponentformat="none", separatethousands=True, hoverformat=HOVER_FORMAT,
               automargin=True)
    return fig


def _legend_below(fig: go.Figure, entries: int, title: str = "") -> None:
    """A horizontal legend under the plot: long label lists wrap instead of being cut."""
    fig.update_layout(legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -0.22,
                              "yanchor": "top", "title": {"text": title}})
    fig.update_layout(height=(fig.layout.height or 420) + 24 * math.ceil(entries / 6))


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(values[~np.isnan(values)])
    if len(v) == 0:
        return v, v
    q = np.linspace(0, 1, min(len(v), MAX_POINTS))
    return np.quantile(v, q), q


def latency_cdf_figure(frames: dict[str, pd.DataFrame], title: str = "Latency CDFs") -> go.Figure:
    """One subplot per metric (TTFT, TPOT, E2E), one curve per labelled requests table: each
    label keeps its line in all three, and one legend below names them (clicking an entry
    hides the label everywhere). A single table needs no legend."""
    metrics = [("ttft", "Time to first token", "TTFT (s)"),
               ("tpot", "Time per output token", "TPOT (s)"),
               ("e2e_latency", "End-to-end latency", "E2E latency (s)")]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[m[1] for m in metrics],
                        horizontal_spacing=0.07)
    for i, (label, df) in enumerate(frames.items()):
        done = df[df["status"] == "finished"]
        for col, (metric, _, axis) in enumerate(metrics, start=1):
            x, y = _cdf(pd.to_numeric(done[metric], errors="coerce").to_numpy(dtype=float))
            fig.add_trace(go.Scatter(
                x=x, y=y, name=label, legendgroup=label, showlegend=col == 1, mode="lines",
                line=line_style(i),
                hovertemplate=(f"{html.escape(label)}<br>{axis[:-4]} %{{x:,.4~r}} s<br>"
                               f"%{{y:.1%}} of requests<extra></extra>")), row=1, col=col)
    for col, (_, _, axis) in enumerate(metrics, start=1):
        fig.update_xaxes(title_text=axis, row=1, col=col)
        fig.update_yaxes(title_text="share of finished requests", range=[0, 1.02],
                         tickformat=".0%", row=1, col=col)
    fig.update_layout(title=title, height=420, showlegend=len(frames) > 1,
                      margin={"t": 80})
    readable_axes(fig)
    if len(frames) > 1:
        _legend_below(fig, len(frames))
    return fig


def _panel_legends(fig: go.Figure, rows: int) -> None:
    """A legend beside each row's panel, at its top, listing that panel's curves only."""
    for r in range(1, rows + 1):
        top = fig.layout[f"yaxis{r if r > 1 else ''}"].domain[1]
        fig.layout[f"legend{r if r > 1 else ''}"] = {
            "x": 1.01, "xanchor": "left", "y": top, "yanchor": "top",
            "bgcolor": "rgba(255,255,255,0.6)"}


def timeline_figure(steps: pd.DataFrame) -> go.Figure:
    """The run over simulated time, one panel per quantity, each on its own scale with its own
    legend: token throughput, running requests, waiting and swapped requests, KV usage, and
    prefill and decode tokens per step (apart: a prefill step is often 100x a decode step)."""
    panels = [("Token throughput", "tokens/s"),
              ("Running requests (mean over each interval)", "requests"),
              ("Waiting and swapped-out requests (mean over each interval)", "requests"),
              ("KV cache usage (peak in each interval)", "% of GPU KV blocks"),
              ("Prefill tokens per step (mean over each interval)", "tokens/step"),
              ("Decode tokens per step (mean over each interval)", "tokens/step")]
    rows = len(panels)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[p[0] for p in panels])
    if len(steps):
        # The latest step's end (replicas' rows need not come in time order).
        end = float((steps["time"] + steps["duration"]).max())
        bins = np.linspace(0.0, max(end, 1e-9), min(len(steps), MAX_POINTS) + 1)
        idx = np.clip(np.searchsorted(bins, steps["time"].to_numpy(), side="right") - 1, 0,
                      len(bins) - 2)
        g = steps.groupby(idx)
        width = np.diff(bins)[g.size().index]
        t = bins[:-1][g.size().index]
        curves = [
            (1, "output tokens/s", g["sampled"].sum() / width, 0, {}),
            (1, "prefill + decode tokens/s",
             (g["prefill_tokens"].sum() + g["decode_tokens"].sum()) / width, 1, {}),
            (2, "running", g["num_running"].mean(), 2, {}),
            (3, "waiting", g["num_waiting"].mean(), 3, {"width": 3}),
            (3, "swapped out", g["num_swapped"].mean(), 4, {"dash": "dash"}),
            (4, "KV usage (peak)", 100 * g["kv_usage"].max(), 10, {}),
            (5, "prefill tokens/step", g["prefill_tokens"].mean(), 7, {}),
            (6, "decode tokens/step", g["decode_tokens"].mean(), 6, {}),
        ]
        for row, name, y, colour, line in curves:
            if row == 3 and not y.any():  # drawn under the other line: say so
                name += " (0 throughout)"
            legend = f"legend{row if row > 1 else ''}"
            fig.add_trace(go.Scatter(
                x=t, y=y, name=name, mode="lines", legend=legend,
                line={"color": PALETTE[colour], "width": 1.5, **line},
                fill="tozeroy" if row >= 5 else None), row=row, col=1)
    for r, (_, unit) in enumerate(panels, start=1):
        fig.update_yaxes(title_text=unit, rangemode="tozero", row=r, col=1)
        fig.update_xaxes(title_text="simulated time (s)", showticklabels=True, row=r, col=1)
    fig.update_yaxes(range=[0, 100], row=4, col=1)
    fig.update_layout(height=280 * rows, title="Over simulated time", hovermode="x unified",
                      margin={"t": 80})
    _panel_legends(fig, rows)
    return readable_axes(fig)


def prefix_cache_figure(requests: pd.DataFrame) -> go.Figure:
    """The share of prompt tokens the prefix cache supplied, by the time requests were
    first scheduled: per time bin and cumulative (``num_cached_tokens / prompt_len``; a
    request preempted by recompute counts its last admission)."""
    fig = go.Figure()
    df = requests[requests["status"] == "finished"].copy()
    df["at"] = pd.to_numeric(df["first_scheduled_time"], errors="coerce")
    df = df.dropna(subset=["at"]).sort_values("at")
    if len(df):
        at = df["at"].to_numpy(dtype=float)
        hits = df["num_cached_tokens"].to_numpy(dtype=float)
        prompts = df["prompt_len"].to_numpy(dtype=float)
        bins = np.linspace(at[0], max(at[-1], at[0] + 1e-9), min(len(df), 200) + 1)
        idx = np.clip(np.searchsorted(bins, at, side="right") - 1, 0, len(bins) - 2)
        per_hit = np.bincount(idx, hits, len(bins) - 1)
        per_query = np.bincount(idx, prompts, len(bins) - 1)
        keep = per_query > 0
        fig.add_trace(go.Scatter(x=bins[:-1][keep], y=100 * per_hit[keep] / per_query[keep],
                                 name="per interval", mode="lines", line=line_style(0)))
        fig.add_trace(go.Scatter(x=at, y=100 * np.cumsum(hits) / np.cumsum(prompts),
                                 name="cumulative", mode="lines",
                                 line={**line_style(3), "width": 3}))
    fig.update_layout(title="Prefix cache hit rate (by admission time)", height=380,
                      yaxis={"title": "% of prompt tokens from the cache", "range": [0, 100]},
                      xaxis={"title": "simulated time (s)"}, margin={"t": 80},
                      legend={"x": 1.01, "xanchor": "left", "y": 1, "yanchor": "top"})
    return readable_axes(fig)


STYLE = ("body{font-family:sans-serif;margin:16px 24px}"
         "pre{white-space:pre-wrap}"
         ".table-wrap{overflow-x:auto}"
         "table{border-collapse:collapse;font-size:13px;margin:8px 0}"
         "th,td{border:1px solid #ccc;padding:2px 8px}td{text-align:right}")


def html_page(title: str, figures: list[go.Figure], preamble: str = "",
              plotly_js: str = "inline") -> str:
    """One offline page: plotly.js (inline, or ``plotly.min.js`` from the page's folder for
    ``plotly_js="directory"``: ``write_page`` writes it), then ``preamble`` and each figure."""
    if plotly_js not in PLOTLY_JS_MODES:
        raise ValueError(f"plotly_js must be one of {PLOTLY_JS_MODES}, got {plotly_js!r}")
    script = (f"<script charset='utf-8' src='{PLOTLY_JS_FILE}'></script>"
              if plotly_js == "directory"
              else f"<script type='text/javascript'>{get_plotlyjs()}</script>")
    body = "\n".join(figure_html(f) for f in figures)
    t = html.escape(title)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{t}</title>"
            f"<style>{STYLE}</style>{script}</head>"
            f"<body><h2>{t}</h2>{preamble}{body}</body></html>")


def figure_html(fig: go.Figure) -> str:
    """One figure's div and drawing script, without plotly.js (the page loads it once)."""
    return fig.to_html(full_html=False, include_plotlyjs=False,
                       config={"displaylogo": False, "responsive": True})


def write_plotly_js(folder: Path, shared_dir: Path | None = None) -> Path:
    """``folder/plotly.min.js``, written once: kept when it already holds this plotly.js.
    With ``shared_dir`` (a sweep's folder) the file is written there once and hard-linked
    into ``folder``, so the sweep's pages share one copy on disk (copied where links fail)."""
    path = folder / PLOTLY_JS_FILE
    js = get_plotlyjs().encode()
    if path.is_file() and path.stat().st_size == len(js) and path.read_bytes() == js:
        return path
    if shared_dir is not None and Path(shared_dir).resolve() != folder.resolve():
        source = write_plotly_js(Path(shared_dir))
        partial = path.with_name(path.name + PARTIAL)
        try:
            partial.unlink(missing_ok=True)
            os.link(source, partial)
            os.replace(partial, path)
            return path
        except OSError:
            pass  # another file system, or links refused: a copy of its own
    partial = path.with_name(path.name + PARTIAL)
    partial.write_bytes(js)
    os.replace(partial, path)
    return path


def write_page(path: Path, title: str, figures: list[go.Figure], preamble: str = "",
               plotly_js: str = "directory", shared_js_dir: Path | None = None) -> Path:
    """Write the page (whole or not at all); with ``plotly_js="directory"`` also the
    ``plotly.min.js`` it loads, beside it (once per folder, see ``write_plotly_js``)."""
    page = html_page(title, figures, preamble, plotly_js)
    if plotly_js == "directory":
        write_plotly_js(path.parent, shared_js_dir)
    write_atomic(path, page)
    return path


def intervals_figure(s: dict[str, Any]) -> go.Figure | None:
    """The headline figures with their error bars (``<figure>_lo`` / ``_hi``): the latency
    statistics per metric, and the throughputs; None for a summary without error bars."""
    if "error_bars_level" not in s:
        return None
    panels = [(m, [f"{k}_{m}_ms" for k in ("mean", "median", "p90", "p99")])
              for m in ("ttft", "tpot", "itl", "e2el")]
    panels.append(("throughput", ["request_throughput", "output_throughput",
                                  "total_token_throughput"]))
    panels = [(m, [k for k in keys if f"{k}_lo" in s]) for m, keys in panels]
    panels = [(m, keys) for m, keys in panels if keys]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[
        f"{m.upper()} (ms)" if m != "throughput" else "throughput (per s)" for m, _ in panels])
    for col, (metric, keys) in enumerate(panels, start=1):
        x = [k.removesuffix(f"_{metric}_ms").replace("_throughput", "") for k in keys]
        y = [s[k] for k in keys]
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="markers", marker={"size": 9, "color": PALETTE[0]},
            error_y={"type": "data", "symmetric": False,
                     "array": [s[f"{k}_hi"] - s[k] for k in keys],
                     "arrayminus": [s[k] - s[f"{k}_lo"] for k in keys]},
            customdata=[[s[f"{k}_lo"], s[f"{k}_hi"]] for k in keys],
            hovertemplate="%{x}: %{y:,.4~r} [%{customdata[0]:,.4~r}, "
                          "%{customdata[1]:,.4~r}]<extra></extra>",
            showlegend=False), 1, col)
        if metric == "throughput":  # requests/s beside tokens/s: a log scale shows both
            fig.update_yaxes(type="log", row=1, col=col)
    fig.update_layout(height=380, title=(
        f"{s['error_bars_level']:.0%} intervals: step time x{s['error_bars_step_time_lo']:.3f}"
        f" .. x{s['error_bars_step_time_hi']:.3f} ({s['error_bars_source']})"))
    return readable_axes(fig)


def write_report(out_dir: Path, summary: dict[str, Any], options: ReportOptions | None = None,
                 shared_js_dir: Path | None = None) -> Path:
    """``report.html`` in ``out_dir``: the summary, latency CDFs, the timeline (when steps.csv
    was recorded) and with prefix caching the hit rate. ``shared_js_dir``: see
    ``write_plotly_js``."""
    options = options or ReportOptions()
    requests = pd.read_csv(out_dir / "requests.csv")
    steps_csv = out_dir / "steps.csv"
    policy = str(summary.get("policy"))
    figures = [latency_cdf_figure({policy: requests}, f"Latency CDFs (policy {policy})")]
    intervals = intervals_figure(summary)
    if intervals is not None:  # error bars: right after the summary they belong to
        figures.insert(0, intervals)
    if steps_csv.exists():  # absent with record_steps=false
        figures.append(timeline_figure(pd.read_csv(steps_csv)))
    if summary.get("enable_prefix_caching"):
        figures.append(prefix_cache_figure(requests))
    title = (f"{summary.get('model')} / {summary.get('hardware')} / {summary.get('policy')}: "
             f"{summary['completed']:,} requests")
    pre = f"<pre>{html.escape(format_summary(summary))}</pre>"
    return write_page(out_dir / "report.html", title, figures, pre, options.plotly_js,
                      shared_js_dir)
