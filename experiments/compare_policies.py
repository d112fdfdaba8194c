"""Every policy on the same workload and seed, per scenario: the experiment behind docs/policies.md.

    python -m experiments.compare_policies                        # all scenarios (~30 s)
    python -m experiments.compare_policies scenario=long_prompts  # one
    python -m experiments.compare_policies num_requests=40 jobs=1 # a smoke run

Configured by ``conf/compare_policies.yaml`` (the main job's config plus ``variants`` and
``scenarios``). Writes into its Hydra output folder:

* ``policies.csv``: one row per (scenario, policy variant): ``scenario``, ``policy`` (the
  variant's label) and every ``summary.json`` key;
* ``policies.html``: per scenario, the latency CDFs (TTFT, TPOT, E2E) of all variants side by
  side, the main figures, and the literature's expectations checked against them;
* ``checks.md``: those expectations as text, and ``checks.csv`` (``scenario``, ``claim``,
  ``holds``, ``detail``: what ``tests/test_compare_policies.py`` reads to keep
  docs/policies.md honest); ``<scenario>/policies.csv`` and ``<scenario>/<variant>/``
  (requests.csv, steps.csv, summary.json of each run).
"""

from __future__ import annotations

import copy
import html
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.analysis.policy_checks import CHECKS, Check
from experiments.common import run_jobs
from experiments.simulation import Simulation
from sim.config_types import as_bool
from sim.errors import ConfigError, exit_on_config_error
from sim.report import figure_html, format_number, latency_cdf_figure, write_page
from sim.report_options import report_options

log = logging.getLogger(__name__)

CONF = Path(__file__).resolve().parent.parent / "conf"
BASE = ("model", "hardware", "workload", "executor", "cluster", "kv", "seed", "check_integrity")
SCENARIO_KEYS = {"about", "workload", "kv", "policy"}
SHOWN = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
         "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "p99_itl_ms", "num_preemptions",
         "num_swaps", "num_recomputes", "num_swap_fallbacks")


def _merge(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    if not over:
        return copy.deepcopy(base)
    return OmegaConf.to_container(OmegaConf.merge(base, over), resolve=True)  # type: ignore


def policy_section(label: str, variant: dict[str, Any], extra: dict[str, Any] | None) -> dict:
    """The variant's policy group file (``conf/policy/<policy>.yaml``) plus its overrides."""
    v = dict(variant)
    name = v.pop("policy", None)
    path = CONF / "policy" / f"{name}.yaml"
    if name is None or not path.exists():
        known = sorted(p.stem for p in (CONF / "policy").glob("*.yaml"))
        raise ConfigError(f"variants.{label}.policy",
                          f"must name a policy config, one of {known}; got {name!r}")
    base = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return _merge(_merge(base, v), extra)  # type: ignore[arg-type]


def plan_runs(cfg: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(scenario, variant label, simulation config) for every run the config asks for."""
    scenarios: dict[str, Any] = cfg.get("scenarios") or {}
    variants: dict[str, Any] = cfg.get("variants") or {}
    if not variants:
        raise ConfigError("variants", "no policy variants configured")
    pick = cfg.get("scenario", "all")
    if pick != "all" and pick not in scenarios:
        raise ConfigError("scenario", f"unknown scenario {pick!r}; known: all, "
                          f"{', '.join(scenarios)}")
    n = cfg.get("num_requests")
    runs = []
    for sname in (scenarios if pick == "all" else [pick]):
        sc = scenarios[sname] or {}
        unknown = sorted(set(sc) - SCENARIO_KEYS)
        if unknown:
            raise ConfigError(f"scenarios.{sname}.{unknown[0]}",
                              f"unknown key; known: {', '.join(sorted(SCENARIO_KEYS))}")
        for label, variant in variants.items():
            sim = {k: copy.deepcopy(cfg[k]) for k in BASE if k in cfg}
            sim["workload"] = _merge(sim["workload"], sc.get("workload"))
            sim["kv"] = _merge(sim["kv"], sc.get("kv"))
            if n is not None:
                sim["workload"]["num_requests"] = int(n)
            sim["policy"] = policy_section(label, variant or {}, sc.get("policy"))
            sim["progress"] = False
            runs.append((sname, label, sim))
    return runs


def _run(task: tuple[str, str, dict[str, Any], Path]) -> dict[str, Any]:
    _, _, sim_cfg, out = task
    return Simulation(sim_cfg, out).run().summary


def run(cfg: dict[str, Any], out_dir: Path, command_line: Sequence[str] = ()) -> pd.DataFrame:
    """Run every (scenario, variant), write the outputs, return the table. ``command_line``:
    the Hydra job's overrides, named at the top of ``checks.md`` (the scenarios' texts
    describe the presets)."""
    runs = plan_runs(cfg)
    options = report_options(cfg.get("report"))
    sims = {(s, v): Simulation(c) for s, v, c in runs}  # validate everything before running
    tasks = [(s, v, c, out_dir / s / v) for s, v, c in runs]
    summaries = run_jobs(_run, tasks, max(1, int(cfg.get("jobs", 1))),
                         progress=as_bool(cfg.get("progress", True), "progress"))
    rows = []
    for (s, v, _, _), summary in zip(tasks, summaries):
        row = {"scenario": s, "policy": v, **{k: x for k, x in summary.items() if k != "policy"}}
        row["reject_reasons"] = json.dumps(summary.get("reject_reasons", {}), sort_keys=True)
        rows.append(row)
    table = pd.DataFrame(rows)
    table.to_csv(out_dir / "policies.csv", index=False)
    sections, notes, check_rows = [], [], []
    for s in dict.fromkeys(r[0] for r in runs):
        part = table[table.scenario == s].drop(columns="scenario")
        part.to_csv(out_dir / s / "policies.csv", index=False)
        checks = CHECKS[s](part, out_dir / s, sims) if s in CHECKS else []
        check_rows += [{"scenario": s, "claim": c.claim, "holds": c.holds, "detail": c.detail}
                       for c in checks]
        about = describe_scenario(s, cfg)
        notes.append(_checks_text(s, about, checks))
        frames = {v: pd.read_csv(out_dir / s / v / "requests.csv") for v in part.policy}
        fig = latency_cdf_figure(frames, f"{s}: latency CDFs")
        shown = part.set_index("policy")[list(SHOWN)]
        table_html = shown.to_html(formatters=dict.fromkeys(shown.columns, format_number))
        head = (f"<h3>{html.escape(s)}</h3><p>{html.escape(about)}</p>"
                f"<div class='table-wrap'>{table_html}</div>"
                f"<pre>{html.escape(_checks_text(s, '', checks))}</pre>")
        sections.append((fig, head))
    if command_line:
        notes.insert(0, f"Command line: {' '.join(command_line)} (the scenario texts below "
                        "describe conf/compare_policies.yaml's presets)\n")
    (out_dir / "checks.md").write_text("\n".join(notes))
    pd.DataFrame(check_rows, columns=["scenario", "claim", "holds", "detail"]).to_csv(
        out_dir / "checks.csv", index=False)
    figs_html = "".join(pre + figure_html(f) for f, pre in sections)
    write_page(out_dir / "policies.html", "Policies compared", [], figs_html, options.plotly_js)
    return table


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def describe_scenario(name: str, cfg: dict[str, Any]) -> str:
    """The scenario's ``about`` text, and after it what this run changed from the preset in
    ``conf/compare_policies.yaml`` (``about`` describes the preset: a command line that moves
    ``scenarios.high_load.workload.qps`` must not leave "at 8 req/s" standing unqualified)."""
    ran = dict(cfg["scenarios"][name] or {})
    about = str(ran.pop("about", "") or "")
    preset = dict((OmegaConf.to_container(OmegaConf.load(CONF / "compare_policies.yaml"))
                   .get("scenarios", {}) or {}).get(name) or {})  # type: ignore[union-attr]
    preset.pop("about", None)
    now, before = _flat(ran), _flat(preset)
    if cfg.get("num_requests") is not None:
        now["workload.num_requests"] = int(cfg["num_requests"])
    changed = [f"{k}={now.get(k)}" for k in sorted(set(now) | set(before))
               if now.get(k) != before.get(k)]
    if not changed:
        return about
    note = f"this run changed the scenario's settings: {', '.join(changed)}."
    return f"{about}\n(That describes the preset; {note})" if about else note[0].upper() + note[1:]


def _checks_text(scenario: str, about: str, checks: list[Check]) -> str:
    lines = [f"## {scenario}", about] if about else [f"## {scenario}"]
    for c in checks:
        lines.append(f"- [{'holds' if c.holds else 'DOES NOT HOLD'}] {c.claim}: {c.detail}")
    return "\n".join(lines) + "\n"


@hydra.main(version_base="1.3", config_path="../conf", config_name="compare_policies")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    container = OmegaConf.to_container(cfg, resolve=True)
    with exit_on_config_error():
        table = run(container, out_dir,  # type: ignore[arg-type]
                    list(HydraConfig.get().overrides.task))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        log.info(table.set_index(["scenario", "policy"])[list(SHOWN[:8])].round(2))
    log.info((out_dir / "checks.md").read_text())
    log.info(f"outputs: {out_dir}")


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
