"""Routers compared on the same arrivals: four co-located replicas at high load with widely
varying request sizes (``conf/routing.yaml``).

    python -m experiments.routing
    python -m experiments.routing workload.qps=15 'experiment.seeds=[0]'

Prints, per router, p99 and mean TTFT, p99 TPOT and E2E over ``experiment.seeds`` (each seed
is a different arrival stream; the table gives the mean over seeds and the per-seed p99 TTFT),
and writes ``results.csv`` / ``results.md`` into the Hydra run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import numpy as np
from omegaconf import DictConfig

from experiments.common import merge, run_hydra_experiment, run_jobs, simulate, write_tables
from sim.config_types import as_bool

METRICS = ("p99_ttft_ms", "mean_ttft_ms", "p99_tpot_ms", "p99_e2el_ms", "request_throughput")


def _job(args: tuple[dict[str, Any], str, int]) -> dict[str, Any]:
    cfg, router, seed = args
    run_cfg = merge({k: v for k, v in cfg.items() if k != "experiment"},
                    {"cluster": {"router": router}, "seed": seed})
    s = simulate(run_cfg).summary
    return {"router": router, "seed": seed, **{m: s[m] for m in METRICS},
            "completed": s["completed"],
            "routed": [r["routed"] for r in s["replicas"]]}


def run_experiment(cfg: dict[str, Any], out_dir: Path | None) -> list[dict[str, Any]]:
    exp = cfg["experiment"]
    jobs = [(cfg, r, int(s)) for r in exp["routers"] for s in exp["seeds"]]
    runs = run_jobs(_job, jobs, int(exp.get("workers", 1)),
                    progress=as_bool(cfg.get("progress", True), "progress"))
    rows = []
    for router in exp["routers"]:
        mine = [r for r in runs if r["router"] == router]
        row: dict[str, Any] = {"router": router}
        for m in METRICS:
            row[m] = round(float(np.mean([r[m] for r in mine])), 2)
        row["p99_ttft_ms_per_seed"] = " / ".join(f"{r['p99_ttft_ms']:.0f}" for r in mine)
        rows.append(row)
    if out_dir is not None:
        write_tables(out_dir, runs, rows)
    return rows


@hydra.main(version_base="1.3", config_path="../conf", config_name="routing")
def main(cfg: DictConfig) -> None:
    run_hydra_experiment(cfg, run_experiment)


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
