"""Goodput of prefill/decode disaggregation against co-location on the same GPUs.

    python -m experiments.disaggregation                       # conf/disaggregation.yaml
    python -m experiments.disaggregation experiment.duration_s=10 'experiment.deployments={...}'

For every (deployment, workload) pair, goodput is the highest request rate at which at least
``experiment.attainment`` of the requests meet both the TTFT and the TPOT SLO (DistServe's
definition), found by bracketing (doubling or halving ``rate_start``) and then bisecting on the
rate; every probe is a full simulation with the same seed of ``duration_s`` seconds of
arrivals. Writes ``results.csv`` and ``results.md`` into the Hydra run folder and prints the table.
"""

from __future__ import annotations

import csv
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.common import merge, simulate, slo_attainment
from sim.errors import ConfigError


@dataclass
class Probe:
    rate: float
    attainment: float
    p90_ttft_s: float
    p90_tpot_s: float


def num_requests(exp: dict[str, Any], rate: float) -> int:
    """Requests arriving in ``duration_s`` at ``rate`` (at least ``min_requests``): every
    probe covers the same stretch of time, so a queue that grows is seen growing."""
    return max(int(exp["min_requests"]), round(rate * float(exp["duration_s"])))


def probe(cfg: dict[str, Any], rate: float, slo: dict[str, float]) -> Probe:
    n = num_requests(cfg["experiment"], rate)
    run_cfg = {k: v for k, v in cfg.items() if k != "experiment"}
    run_cfg = merge(run_cfg, {"workload": {"qps": rate, "num_requests": n}})
    res = simulate(run_cfg)
    att = slo_attainment(res.requests, n, slo["ttft_s"], slo["tpot_s"])
    s = res.summary
    return Probe(rate, att, s["p90_ttft_ms"] / 1e3, s["p90_tpot_ms"] / 1e3)


def goodput(cfg: dict[str, Any], slo: dict[str, float]) -> tuple[float, list[Probe]]:
    """Highest passing rate (0 if even the smallest probe fails) and every probe made."""
    exp = cfg["experiment"]
    target, tol = exp["attainment"], exp["rel_tolerance"]
    probes: list[Probe] = []

    def ok(rate: float) -> bool:
        p = probe(cfg, rate, slo)
        probes.append(p)
        return p.attainment >= target

    rate = float(exp["rate_start"])
    if ok(rate):
        low, high = rate, None
        while high is None:
            rate *= 2
            if rate > exp["rate_max"]:
                return low, probes
            if ok(rate):
                low = rate
            else:
                high = rate
    else:
        high, low = rate, None
        while low is None:
            rate /= 2
            if rate < exp["rate_start"] / 64:
                return 0.0, probes
            if ok(rate):
                low = rate
            else:
                high = rate
    while (high - low) / low > tol:
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low, probes


def _job(args: tuple[dict[str, Any], str, str]) -> dict[str, Any]:
    cfg, dep_name, wl_name = args
    exp = cfg["experiment"]
    wl = exp["workloads"][wl_name]
    run_cfg = merge(cfg, {"cluster": exp["deployments"][dep_name], "workload": wl["workload"]})
    run_cfg["cluster"] = {**exp["deployments"][dep_name]}  # replace, not merge, the section
    good, probes = goodput(run_cfg, wl["slo"])
    best = max((p for p in probes if p.rate == good), key=lambda p: p.rate, default=None)
    return {
        "workload": wl_name, "deployment": dep_name, "goodput_rps": round(good, 3),
        "ttft_slo_s": wl["slo"]["ttft_s"], "tpot_slo_s": wl["slo"]["tpot_s"],
        "attainment_at_goodput": round(best.attainment, 3) if best else "",
        "p90_ttft_s_at_goodput": round(best.p90_ttft_s, 3) if best else "",
        "p90_tpot_s_at_goodput": round(best.p90_tpot_s, 4) if best else "",
        "num_probes": len(probes),
    }


def run_experiment(cfg: dict[str, Any], out_dir: Path | None) -> list[dict[str, Any]]:
    exp = cfg["experiment"]
    jobs = [(cfg, d, w) for w in exp["workloads"] for d in exp["deployments"]]
    workers = int(exp.get("workers", 1))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_job, jobs))
    else:
        rows = [_job(j) for j in jobs]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / "results.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        (out_dir / "results.md").write_text(markdown_table(rows) + "\n")
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    cols = ["workload", "deployment", "goodput_rps", "ttft_slo_s", "tpot_slo_s",
            "attainment_at_goodput", "p90_ttft_s_at_goodput", "p90_tpot_s_at_goodput",
            "num_probes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="../conf", config_name="disaggregation")
def main(cfg: DictConfig) -> None:
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        rows = run_experiment(container, out)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(markdown_table(rows))
    print(f"outputs: {out}")


if __name__ == "__main__":
    main()
