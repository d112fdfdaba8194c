"""TensorRT-LLM's in-flight batching (``policy=trtllm``) against schedules worked out by hand
on tiny pools, its two capacity policies, its settings, and fast equals exact."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.request import Request
from tests.harness import run_requests
from tests.helpers import compose_cfg
from tests.test_fast_forward import _assert_same

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

TRT = {"name": "trtllm", "max_num_seqs": 4, "max_num_batched_tokens": 8}
# A(3 prompt, 3 out) and B(3, 3) need 5 KV tokens each by their end (the last sampled token
# needs none): 3 blocks of 2; C(2, 4) needs 5 tokens, 3 blocks. The pool holds 6 blocks.
def three() -> list[Request]:
    return [Request(0, 0.0, 3, 3), Request(1, 0.0, 3, 3), Request(2, 0.0, 2, 4)]


def test_guaranteed_no_evict_admits_whole_lengths_and_never_pauses():
    """t=0: A and B are admitted holding their whole lengths (blocks 0-2 and 3-5); C's prompt
    fits the token budget but its 3 blocks do not, and nothing after it is looked at. A and B
    decode together and finish at t=3; only then C is admitted, with all of its blocks."""
    run = run_requests({**TRT, "capacity_scheduler_policy": "guaranteed_no_evict"}, three(),
                       num_gpu_blocks=6, block_size=2)
    s = run.steps
    assert [(st.time, st.rows, st.recomputed) for st in s] == [
        (0.0, [(0, 0, 3, True), (1, 0, 3, True)], []),
        (1.0, [(0, 3, 1, True), (1, 3, 1, True)], []),
        (2.0, [(0, 4, 1, True), (1, 4, 1, True)], []),
        (3.0, [(2, 0, 2, True)], []),
        (4.0, [(2, 2, 1, True)], []),
        (5.0, [(2, 3, 1, True)], []),
        (6.0, [(2, 4, 1, True)], []),
    ]
    assert s[0].tables == {0: [0, 1, 2], 1: [3, 4, 5]}
    assert s[3].tables == {2: [2, 1, 0]}
    assert run.metrics.num_preemptions == 0


def test_max_utilization_admits_on_the_prompts_blocks_and_pauses_the_last_admitted():
    """t=0: all three prompts in one step (8 tokens; 5 blocks for their prompts). t=1: every
    request decodes, C takes the last free block. t=2: A's next token needs a block and none
    is free: C, admitted last, is paused (blocks 4 and 5 freed; A takes 5, B 4). t=3: C is
    computed again, its prompt and its 2 generated tokens."""
    run = run_requests({**TRT, "capacity_scheduler_policy": "max_utilization"}, three(),
                       num_gpu_blocks=6, block_size=2)
    s = run.steps
    assert [(st.time, st.rows, st.recomputed) for st in s] == [
        (0.0, [(0, 0, 3, True), (1, 0, 3, True), (2, 0, 2, True)], []),
        (1.0, [(0, 3, 1, True), (1, 3, 1, True), (2, 2, 1, True)], []),
        (2.0, [(0, 4, 1, True), (1, 4, 1, True)], [2]),
        (3.0, [(2, 0, 4, True)], []),
        (4.0, [(2, 4, 1, True)], []),
    ]
    assert [st.tables for st in s[:4]] == [
        {0: [0, 1], 1: [2, 3], 2: [4]}, {0: [0, 1], 1: [2, 3], 2: [4, 5]},
        {0: [0, 1, 5], 1: [2, 3, 4]}, {2: [5, 1]}]


def test_chunked_context_starts_a_long_prompt_beside_the_others():
    """Budget 8 with enable_chunked_context: A's 3 tokens and the first 5 of B's 9-token
    prompt share step 0 (B holds its whole length, 5 blocks, from then on); B's last 4 come
    beside A's decode at t=1."""
    run = run_requests({**TRT, "enable_chunked_prefill": True},
                       [Request(0, 0.0, 3, 3), Request(1, 0.0, 9, 2)],
                       num_gpu_blocks=12, block_size=2)
    assert [st.rows for st in run.steps] == [
        [(0, 0, 3, True), (1, 0, 5, False)],
        [(0, 3, 1, True), (1, 5, 4, True)],
        [(0, 4, 1, True), (1, 9, 1, True)],
    ]
    assert run.steps[0].tables == {0: [0, 1, 2], 1: [3, 4, 5, 6, 7]}


@pytest.mark.parametrize(("override", "field"), [
    ("policy.capacity_scheduler_policy=static_batch", "policy.capacity_scheduler_policy"),
    ("policy.preemption_mode=swap", "policy.preemption_mode"),
    ("policy.kv_watermark=0.01", "policy.kv_watermark"),
    ("policy.max_num_seqs=0", "policy.max_num_seqs"),
])
def test_bad_settings_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg("policy=trtllm", override))
    assert e.value.field == field


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), blocks=st.integers(30, 200), qps=st.floats(2.0, 80.0),
       chunked=st.booleans())
def test_guaranteed_no_evict_never_pauses_and_fast_equals_exact(seed, blocks, qps, chunked):
    """Tight pools, every arrival rate: nobody is ever paused, every request is served or
    refused, and decode jumps give the step-by-step schedule."""
    s = _assert_same([
        "policy=trtllm", "model=tiny", f"seed={seed}", f"kv.num_gpu_blocks_override={blocks}",
        f"workload.qps={qps}", "workload.num_requests=40", "workload.prompt_len.max=200",
        "workload.output_len.max=120", f"policy.enable_chunked_prefill={str(chunked).lower()}",
        "policy.max_num_batched_tokens=512", "policy.max_num_seqs=64", "check_integrity=false"])
    assert s["num_preemptions"] == 0
    assert s["completed"] + s["rejected"] == 40


@pytest.mark.parametrize(("policy", "paused"), [("trtllm", False), ("fcfs", True)])
def test_a_decode_pool_reserves_whole_lengths_under_guaranteed_no_evict(policy, paused):
    """Disaggregated, 40 blocks per replica: the decode replica holds a transferred request's
    whole length, as the policy's own admission does, so its decodes never pause, where
    FCFS's on the same load preempt."""
    s = Simulation(compose_cfg(
        "cluster=disaggregated", f"policy={policy}", "model=tiny", "workload.num_requests=60",
        "workload.qps=200", "kv.num_gpu_blocks_override=40", "workload.prompt_len.max=200",
        "workload.output_len.max=300")).run().summary
    assert s["completed"] == 60 and (s["num_preemptions"] > 0) == paused


def test_a_prefill_replica_reserves_prompts_only():
    """Its requests leave after their first token (TensorRT-LLM's context servers run them
    with one output token), so guaranteed_no_evict there holds the prompt: a 4-block prefill
    replica of 16-token blocks admits four 16-token prompts with long outputs at once."""
    from tests.test_disaggregation import run_disaggregated

    reqs = [Request(i, 0.0, 16, 100) for i in range(4)]
    run = run_disaggregated(reqs, prefill_policy={"name": "trtllm"}, prefill_blocks=4,
                            decode_blocks=64)
    assert [r[0] for r in run.executors[0].steps[0].rows] == [0, 1, 2, 3]


@pytest.mark.parametrize("chunked", ["true", "false"])
def test_max_utilization_pauses_and_fast_equals_exact(chunked):
    """A tight pool under max_utilization: requests are paused (recomputed), and decode jumps
    give the step-by-step schedule, with and without chunked context."""
    s = _assert_same([
        "policy=trtllm", "policy.capacity_scheduler_policy=max_utilization", "model=tiny",
        "kv.num_gpu_blocks_override=40", "workload.qps=30", "workload.num_requests=60",
        "workload.prompt_len.max=200", "workload.output_len.max=150",
        f"policy.enable_chunked_prefill={chunked}", "policy.max_num_batched_tokens=512",
        "policy.max_num_seqs=64"])
    assert s["num_preemptions"] > 0 and s["num_decode_jumps"] > 0
