"""Prefix caching against the GPU cache's size and the router (``conf/prefix_caching.yaml``).

    python -m experiments.prefix_caching
    python -m experiments.prefix_caching 'experiment.kv_blocks=[null]' \
        'experiment.routers=[prefix_aware]'

Every scenario (a workload whose prompts share prefixes) runs with caching off and on (on:
for each offload tier size, ``kv.kv_offloading_size``), for each GPU cache size (KV blocks per
replica) and router, on four replicas. Prints one row per run: the share of prompt tokens
served from GPU blocks and from the offload tier, TTFT, throughput and evictions; writes
``runs.csv``, ``results.csv``, ``results.md`` and ``results.html`` (hit rate and p99 TTFT
against the cache size) into the Hydra run folder.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import hydra
import plotly.graph_objects as go
from omegaconf import DictConfig, OmegaConf
from plotly.subplots import make_subplots

from experiments.common import merge, run_hydra_experiment, run_jobs, simulate, write_tables
from sim.config_types import as_bool
from sim.errors import ConfigError
from sim.report import write_page

CONF = Path(__file__).resolve().parent.parent / "conf"
METRICS = ("prefix_cache_hit_rate", "kv_offload_hit_rate", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "request_throughput", "kv_evictions", "completed", "rejected")


def _job(args: tuple[dict[str, Any], str, int | None, str, bool, float]) -> dict[str, Any]:
    cfg, scenario, blocks, router, caching, offload = args
    base = {k: v for k, v in cfg.items() if k != "experiment"}
    scene = dict(cfg["experiment"]["scenarios"][scenario])
    # A scenario's workload is its group's config (conf/workload/<name>.yaml) with the
    # scenario's values over it, not the run's default workload.
    wl = dict(scene.pop("workload"))
    base["workload"] = merge(workload_defaults(str(wl.get("name"))), wl)
    run_cfg = merge(merge(base, scene),
                    {"cluster": {"router": router},
                     "kv": {"num_gpu_blocks_override": blocks, "enable_prefix_caching": caching,
                            "kv_offloading_size": offload}})
    s = simulate(run_cfg).summary
    return {"scenario": scenario, "kv_blocks": s["kv_num_gpu_blocks"], "router": router,
            "caching": caching, "offload_gib": offload,
            **{m: round(s[m], 4) if isinstance(s[m], float) else s[m] for m in METRICS}}


def workload_defaults(name: str) -> dict[str, Any]:
    path = CONF / "workload" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("experiment.scenarios", f"no workload config named {name!r} "
                          f"(conf/workload/)")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def run_experiment(cfg: dict[str, Any], out_dir: Path | None) -> list[dict[str, Any]]:
    exp = cfg["experiment"]
    for key in ("scenarios", "kv_blocks", "routers", "caching"):
        if not exp.get(key):
            raise ConfigError(f"experiment.{key}", "must list at least one value")
    exp["scenarios"] = {k: v for k, v in exp["scenarios"].items() if v is not None}
    for name, scene in exp["scenarios"].items():
        if not isinstance(scene, dict) or not isinstance(scene.get("workload"), dict):
            raise ConfigError(f"experiment.scenarios.{name}", "needs a workload section")
    offloads = [float(g) for g in exp.get("offload_gib") or [0.0]]
    if any(not g >= 0 for g in offloads):
        raise ConfigError("experiment.offload_gib", f"sizes must be >= 0, got {offloads}")
    # The offload tier keeps cached blocks: it varies only where caching is on.
    jobs = [(cfg, sc, None if b is None else int(b), r, bool(c), g)
            for sc, b, r, c in itertools.product(exp["scenarios"], exp["kv_blocks"],
                                                 exp["routers"], exp["caching"])
            for g in (offloads if c else [0.0])]
    rows = run_jobs(_job, jobs, int(exp.get("workers", 1)),
                    progress=as_bool(cfg.get("progress", True), "progress"))
    if out_dir is not None:
        write_tables(out_dir, rows, rows)
        write_page(out_dir / "results.html", "Prefix caching", [_figure(rows)])
    return rows


def _figure(rows: list[dict[str, Any]]) -> go.Figure:
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig = make_subplots(rows=len(scenarios), cols=2, subplot_titles=[
        t for sc in scenarios for t in (f"{sc}: hit rate, GPU + offload (% of prompt tokens)",
                                        f"{sc}: p99 TTFT (ms)")])
    palette = {"round_robin": "#1f77b4", "prefix_aware": "#d62728"}
    for i, sc in enumerate(scenarios, start=1):
        mine = [r for r in rows if r["scenario"] == sc]
        for key in dict.fromkeys((r["router"], r["caching"], r["offload_gib"]) for r in mine):
            pts = sorted((r for r in mine
                          if (r["router"], r["caching"], r["offload_gib"]) == key),
                         key=lambda r: r["kv_blocks"])
            router, caching, offload = key
            name = (f"{router}, caching {'on' if caching else 'off'}"
                    + (f", offload {offload:g} GiB" if offload else ""))
            style = dict(color=palette.get(router, "#7f7f7f") if caching else "#7f7f7f",
                         dash="dash" if offload else None if caching else "dot")
            x = [r["kv_blocks"] for r in pts]
            # Hits from GPU blocks and from the offload tier: prompt tokens not computed.
            hits = [100 * (r["prefix_cache_hit_rate"] + r["kv_offload_hit_rate"]) for r in pts]
            fig.add_trace(go.Scatter(x=x, y=hits,
                                     name=name, legendgroup=name, showlegend=i == 1,
                                     line=style), i, 1)
            fig.add_trace(go.Scatter(x=x, y=[r["p99_ttft_ms"] for r in pts], name=name,
                                     legendgroup=name, showlegend=False, line=style), i, 2)
        fig.update_xaxes(title_text="GPU KV blocks per replica", type="log", row=i)
    fig.update_layout(height=420 * len(scenarios), title="Prefix caching: 4 replicas, vllm_v1")
    return fig


@hydra.main(version_base="1.3", config_path="../conf", config_name="prefix_caching")
def main(cfg: DictConfig) -> None:
    run_hydra_experiment(cfg, run_experiment)


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
