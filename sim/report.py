"""The run's human-facing outputs: a short text summary and a self-contained plotly page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from sim.outputs import write_atomic

MAX_POINTS = 600  # per curve: keeps the page small for million-request runs


def format_summary(s: dict[str, Any]) -> str:
    par = f"TP{s.get('tensor_parallel', 1)}"
    if s.get("pipeline_parallel", 1) > 1:
        par += f" PP{s['pipeline_parallel']}"
    if "cluster" in s:  # cluster runs only
        par += f", {s['cluster']} x{s['num_replicas']}"
    head = (f"{s.get('model')} on {s.get('hardware')} ({par}), "
            f"policy {s.get('policy')}, executor {s.get('executor')}")
    lines = [head,
             f"  completed {s['completed']}  rejected {s['rejected']}  preemptions "
             f"{s['num_preemptions']}  steps {s.get('num_steps', 0)}",
             f"  throughput {s['request_throughput']:.2f} req/s  {s['output_throughput']:.0f} "
             f"out tok/s  {s['total_token_throughput']:.0f} tok/s",
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
    return "\n".join(lines)


def _pools(s: dict[str, Any]) -> dict[tuple[Any, ...], int]:
    """Replicas of a cluster run grouped by (role, hardware, TP, PP, KV blocks), counted."""
    pools: dict[tuple[Any, ...], int] = {}
    for r in s.get("replicas", []):
        key = (r["role"], r["hardware"], r["tensor_parallel"], r["pipeline_parallel"],
               r["kv_num_gpu_blocks"])
        pools[key] = pools.get(key, 0) + 1
    return pools


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(values[~np.isnan(values)])
    if len(v) == 0:
        return v, v
    q = np.linspace(0, 1, min(len(v), MAX_POINTS))
    return np.quantile(v, q), q


def latency_cdf_figure(frames: dict[str, pd.DataFrame], title: str = "Latency CDFs") -> go.Figure:
    """One subplot per metric (TTFT, TPOT, E2E), one curve per labelled requests table."""
    metrics = [("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2e_latency", "E2E latency (s)")]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[m[1] for m in metrics])
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]
    for i, (label, df) in enumerate(frames.items()):
        done = df[df["status"] == "finished"]
        for col, (metric, _) in enumerate(metrics, start=1):
            x, y = _cdf(pd.to_numeric(done[metric], errors="coerce").to_numpy(dtype=float))
            fig.add_trace(go.Scatter(x=x, y=y, name=label, legendgroup=label, showlegend=col == 1,
                                     line=dict(color=palette[i % len(palette)])), row=1, col=col)
    fig.update_yaxes(title_text="fraction of requests", row=1, col=1)
    fig.update_layout(title=title, height=420)
    return fig


def timeline_figure(steps: pd.DataFrame) -> go.Figure:
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=["Throughput (tokens/s)", "Queue length",
                                        "KV cache usage (%)", "Batch composition (tokens/step)"])
    if len(steps):
        end = float(steps["time"].iloc[-1] + steps["duration"].iloc[-1])
        bins = np.linspace(0.0, max(end, 1e-9), min(len(steps), MAX_POINTS) + 1)
        idx = np.clip(np.searchsorted(bins, steps["time"].to_numpy(), side="right") - 1, 0,
                      len(bins) - 2)
        g = steps.groupby(idx)
        width = np.diff(bins)[g.size().index]
        t = bins[:-1][g.size().index]
        fig.add_trace(go.Scatter(x=t, y=g["sampled"].sum() / width, name="output tokens/s"), 1, 1)
        fig.add_trace(go.Scatter(x=t, y=(g["prefill_tokens"].sum() + g["decode_tokens"].sum())
                                 / width, name="all tokens/s"), 1, 1)
        fig.add_trace(go.Scatter(x=t, y=g["num_waiting"].mean(), name="waiting"), 2, 1)
        fig.add_trace(go.Scatter(x=t, y=g["num_running"].mean(), name="running"), 2, 1)
        fig.add_trace(go.Scatter(x=t, y=g["num_swapped"].mean(), name="swapped"), 2, 1)
        fig.add_trace(go.Scatter(x=t, y=100 * g["kv_usage"].max(), name="KV usage (max)"), 3, 1)
        fig.add_trace(go.Bar(x=t, y=g["prefill_tokens"].mean(), name="prefill tokens"), 4, 1)
        fig.add_trace(go.Bar(x=t, y=g["decode_tokens"].mean(), name="decode tokens"), 4, 1)
    fig.update_layout(barmode="stack", height=1000, title="Over simulated time (s)")
    fig.update_xaxes(title_text="simulated time (s)", row=4, col=1)
    return fig


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
                                 name="per interval", mode="lines"))
        fig.add_trace(go.Scatter(x=at, y=100 * np.cumsum(hits) / np.cumsum(prompts),
                                 name="cumulative", mode="lines"))
    fig.update_layout(title="Prefix cache hit rate (% of prompt tokens, by admission time)",
                      height=380, yaxis=dict(title="%", range=[0, 100]),
                      xaxis=dict(title="simulated time (s)"))
    return fig


def html_page(title: str, figures: list[go.Figure], preamble: str = "") -> str:
    """One offline page: plotly.js inlined once, then each figure."""
    body = "\n".join(f.to_html(full_html=False, include_plotlyjs=False) for f in figures)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body style='font-family:sans-serif'><h2>{title}</h2>{preamble}{body}</body></html>")


def write_report(out_dir: Path, summary: dict[str, Any]) -> Path:
    requests = pd.read_csv(out_dir / "requests.csv")
    steps_csv = out_dir / "steps.csv"
    figures = [latency_cdf_figure({str(summary.get('policy')): requests})]
    if steps_csv.exists():  # absent with record_steps=false
        figures.append(timeline_figure(pd.read_csv(steps_csv)))
    if summary.get("enable_prefix_caching"):
        figures.append(prefix_cache_figure(requests))
    title = (f"{summary.get('model')} / {summary.get('hardware')} / {summary.get('policy')}: "
             f"{summary['completed']} requests")
    pre = f"<pre>{format_summary(summary)}</pre>"
    page = html_page(title, figures, pre)
    path = out_dir / "report.html"
    write_atomic(path, page)
    return path
