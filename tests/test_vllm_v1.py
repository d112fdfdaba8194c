"""vLLM v1's scheduler (``policy=vllm_v1``) against schedules worked out by hand on tiny pools,
its engine defaults, and fast equals exact."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.request import Request
from tests.harness import run_requests
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import assert_fast_equals_exact

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

V1 = {"name": "vllm_v1", "max_num_seqs": 4, "max_num_batched_tokens": 8}


def test_one_budget_for_running_and_waiting_and_chunked_prefill():
    """Budget 8: A's 6-token prompt and the first 2 of B's 5; then A decodes and B's prompt
    finishes in the same step (no prefill or decode phases); then both decode."""
    run = run_requests(V1, [Request(0, 0.0, 6, 3), Request(1, 0.0, 5, 2)],
                       num_gpu_blocks=12, block_size=4)
    s = run.steps
    assert [st.rows for st in s] == [
        [(0, 0, 6, True), (1, 0, 2, False)],
        [(0, 6, 1, True), (1, 2, 3, True)],
        [(0, 7, 1, True), (1, 5, 1, True)],
    ]
    # Blocks for the tokens computed, not the whole prompt up front.
    assert [st.tables for st in s] == [{0: [0, 1], 1: [2]}, {0: [0, 1], 1: [2, 3]},
                                       {0: [0, 1], 1: [2, 3]}]


def test_the_last_running_request_is_recomputed_and_nobody_is_admitted_that_step():
    """4 blocks of 2 tokens. At t=2 A's 5th token needs a third block: B, the last running,
    is preempted by recompute (blocks 3 then 2 go back). B re-admits with its 3 prompt and 1
    generated tokens once two blocks are free (no watermark), after A finishes."""
    run = run_requests(V1, [Request(0, 0.0, 3, 4), Request(1, 0.1, 3, 4)],
                       num_gpu_blocks=4, block_size=2)
    s = run.steps
    assert [(st.time, st.rows, st.recomputed) for st in s] == [
        (0.0, [(0, 0, 3, True)], []),
        (1.0, [(0, 3, 1, True), (1, 0, 3, True)], []),
        (2.0, [(0, 4, 1, True)], [1]),
        (3.0, [(0, 5, 1, True)], []),  # B needs 2 blocks for 4 tokens, 1 is free
        (4.0, [(1, 0, 4, True)], []),
        (5.0, [(1, 4, 1, True)], []),
        (6.0, [(1, 5, 1, True)], []),
    ]
    assert s[2].tables == {0: [0, 1, 3]} and s[4].tables == {1: [2, 3]}


def test_priority_scheduling_preempts_the_lowest_priority_and_admits_the_highest_first():
    """4 blocks of 2 tokens; A and C have priority 1, B and D priority 0 (first). t=2: A's
    5th token needs a block: the victim is the running request with the largest (priority,
    arrival), A itself, which ends the running loop as in vLLM (B, after it, gets nothing
    in that plan, and nobody is admitted); the replica plans again at once: B goes on and
    D, first of the waiting D, A (5 tokens again), C, is admitted; A does not fit and ends
    admission, there and at t=3 and t=4. t=5: A and C."""
    reqs = [Request(0, 0.0, 3, 4, priority=1), Request(1, 0.1, 3, 4, priority=0),
            Request(2, 0.2, 2, 1, priority=1), Request(3, 0.3, 2, 1, priority=0)]
    run = run_requests({**V1, "scheduling_policy": "priority"}, reqs, num_gpu_blocks=4,
                       block_size=2)
    assert [(st.time, st.rows, st.recomputed) for st in run.steps] == [
        (0.0, [(0, 0, 3, True)], []),
        (1.0, [(0, 3, 1, True), (1, 0, 3, True)], []),
        (2.0, [], [0]),
        (2.0, [(1, 3, 1, True), (3, 0, 2, True)], []),
        (3.0, [(1, 4, 1, True)], []),
        (4.0, [(1, 5, 1, True)], []),
        (5.0, [(0, 0, 5, True), (2, 0, 2, True)], []),
        (6.0, [(0, 5, 1, True)], []),
    ]


def test_a_cached_prefix_is_a_hit_and_the_prompt_is_chunked_by_the_budget():
    """A's 9-token prompt (8 shared) takes two steps of budget 8; B, arriving after A
    finished, is handed blocks 0 and 1 and computes its last 2 prompt tokens."""
    prefix = ((7, 8),)
    reqs = [Request(0, 0.0, 9, 2, prefix=prefix), Request(1, 5.0, 10, 2, prefix=prefix)]
    run = run_requests(V1, reqs, num_gpu_blocks=12, block_size=4, enable_prefix_caching=True)
    s = run.steps
    assert [(st.time, st.rows) for st in s] == [
        (0.0, [(0, 0, 8, False)]),
        (1.0, [(0, 8, 1, True)]),
        (2.0, [(0, 9, 1, True)]),
        (5.0, [(1, 8, 2, True)]),
        (6.0, [(1, 10, 1, True)]),
    ]
    assert s[3].tables == {1: [0, 1, 3]}
    assert reqs[1].num_cached_tokens == 8
    kv = run.replica.kv
    assert (kv.prefix_queries, kv.prefix_hits) == (19, 8)


@pytest.mark.parametrize("hardware,tokens,seqs", [("a100_80gb", 2048, 256),
                                                  ("h100_sxm", 8192, 1024),
                                                  ("h200", 8192, 1024),
                                                  ("l40s", 2048, 256)])
def test_engine_defaults_follow_the_gpu_and_prefix_caching_is_on(hardware, tokens, seqs):
    sim = Simulation(compose_cfg("policy=vllm_v1", f"hardware={hardware}",
                                 "workload.num_requests=5"))
    cfg = sim.policy.config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (tokens, seqs)
    s = sim.run().summary
    assert s["enable_prefix_caching"] is True and s["completed"] == 5
    set_by_hand = Simulation(compose_cfg("policy=vllm_v1", f"hardware={hardware}",
                                         "policy.max_num_seqs=7",
                                         "kv.enable_prefix_caching=false"))
    assert set_by_hand.policy.config.max_num_seqs == 7
    assert set_by_hand.policy.config.max_num_batched_tokens == tokens
    assert not set_by_hand.prefix_caching


@pytest.mark.parametrize("override,field", [("policy.preemption_mode=swap",
                                              "policy.preemption_mode"),
                                             ("policy.enable_chunked_prefill=false",
                                              "policy.enable_chunked_prefill"),
                                             ("policy.kv_watermark=0.01", "policy.kv_watermark"),
                                             ("policy.scheduling_policy=lifo",
                                              "policy.scheduling_policy")])
def test_what_vllm_v1_does_not_have_is_a_config_error(override, field):
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg("policy=vllm_v1", override))
    assert e.value.field == field


def test_other_policies_keep_caching_off_by_default():
    assert not Simulation(compose_cfg("workload.num_requests=5")).prefix_caching


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A decode jump whose new blocks evict the cached prefix a waiting request would hit.
@example(seed=0, qps=10.0, blocks=36, tokens=256, prefix=40, layout="disaggregated",
         order="fcfs")
@example(seed=0, qps=5.0, blocks=39, tokens=256, prefix=40, layout="disaggregated",
         order="fcfs")
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 120.0), blocks=st.integers(30, 300),
       tokens=st.sampled_from([64, 256, 2048]), prefix=st.sampled_from([0, 40, 200]),
       layout=st.sampled_from(["single", "replicas", "disaggregated"]),
       order=st.sampled_from(["fcfs", "priority"]))
def test_fast_equals_exact(seed, qps, blocks, tokens, prefix, layout, order):
    cluster = {"single": [], "replicas": ["cluster.num_replicas=2"],
               "disaggregated": ["cluster=disaggregated"]}[layout]
    assert_fast_equals_exact([
        "model=tiny", "policy=vllm_v1", f"seed={seed}", f"workload.qps={qps}",
        "workload.num_requests=40", "workload.prompt_len.max=300",
        "workload.output_len.max=150", f"workload.shared_prefix_len={prefix}",
        "workload.num_prefix_groups=2", f"kv.num_gpu_blocks_override={blocks}",
        f"policy.max_num_batched_tokens={tokens}", "policy.max_num_seqs=16",
        f"policy.scheduling_policy={order}", "workload.priorities=[1,1,2]", *cluster])
