"""``python -m experiments.prefix_caching``: its grid on a small multi-turn scenario."""

from __future__ import annotations

import pytest

from experiments.prefix_caching import run_experiment
from sim.errors import ConfigError
from tests.helpers import compose_named


def _cfg(*overrides: str) -> dict:
    return compose_named("prefix_caching", "model=tiny", "experiment.workers=1",
                         "~experiment.scenarios.mooncake_conversation",
                         "experiment.scenarios.multi_turn.workload.num_sessions=20",
                         "experiment.scenarios.multi_turn.workload.qps=5",
                         "+experiment.scenarios.multi_turn.workload.think_time_s=0.1",
                         "+experiment.scenarios.multi_turn.workload.max_prompt_len=3000",
                         "experiment.kv_blocks=[null,400]", *overrides)


@pytest.mark.slow
def test_the_grid_runs_every_combination_and_writes_its_tables(tmp_path):
    rows = run_experiment(_cfg("experiment.offload_gib=[0,1]"), tmp_path)
    # Caching off once per size and router; on, once per offload tier size.
    assert len(rows) == 1 * 2 * 2 * (1 + 2)
    for r in rows:
        assert r["scenario"] == "multi_turn" and r["rejected"] == 0
        assert (r["prefix_cache_hit_rate"] > 0) == r["caching"]
        assert (r["kv_offload_hit_rate"] > 0) == (r["offload_gib"] > 0 and r["kv_blocks"] == 400)
    small = {(r["router"], r["caching"], r["offload_gib"]): r
             for r in rows if r["kv_blocks"] == 400}
    assert small[("prefix_aware", True, 0.0)]["prefix_cache_hit_rate"] > small[
        ("round_robin", True, 0.0)]["prefix_cache_hit_rate"]
    for name in ("runs.csv", "results.csv", "results.md", "results.html"):
        assert (tmp_path / name).exists()
    assert "Prefix caching" in (tmp_path / "results.html").read_text()


def test_a_scenario_without_a_known_workload_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        run_experiment(_cfg("experiment.scenarios.multi_turn.workload.name=nosuch"), None)
    assert e.value.field == "experiment.scenarios"
