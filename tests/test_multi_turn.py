"""Multi-turn conversations in a closed loop (``workload=multi_turn``): each turn resends the
conversation and arrives a think time after the previous answer, and with prefix caching a
turn finds everything the previous turn computed."""

from __future__ import annotations

import pytest

from experiments.simulation import Simulation
from sim.errors import ConfigError
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import assert_fast_equals_exact

SMALL = ["model=tiny", "workload=multi_turn", "workload.num_sessions=30", "workload.qps=5",
         "workload.think_time_s=0.05", "workload.system_prompt_len=100",
         "workload.max_prompt_len=3000"]


def test_each_turn_resends_the_conversation_after_a_think_time():
    sim = Simulation(compose_cfg(*SMALL), keep_requests=True)
    wl = sim.workload
    res = sim.run()
    turns = {r.request_id: r for r in res.requests}
    followed = 0
    for rid, r in turns.items():
        nxt = turns.get(rid + 1)
        s = int(wl._session_of[rid])
        if nxt is None or int(wl._session_of[rid + 1]) != s:
            continue
        followed += 1
        # The next prompt: this prompt, this answer, a new message.
        assert nxt.prompt_len == r.prompt_len + r.max_output_len + int(wl.user_lens[rid + 1])
        assert nxt.prefix[:len(r.prefix)] == r.prefix
        assert nxt.arrival_time == r.finish_time + float(wl.think[rid])
    assert followed > 30
    assert res.summary["completed"] == len(turns)


def test_a_turn_finds_everything_the_previous_turn_computed():
    """With a cache that never evicts, turn k + 1 is handed every full block of turn k's
    prompt and answer (its computed tokens: prompt + answer - 1)."""
    sim = Simulation(compose_cfg(*SMALL, "kv.enable_prefix_caching=true",
                                 "kv.num_gpu_blocks_override=20000"), keep_requests=True)
    wl = sim.workload
    res = sim.run()
    assert res.summary["kv_evictions"] == 0
    turns = {r.request_id: r for r in res.requests}
    bs = res.summary["kv_block_size"]
    checked = 0
    for rid, r in turns.items():
        if r.request_id == int(wl.first_id[int(wl._session_of[rid])]):
            continue  # a first turn: only another session's system prompt can be cached
        prev = turns[rid - 1]
        assert r.num_cached_tokens == (prev.prompt_len + prev.max_output_len - 1) // bs * bs
        checked += 1
    assert checked > 30
    assert res.summary["prefix_cache_hit_rate"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["kv.enable_prefix_caching=true"], ["policy=vllm_v1"],
                                   ["policy=vllm_v1", "kv.num_gpu_blocks_override=200"],
                                   ["policy=sjf", "kv.enable_prefix_caching=true",
                                    "kv.num_gpu_blocks_override=200", "policy.preemption_mode=swap"],
                                   ["policy=vllm_v1", "cluster.num_replicas=2",
                                    "cluster.router=prefix_aware"]])
def test_fast_equals_exact(extra):
    s = assert_fast_equals_exact([*SMALL, *extra])
    assert s["completed"] > 30


def test_runs_are_reproducible_and_errors_name_the_field():
    a = Simulation(compose_cfg(*SMALL, "seed=4")).run().summary
    b = Simulation(compose_cfg(*SMALL, "seed=4")).run().summary
    assert a["mean_ttft_ms"] == b["mean_ttft_ms"] and a["completed"] == b["completed"]
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg(*SMALL, "workload.think_time_s=-1"))
    assert e.value.field == "workload.think_time_s"
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg(*SMALL, "workload.max_prompt_len=500"))
    assert e.value.field == "workload.max_prompt_len"
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg(*SMALL, "+workload.bogus=1"))
    assert e.value.field == "workload.bogus"
