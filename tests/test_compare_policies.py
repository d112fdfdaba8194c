"""Smoke test of experiments/compare_policies.py with tiny request counts."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from experiments.compare_policies import describe_scenario, plan_runs, run
from experiments.analysis.policy_checks import static_slot_use
from sim.errors import ConfigError
from tests.helpers import ROOT, compose_named


def compare_cfg(*overrides: str) -> dict:
    return compose_named("compare_policies", *overrides)


@pytest.mark.slow
def test_all_scenarios_run_every_variant_and_write_the_table(tmp_path):
    cfg = compare_cfg("num_requests=12", "jobs=1")
    table = run(cfg, tmp_path)
    variants, scenarios = list(cfg["variants"]), list(cfg["scenarios"])
    assert len(table) == len(variants) * len(scenarios)
    csv = pd.read_csv(tmp_path / "policies.csv")
    summary = json.loads((tmp_path / "small_kv" / "fcfs" / "summary.json").read_text())
    # A policy column, then the summary.json keys (its own "policy" is the variant label).
    assert list(csv.columns[:2]) == ["scenario", "policy"]
    assert set(summary) - {"policy"} <= set(csv.columns)
    assert (csv.completed + csv.rejected == 12).all()
    small = pd.read_csv(tmp_path / "small_kv" / "policies.csv")
    assert list(small.policy) == variants and (small.kv_num_gpu_blocks == 2500).all()
    html = (tmp_path / "policies.html").read_text()
    assert all(s in html for s in scenarios) and "plotly" in html.lower()
    checks = (tmp_path / "checks.md").read_text()
    assert "## high_load" in checks and "SJF (oracle) cuts mean E2E" in checks
    # The preset's description is qualified by what this run changed (num_requests here).
    assert ("at 8 req/s, above what FCFS sustains" in checks
            and "this run changed the scenario's settings: workload.num_requests=12." in checks)


def test_a_scenario_description_says_what_the_command_line_changed():
    cfg = compare_cfg()
    assert describe_scenario("high_load", cfg) == cfg["scenarios"]["high_load"]["about"]
    moved = describe_scenario("high_load", compare_cfg("scenarios.high_load.workload.qps=10",
                                                       "+scenarios.high_load.kv.num_gpu_blocks_override=900"))
    assert moved.endswith("\n(That describes the preset; this run changed the scenario's "
                          "settings: kv.num_gpu_blocks_override=900, workload.qps=10.)")
    assert moved.startswith("the default chat workload at 8 req/s")
    new = compare_cfg("+scenarios.mine.workload.qps=3")
    assert describe_scenario("mine", new) == ("This run changed the scenario's settings: "
                                              "workload.qps=3.")


@pytest.mark.slow
def test_one_scenario_from_the_command_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.compare_policies",
                        "scenario=long_prompts", "num_requests=8", "jobs=1",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "checks.md").read_text().startswith(
        "Command line: scenario=long_prompts num_requests=8 jobs=1 (the scenario texts below")
    t = pd.read_csv(tmp_path / "policies.csv")
    assert set(t.scenario) == {"long_prompts"} and "chunked_prefill" in set(t.policy)
    assert "chunked prefill cuts p99 ITL" in p.stdout


@pytest.mark.parametrize("override,field", [
    ("scenario=nope", "scenario"),
    ("variants.fcfs.policy=nope", "variants.fcfs.policy"),
    ("+scenarios.small_kv.bogus=1", "scenarios.small_kv.bogus"),
])
def test_bad_experiment_config_names_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        plan_runs(compare_cfg(override))
    assert e.value.field == field


def test_static_slot_use_counts_batches_and_idle_row_steps():
    reqs = pd.DataFrame({
        "status": ["finished"] * 4,
        "first_scheduled_time": [0.0, 0.0, 10.0, 10.5],
        "finish_time": [4.0, 10.0, 12.0, 20.0],
        "output_len": [2, 8, 1, 9],
    })
    use, batches = static_slot_use(reqs)
    assert batches == 2
    assert use == pytest.approx((2 + 8 + 1 + 9) / (2 * 8 + 2 * 9))


# The literature checks docs/policies.md quotes, and how many each scenario must produce: a
# scenario whose check function silently returned nothing would otherwise pass.
DOCUMENTED_CHECKS = {"varied_outputs": 1, "long_prompts": 1, "high_load": 6, "small_kv": 2}
# The variants those checks read (sjf_oracle_no_aging and priority are only in the tables).
CHECKED_VARIANTS = ("static", "fcfs", "fcfs_swap", "chunked_prefill", "chunked_prefill_swap",
                    "sjf_oracle", "sjf_noisy", "sjf_bucket")


def run_checks(out, *overrides: str) -> pd.DataFrame:
    """checks.csv of a compare_policies run of the checked variants (each run is independent,
    so its figures are those of the full run with the same config)."""
    cfg = compare_cfg("jobs=2", *overrides)
    cfg["variants"] = {k: cfg["variants"][k] for k in CHECKED_VARIANTS}
    run(cfg, out)
    return pd.read_csv(out / "checks.csv")


def assert_documented_checks_hold(checks: pd.DataFrame) -> None:
    counts = checks.groupby("scenario").size().to_dict()
    assert counts == {s: DOCUMENTED_CHECKS[s] for s in counts}, counts
    failed = checks[~checks.holds.astype(bool)]
    assert failed.empty, "docs/policies.md says these hold; re-tune conf/compare_policies.yaml " \
        "or rewrite the docs:\n" + "\n".join(
            f"{r.scenario}: {r.claim}: {r.detail}" for r in failed.itertuples())


@pytest.mark.slow
def test_documented_literature_checks_hold_under_the_default_scenarios(tmp_path):
    """The default conf/compare_policies.yaml (full request counts, seed 0) still shows every
    effect docs/policies.md reports, so the page cannot silently go stale again."""
    checks = run_checks(tmp_path)
    assert set(checks.scenario) == set(DOCUMENTED_CHECKS)
    assert_documented_checks_hold(checks)


@pytest.mark.parametrize("scenario,overrides,claim", [
    # No queue at 2 req/s: SJF has nothing to reorder and equals FCFS.
    ("high_load", ["scenarios.high_load.workload.qps=2",
                   "scenarios.high_load.workload.num_requests=150"],
     "SJF (oracle) cuts median E2E"),
    # Both sustain 3 req/s: the throughputs are the offered load's, no large factor.
    ("varied_outputs", ["scenarios.varied_outputs.workload.qps=3",
                        "scenarios.varied_outputs.workload.num_requests=150"],
     "continuous batching (fcfs) beats static"),
    # A pool that holds everything: nothing is preempted, swap and recompute never differ.
    ("small_kv", ["scenarios.small_kv.kv.num_gpu_blocks_override=20000",
                  "scenarios.small_kv.workload.num_requests=150"],
     "fcfs: swap and recompute differ"),
])
def test_the_docs_check_fails_when_the_effect_is_absent(tmp_path, scenario, overrides, claim):
    checks = run_checks(tmp_path, f"scenario={scenario}", *overrides)
    with pytest.raises(AssertionError, match=re.escape(claim)):
        assert_documented_checks_hold(checks)
