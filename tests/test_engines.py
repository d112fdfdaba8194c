"""``engine=`` (``conf/engine/``): each file composes and runs, sets only what differs from
its policy's defaults and conf/config.yaml's, and yields to the command line; no engine leaves
the composed config as it is."""

from __future__ import annotations

from typing import Any

import pytest

import policies
from experiments.simulation import Simulation
from tests.helpers import CONF, compose_cfg

ENGINES = sorted(p.stem for p in (CONF / "engine").glob("*.yaml") if p.stem != "none")
# The policy each engine selects.
POLICY = {"vllm_v0_6": "fcfs", "vllm_v1": "vllm_v1", "sglang": "sglang", "trtllm": "trtllm"}


def test_the_engines_are_the_documented_ones():
    assert ENGINES == sorted(POLICY)


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_composes_and_runs(engine):
    cfg = compose_cfg(f"engine={engine}", "workload.num_requests=20", "workload.qps=20")
    assert cfg["policy"]["name"] == POLICY[engine]
    assert "engine" not in cfg  # it selects and sets; the run sees plain sections
    summary = Simulation(cfg).run().summary
    assert summary["completed"] == 20 and summary["rejected"] == 0


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _effective(cfg: dict[str, Any], key: str) -> Any:
    """A value as the run takes it: ``null`` engine switches resolve to the policy's
    defaults."""
    section, name = key.split(".", 1)
    value = cfg[section][name]
    if value is None:
        cls = policies.POLICIES.get(cfg["policy"]["name"])
        if key == "executor.host_overlap":
            return cls.host_overlap_default
        if key == "kv.enable_prefix_caching":
            return cls.prefix_caching_default
    return value


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_sets_only_what_differs_from_its_policy(engine):
    """Every value an engine file sets differs from what its policy alone would run with."""
    with_engine = compose_cfg(f"engine={engine}")
    policy_only = compose_cfg(f"policy={POLICY[engine]}")
    changed = {k for k, v in _leaves(with_engine).items() if _leaves(policy_only)[k] != v}
    for key in changed:
        assert _effective(with_engine, key) != _effective(policy_only, key), key
    # ... and nothing else moved.
    assert {k: v for k, v in _leaves(with_engine).items() if k not in changed} == {
        k: v for k, v in _leaves(policy_only).items() if k not in changed}


def test_only_the_engines_that_differ_set_values():
    sets = {e: sorted(k for k, v in _leaves(compose_cfg(f"engine={e}")).items()
                      if _leaves(compose_cfg(f"policy={POLICY[e]}"))[k] != v)
            for e in ENGINES}
    assert sets == {"sglang": ["kv.block_size"],
                    "trtllm": ["kv.block_size", "kv.enable_prefix_caching"],
                    "vllm_v0_6": ["executor.host_overlap"],
                    "vllm_v1": []}


def test_the_command_line_wins_over_an_engine():
    cfg = compose_cfg("engine=trtllm", "kv.block_size=64", "policy.max_num_seqs=12")
    assert cfg["kv"]["block_size"] == 64 and cfg["policy"]["max_num_seqs"] == 12
    assert cfg["kv"]["enable_prefix_caching"] is True  # the engine's other value stays
    cfg = compose_cfg("engine=vllm_v0_6", "executor.host_overlap=false")
    assert cfg["executor"]["host_overlap"] is False
    # A policy chosen on the command line replaces the engine's; its values stay.
    cfg = compose_cfg("engine=trtllm", "policy=fcfs")
    assert cfg["policy"]["name"] == "fcfs" and cfg["kv"]["block_size"] == 32


def test_no_engine_is_the_default():
    """``engine=none`` (the default) changes nothing: the config is the groups' and
    conf/config.yaml's, and a policy chosen with it runs with its own defaults."""
    base = compose_cfg("engine=none")
    assert base == compose_cfg() and base["policy"]["name"] == "fcfs"
    assert (base["kv"]["block_size"], base["kv"]["enable_prefix_caching"]) == (16, None)
    assert base["executor"]["host_overlap"] is None
    assert compose_cfg("engine=none", "policy=trtllm")["kv"]["block_size"] == 16


@pytest.mark.parametrize("override", ["engine=null", "engine=", "policy=NULL", "engine=none,~",
                                      "+engine=null"])
def test_a_config_group_set_to_null_is_refused_before_hydra_sees_it(override, capsys):
    from experiments.hydra_errors import null_group_override

    with pytest.raises(SystemExit) as e:
        null_group_override(["workload.qps=2", override])
    assert e.value.code == 2
    group = override.strip("+").split("=")[0]
    assert capsys.readouterr().err.startswith(
        f"config error: {group}: a config group takes one of its options [")
    null_group_override(["engine=none", "policy=fcfs", "workload.qps=2", "seed=0"])  # passes


@pytest.mark.slow
@pytest.mark.parametrize("argv,error", [
    (["run", "engine=null", "workload.num_requests=2"],
     "engine: a config group takes one of its options ["),
    (["run", "-m", "engine=none,null", "workload.num_requests=2"],
     "engine: a config group takes one of its options ["),
    (["published", "engine=null"], "engine: a config group takes one of its options ["),
    (["published", "engine=sglang", "experiment.rows=[blog:2]"],
     "engine: each published row runs its source's engine"),
])
def test_a_command_refuses_an_engine_it_cannot_take_in_one_line(argv, error):
    """Hydra fails on a group set to null with a traceback; each command names the group and
    its options instead. The published rows run their sources' engines themselves."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", f"experiments.{argv[0]}", *argv[1:]],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"config error: {error}")
    assert "Traceback" not in r.stderr
