"""The tests' config helper composes what Hydra composes: group choices through Hydra, value
overrides applied to a kept composition by Hydra's own override step."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.helpers import CONF, compose_cfg, compose_named

CASES = [
    ["step_mode=exact", "model=tiny"],
    ["model=tiny", "step_mode=fast", "step_mode=exact"],
    ["model=tiny", "workload.qps=3", "policy=sjf", "policy.predictor=noisy",
     "kv.num_gpu_blocks_override=40", "cluster=disaggregated", "cluster.num_decode_replicas=2",
     "cluster.link.preset=pcie"],
    ["workload=trace", "workload.path=/tmp/x.csv", "policy.max_num_seqs=4"],
    ["policy=priority", "workload.priorities=[1,1,2]", "+extra=3"],
    ["policy=fcfs", "policy=sjf", "policy.bucket_edges=[1,2]", "seed=5"],
    ["hardware=h200", "executor=real", "model.kv_cache_dtype=fp8"],
    # Values added (+), forced (++) and deleted (~) on the kept composition; a mapping added
    # under a group's node.
    ["model=tiny", "cluster=disaggregated",
     "+cluster.prefill.policy={name: sjf, predictor: noisy}", "cluster.num_prefill_replicas=2"],
    ["cluster=disaggregated", "+cluster.decode.policy.name=priority", "++policy.max_num_seqs=8",
     "++seed=4"],
    ["policy=sjf", "~policy.aging_s", "+policy.aging_s=0.5"],
]


def _hydra(config_name: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        out = OmegaConf.to_container(compose(config_name=config_name, overrides=overrides),
                                     resolve=True)
    out.pop("hydra", None)
    return out


@pytest.mark.parametrize("overrides", CASES)
def test_compose_cfg_equals_hydra(overrides):
    want = _hydra("config", overrides)
    want["progress"] = False
    assert compose_cfg(*overrides) == want
    assert compose_cfg(*overrides) == want  # and again, from the kept composition


def test_compose_named_returns_a_fresh_copy():
    a = compose_named("compare_policies", "workload.qps=2")
    a["workload"]["qps"] = 99
    assert compose_named("compare_policies", "workload.qps=2") == _hydra(
        "compare_policies", ["workload.qps=2"])


def test_unknown_keys_fail_as_in_hydra():
    with pytest.raises(ConfigCompositionException, match="policy.nonexistent"):
        compose_cfg("model=tiny", "policy.nonexistent=3")
    # Adding a value that is already there is Hydra's error too.
    with pytest.raises(ConfigCompositionException, match="already at 'seed'"):
        compose_cfg("model=tiny", "+seed=3")
