"""Fast equals exact on random small workloads where the other files hold fixed cases:
multi-turn conversations (closed loop, prefix caching), the offload tier, SGLang's
scheduler, and disaggregated deployments whose prefill and decode pools run different
policies. ``assert_fast_equals_exact`` compares the schedules, block ids (the free queues) and
times."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_cluster_fast_exact import assert_fast_equals_exact

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# What a pool's policy section needs beside its name over the run's fcfs section.
POOL_POLICY = {"chunked_prefill": {"enable_chunked_prefill": "true"},
               "vllm_v1": {"enable_chunked_prefill": "true", "kv_watermark": "0"},
               "sglang": {"enable_chunked_prefill": "true", "kv_watermark": "0"}}


def _multi_turn(seed: int, sessions: int, qps: float, think: float) -> list[str]:
    return ["model=tiny", f"seed={seed}", "workload=multi_turn",
            f"workload.num_sessions={sessions}", f"workload.qps={qps}",
            f"workload.think_time_s={think}", "workload.system_prompt_len=100",
            "workload.user_len.max=300", "workload.output_len.max=120",
            "workload.max_prompt_len=1500"]


@SETTINGS
@given(seed=st.integers(0, 10_000), sessions=st.integers(5, 20), qps=st.floats(1.0, 20.0),
       think=st.floats(0.0, 1.0, allow_subnormal=False),  # (the config refuses subnormals)
       blocks=st.integers(60, 400),
       policy=st.sampled_from(["fcfs", "sjf", "vllm_v1", "sglang"]), swap=st.booleans(),
       replicas=st.sampled_from([1, 2]))
def test_multi_turn_conversations(seed, sessions, qps, think, blocks, policy, swap, replicas):
    swap = swap and policy in ("fcfs", "sjf")  # the others preempt by recompute only
    assert_fast_equals_exact([
        *_multi_turn(seed, sessions, qps, think), f"policy={policy}",
        "kv.enable_prefix_caching=true", "policy.max_num_seqs=8",
        f"kv.num_gpu_blocks_override={blocks}",
        f"policy.preemption_mode={'swap' if swap else 'recompute'}",
        f"cluster.num_replicas={replicas}", "cluster.router=prefix_aware"])


@SETTINGS
@given(seed=st.integers(0, 10_000), sessions=st.integers(5, 20), qps=st.floats(1.0, 20.0),
       blocks=st.integers(80, 300), offload=st.integers(1, 120),
       block_size=st.sampled_from([4, 16]), policy=st.sampled_from(["fcfs", "vllm_v1",
                                                                   "sglang"]))
def test_an_offload_tier(seed, sessions, qps, blocks, offload, block_size, policy):
    blocks = blocks * 16 // block_size
    assert_fast_equals_exact([
        *_multi_turn(seed, sessions, qps, 0.2), f"policy={policy}",
        "kv.enable_prefix_caching=true", "policy.max_num_seqs=8",
        f"kv.block_size={block_size}", f"kv.num_gpu_blocks_override={blocks}",
        "kv.num_cpu_blocks=0", f"kv.num_offload_blocks={offload * 16 // block_size}"])


@SETTINGS
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 150.0), blocks=st.integers(40, 300),
       chunk=st.sampled_from([64, 128, 512]), lpm=st.booleans(),
       prefix=st.integers(0, 200), replicas=st.sampled_from([1, 2]))
def test_sglang(seed, qps, blocks, chunk, lpm, prefix, replicas):
    assert_fast_equals_exact([
        "model=tiny", f"seed={seed}", f"workload.qps={qps}", "workload.num_requests=40",
        "workload.prompt_len.max=300", "workload.output_len.max=150",
        f"workload.shared_prefix_len={prefix}", "workload.num_prefix_groups=2",
        "policy=sglang", f"policy.chunked_prefill_size={chunk}",
        f"policy.schedule_policy={'lpm' if lpm else 'fcfs'}", "policy.max_num_seqs=16",
        f"kv.num_gpu_blocks_override={blocks}", f"cluster.num_replicas={replicas}",
        "cluster.router=least_outstanding"])


@SETTINGS
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 120.0), blocks=st.integers(60, 300),
       prefill=st.sampled_from(["fcfs", "chunked_prefill", "vllm_v1", "sglang"]),
       decode=st.sampled_from(["fcfs", "sjf", "priority", "chunked_prefill", "vllm_v1"]),
       num_decode=st.integers(1, 2))
def test_different_policies_on_the_prefill_and_decode_pools(seed, qps, blocks, prefill, decode,
                                                            num_decode):
    pools = []
    for side, name in (("prefill", prefill), ("decode", decode)):
        pools.append(f"+cluster.{side}.policy.name={name}")
        pools += [f"+cluster.{side}.policy.{k}={v}"
                  for k, v in POOL_POLICY.get(name, {}).items()]
    assert_fast_equals_exact([
        "model=tiny", f"seed={seed}", f"workload.qps={qps}", "workload.num_requests=40",
        "workload.prompt_len.max=300", "workload.output_len.max=150",
        "workload.priorities=[1,1,2]", "policy=fcfs", "policy.max_num_seqs=16",
        f"kv.num_gpu_blocks_override={blocks}", "cluster=disaggregated",
        f"cluster.num_decode_replicas={num_decode}", *pools])
