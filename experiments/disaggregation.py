"""Goodput of prefill/decode disaggregation against co-location on the same GPUs.

    python -m experiments.disaggregation                       # conf/disaggregation.yaml
    python -m experiments.disaggregation 'experiment.seeds=[0]' \
        experiment.policies.chunked.max_num_batched_tokens=256

A deployment is a ``cluster`` section plus the policy of its replicas, named from
``experiment.policies`` (overrides of the run's ``policy`` section): co-located replicas all
run ``policy`` (e.g. FCFS, or chunked prefill as in Sarathi-Serve); a disaggregated one may give
its pools different policies (``prefill_policy``, ``decode_policy``). For every (deployment,
workload, seed), goodput is the highest request rate at which at least
``experiment.attainment`` of the requests meet both the TTFT and the TPOT SLO (DistServe's
definition), found by bracketing (doubling or halving ``rate_start``) and then bisecting on the
rate; every probe is a full simulation of ``duration_s`` seconds of arrivals with that seed.
Writes ``runs.csv`` (one row per seed), ``results.csv`` and ``results.md`` (means over the
seeds) into the Hydra run folder and prints the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from experiments.common import (
    merge,
    run_hydra_experiment,
    run_jobs,
    simulate,
    slo_attainment,
    write_tables,
)
from sim.config_types import as_bool
from sim.errors import ConfigError


@dataclass
class Probe:
    rate: float
    attainment: float
    p90_ttft_s: float
    p90_tpot_s: float
    ttft_attainment: float = 1.0  # the TTFT SLO alone
    tpot_attainment: float = 1.0  # the TPOT SLO alone


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
    ttft_att = slo_attainment(res.requests, n, slo["ttft_s"], math.inf)
    tpot_att = slo_attainment(res.requests, n, math.inf, slo["tpot_s"])
    s = res.summary
    return Probe(rate, att, s["p90_ttft_ms"] / 1e3, s["p90_tpot_ms"] / 1e3, ttft_att, tpot_att)


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


DEPLOYMENT_KEYS = {"cluster", "policy", "prefill_policy", "decode_policy"}


def _policy_override(exp: dict[str, Any], dep_name: str, key: str, name: Any) -> dict[str, Any]:
    known = exp.get("policies") or {}
    if name not in known:
        raise ConfigError(f"experiment.deployments.{dep_name}.{key}",
                          f"unknown policy {name!r}; experiment.policies has: "
                          f"{', '.join(known) or 'none'}")
    return dict(known[name] or {})


def deployment_config(cfg: dict[str, Any], dep_name: str) -> dict[str, Any]:
    """The run config of one deployment: its ``cluster`` section replaces the run's, and its
    policies (names in ``experiment.policies``, overrides merged over the run's ``policy``
    section) apply to every replica (``policy``), or per pool when disaggregated
    (``prefill_policy`` / ``decode_policy``, each defaulting to ``policy``)."""
    exp = cfg["experiment"]
    dep = exp["deployments"][dep_name]
    where = f"experiment.deployments.{dep_name}"
    if not isinstance(dep, dict) or "cluster" not in dep:
        raise ConfigError(where, "must be a mapping with a `cluster` section and a `policy` name")
    unknown = sorted(set(dep) - DEPLOYMENT_KEYS)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}",
                          f"unknown option; known: {', '.join(sorted(DEPLOYMENT_KEYS))}")
    if "policy" not in dep:
        raise ConfigError(f"{where}.policy", "missing: name one of experiment.policies")
    cluster = dict(dep["cluster"])  # replace, not merge, the section
    default = dep["policy"]
    if cluster.get("name") == "disaggregated":
        for side in ("prefill", "decode"):
            key = f"{side}_policy"
            override = _policy_override(exp, dep_name, key, dep.get(key, default))
            pool = dict(cluster.get(side) or {})
            pool["policy"] = merge(override, pool.get("policy") or {})
            cluster[side] = pool
        run_cfg = merge(cfg, {})
    else:
        for key in ("prefill_policy", "decode_policy"):
            if key in dep:
                raise ConfigError(f"{where}.{key}", "only for disaggregated deployments")
        run_cfg = merge(cfg, {"policy": _policy_override(exp, dep_name, "policy", default)})
    run_cfg["cluster"] = cluster
    return run_cfg


def _job(args: tuple[dict[str, Any], str, str, int]) -> dict[str, Any]:
    cfg, dep_name, wl_name, seed = args
    exp = cfg["experiment"]
    wl = exp["workloads"][wl_name]
    run_cfg = merge(deployment_config(cfg, dep_name), {"workload": wl["workload"], "seed": seed})
    good, probes = goodput(run_cfg, wl["slo"])
    best = max((p for p in probes if p.rate == good), key=lambda p: p.rate, default=None)
    return {
        "workload": wl_name, "deployment": dep_name, "seed": seed,
        "policy": policy_label(run_cfg), "goodput_rps": round(good, 3),
        "ttft_slo_s": wl["slo"]["ttft_s"], "tpot_slo_s": wl["slo"]["tpot_s"],
        "attainment_at_goodput": round(best.attainment, 3) if best else math.nan,
        "p90_ttft_s_at_goodput": round(best.p90_ttft_s, 3) if best else math.nan,
        "p90_tpot_s_at_goodput": round(best.p90_tpot_s, 4) if best else math.nan,
        "limited_by": limited_by(probes, good, exp["attainment"]),
        "num_probes": len(probes),
    }


def policy_label(run_cfg: dict[str, Any]) -> str:
    """The policy of every replica, or ``prefill/decode`` policies when disaggregated."""
    c = run_cfg["cluster"]
    if c.get("name") == "disaggregated":
        return "/".join({**run_cfg["policy"], **c[side]["policy"]}["name"]
                        for side in ("prefill", "decode"))
    return str(run_cfg["policy"]["name"])


def limited_by(probes: list[Probe], good: float, target: float) -> str:
    """Which SLO fails first just above the goodput: at the lowest failing probe, ``ttft``,
    ``tpot`` or ``both`` alone miss the attainment target (``either`` when neither alone
    does); empty if no probe failed."""
    failed = [p for p in probes if p.rate > good and p.attainment < target]
    if not failed:
        return ""
    p = min(failed, key=lambda p: p.rate)
    ttft, tpot = p.ttft_attainment < target, p.tpot_attainment < target
    return {(True, True): "both", (True, False): "ttft", (False, True): "tpot"}.get(
        (ttft, tpot), "either")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, deployment): means over the seeds, goodput per seed, and every
    SLO that limited some seed."""
    rows = []
    for key in dict.fromkeys((r["workload"], r["deployment"]) for r in runs):
        mine = [r for r in runs if (r["workload"], r["deployment"]) == key]
        first = mine[0]

        def mean(col: str, digits: int) -> float:
            return round(sum(r[col] for r in mine) / len(mine), digits)

        rows.append({
            "workload": key[0], "deployment": key[1], "policy": first["policy"],
            "goodput_rps": mean("goodput_rps", 3),
            "goodput_per_seed": " / ".join(f"{r['goodput_rps']:g}" for r in mine),
            "ttft_slo_s": first["ttft_slo_s"], "tpot_slo_s": first["tpot_slo_s"],
            "attainment_at_goodput": mean("attainment_at_goodput", 3),
            "p90_ttft_s_at_goodput": mean("p90_ttft_s_at_goodput", 3),
            "p90_tpot_s_at_goodput": mean("p90_tpot_s_at_goodput", 4),
            "limited_by": "/".join(sorted({r["limited_by"] for r in mine if r["limited_by"]})),
            "num_probes": sum(r["num_probes"] for r in mine),
        })
    return rows


def run_experiment(cfg: dict[str, Any], out_dir: Path | None) -> list[dict[str, Any]]:
    """Goodput of every deployment on every workload for every seed in ``experiment.seeds``
    (default: the run's ``seed``); returns the per-(workload, deployment) summary rows and
    writes ``runs.csv`` (one row per seed), ``results.csv`` and ``results.md``."""
    exp = cfg["experiment"]
    seeds = [int(s) for s in exp.get("seeds") or [cfg.get("seed", 0)]]
    for dep in exp["deployments"]:
        deployment_config(cfg, dep)  # bad deployments fail before any simulation
    jobs = [(cfg, d, w, s) for w in exp["workloads"] for d in exp["deployments"] for s in seeds]
    runs = run_jobs(_job, jobs, int(exp.get("workers", 1)),
                    progress=as_bool(cfg.get("progress", True), "progress"))
    rows = summarize(runs)
    if out_dir is not None:
        write_tables(out_dir, runs, rows)
    return rows


@hydra.main(version_base="1.3", config_path="../conf", config_name="disaggregation")
def main(cfg: DictConfig) -> None:
    run_hydra_experiment(cfg, run_experiment)


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
