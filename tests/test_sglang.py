"""SGLang's scheduler (``policy=sglang``) against schedules worked out by hand on tiny pools:
prefill batches before decode batches, one chunked prompt at a time, the conservative
new-token estimate, retraction, the ``lpm`` order; its engine defaults and config errors;
and runs that keep every request and the KV books."""

from __future__ import annotations

import pytest

from experiments.simulation import Simulation
from policies.sglang import SGLangPolicy
from sim.errors import ConfigError
from sim.request import Request
from tests.harness import run_requests
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import assert_fast_equals_exact

SG = {"name": "sglang", "max_num_seqs": 4, "max_num_batched_tokens": 16,
      "chunked_prefill_size": 6}


def test_prefill_batches_come_first_and_one_prompt_is_chunked_at_a_time():
    """Chunk 6: A's 4-token prompt and the first 2 of B's 8 (the chunk ends the batch); then
    B's last 6 alone, A waiting (no mixed batches); then both decode."""
    run = run_requests(SG, [Request(0, 0.0, 4, 3), Request(1, 0.0, 8, 2)],
                       num_gpu_blocks=40, block_size=2)
    assert [(s.time, s.rows) for s in run.steps] == [
        (0.0, [(0, 0, 4, True), (1, 0, 2, False)]),
        (1.0, [(1, 2, 6, True)]),
        (2.0, [(0, 4, 1, True), (1, 8, 1, True)]),
        (3.0, [(0, 5, 1, True)]),
    ]


def test_the_new_token_estimate_holds_a_request_back_and_decode_retracts():
    """8 blocks of 2 tokens, conservativeness 0.1 (new_token_ratio 0.07).
    t=0: A admitted (nothing runs); B's prompt + 10 outputs (12) exceed what is left of 16
    after A's 2 + 10 (4): it waits. t=1: 14 free tokens less A's 9 x 0.07: B fits and runs
    alone in a prefill batch. t=2: C. t=9: A and B hold all 8 blocks and each needs a ninth
    token: B, with as many outputs as A and the later arrival, is retracted to the queue's
    tail; the ratio becomes (7 decoded + 20) / 10, capped at 1. B is admitted again (its
    prompt and 7 outputs) once A has finished and nothing runs."""
    policy = {**SG, "chunked_prefill_size": 16, "schedule_conservativeness": 0.1}
    ratios = []
    retract = SGLangPolicy._retract

    def spy(self, step, running):
        left = retract(self, step, running)
        ratios.append((step.now, [r.request_id for r in left], self.new_token_ratio))
        return left

    SGLangPolicy._retract = spy
    try:
        run = run_requests(policy, [Request(0, 0.0, 2, 10), Request(1, 0.0, 2, 10),
                                    Request(2, 0.5, 2, 2)], num_gpu_blocks=8, block_size=2)
    finally:
        SGLangPolicy._retract = retract
    s = run.steps
    assert [(st.time, st.rows, st.recomputed) for st in s[:4]] == [
        (0.0, [(0, 0, 2, True)], []),
        (1.0, [(1, 0, 2, True)], []),
        (2.0, [(2, 0, 2, True)], []),
        (3.0, [(0, 2, 1, True), (1, 2, 1, True), (2, 2, 1, True)], []),
    ]
    assert (s[8].time, s[8].tables) == (8.0, {0: [0, 3, 6, 5], 1: [1, 4, 7, 2]})
    assert (s[9].time, s[9].rows, s[9].recomputed) == (9.0, [(0, 8, 1, True)], [1])
    assert ratios == [(9.0, [0], 1.0)]
    # Held back by the estimate (2 free blocks: 9 pending + 3 estimated) until A is gone.
    assert [(st.time, st.rows) for st in s[10:13]] == [
        (10.0, [(0, 9, 1, True)]), (11.0, [(0, 10, 1, True)]), (12.0, [(1, 0, 9, True)])]


def test_the_ratio_starts_over_once_the_engine_has_gone_idle():
    """A (t=0) prefills and decodes 4 batches; C arrives during A's last one, so the engine
    never idles before admitting it: the ratio has fallen by 4 decays. C then decodes 2
    batches and the engine idles until B (t=100), whose admission sees the initial 0.7."""
    seen = []
    rule = SGLangPolicy.prefill_rule

    def spy(self, *args, **kwargs):
        seen.append(self.new_token_ratio)
        return rule(self, *args, **kwargs)

    SGLangPolicy.prefill_rule = spy
    try:
        run_requests(SG, [Request(0, 0.0, 2, 5), Request(2, 4.5, 2, 3),
                          Request(1, 100.0, 2, 3)], num_gpu_blocks=40, block_size=2)
    finally:
        SGLangPolicy.prefill_rule = rule
    policy = SGLangPolicy(SGLangPolicy.config_class.from_dict(SG))
    policy._lower_ratio(4)
    assert seen == [0.7, policy.new_token_ratio, 0.7] and policy.new_token_ratio < 0.7


@pytest.mark.parametrize("order,first", [("fcfs", (1, 0, 9, True)), ("lpm", (2, 8, 1, True))])
def test_lpm_takes_the_longest_cached_prefix_first(order, first):
    """A computes the shared 8-token prefix and finishes. D (no prefix) and then C (the
    prefix) arrive at t=5 with one seat: fcfs gives it to D, lpm to C, whose cached prefix
    leaves it one token to compute."""
    prefix = ((3, 8),)
    reqs = [Request(0, 0.0, 9, 1, prefix=prefix), Request(1, 5.0, 9, 1),
            Request(2, 5.0, 9, 1, prefix=prefix)]
    run = run_requests({**SG, "max_num_seqs": 1, "chunked_prefill_size": 16,
                        "schedule_policy": order}, reqs,
                       num_gpu_blocks=40, block_size=4, enable_prefix_caching=True)
    at5 = [st for st in run.steps if st.time == 5.0]
    assert at5[0].rows == [first]


@pytest.mark.parametrize("hardware,chunk", [("a100_40gb", 4096), ("a100_80gb", 8192),
                                            ("h200", 8192), ("l40s", 4096)])
def test_engine_defaults_follow_the_gpu_and_the_radix_cache_is_on(hardware, chunk):
    sim = Simulation(compose_cfg("policy=sglang", f"hardware={hardware}",
                                 "workload.num_requests=5"))
    assert sim.policy.config.chunked_prefill_size == chunk
    assert sim.prefix_caching


@pytest.mark.parametrize("override,field", [
    ("policy.schedule_policy=lof", "policy.schedule_policy"),
    ("policy.preemption_mode=swap", "policy.preemption_mode"),
    ("policy.schedule_conservativeness=0", "policy.schedule_conservativeness"),
    ("policy.chunked_prefill_size=0", "policy.chunked_prefill_size"),
    ("policy.kv_watermark=0.01", "policy.kv_watermark"),
])
def test_bad_settings_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg("policy=sglang", override))
    assert e.value.field == field


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["policy.schedule_policy=lpm"],
                                   ["kv.num_offload_blocks=80"],
                                   ["cluster.num_replicas=2", "cluster.router=prefix_aware"],
                                   ["cluster.pipeline_parallel_size=2"]])
def test_tight_pools_keep_every_request_and_the_books(extra):
    base = ["model=tiny", "policy=sglang", "workload.num_requests=80", "workload.qps=160",
            "workload.shared_prefix_len=48", "workload.num_prefix_groups=3",
            "workload.prompt_len.max=300", "workload.output_len.max=150",
            "kv.num_gpu_blocks_override=60", "kv.num_cpu_blocks=0", "policy.chunked_prefill_size=128",
            *extra]
    s = Simulation(compose_cfg(*base, "check_integrity=true")).run().summary
    assert s["completed"] + s["rejected"] == 80 and s["completed"] > 0
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0
    assert_fast_equals_exact(base)


def test_a_prompt_that_fills_the_free_pool_exactly_starts_when_nothing_runs():
    """6 blocks of 1 token, a 6-token prompt: SGLang's estimate (prompt + output >= free)
    would hold it back forever; alone, it starts, one chunk of 1 per batch."""
    run = run_requests({**SG, "max_num_seqs": 1, "chunked_prefill_size": 1,
                        "schedule_conservativeness": 0.05}, [Request(0, 0.0, 6, 1)],
                       num_gpu_blocks=6, block_size=1)
    assert [(s.time, s.rows) for s in run.steps] == [
        (float(t), [(0, t, 1, t == 5)]) for t in range(6)]


def test_a_chunk_fills_the_slots_its_own_last_block_has_left():
    """6 blocks of 4 tokens, a 23-token prompt in chunks of 1: after token 21 the free pool
    is empty, but the prompt's last block still has slots for its last 2 tokens."""
    run = run_requests({**SG, "max_num_seqs": 1, "chunked_prefill_size": 1,
                        "schedule_conservativeness": 0.05}, [Request(0, 0.0, 23, 1)],
                       num_gpu_blocks=6, block_size=4)
    assert [(s.time, s.rows) for s in run.steps] == [
        (float(t), [(0, t, 1, t == 22)]) for t in range(23)]
    assert run.requests[0].num_output_tokens == 1


def test_the_cached_blocks_a_hit_takes_leave_the_budget():
    """10 blocks of 2. A computes the shared 8-token prefix (4 blocks) and finishes; at t=5 B
    (the prefix + 1 token, 6 outputs) takes those 4 cached blocks and a fifth: the 10 tokens
    left less B's 6 estimated leave 4, and C (2 + 6) waits, as in SGLang, where locking the
    prefix shrinks the evictable part of its budget."""
    prefix = ((3, 8),)
    run = run_requests({**SG, "chunked_prefill_size": 16},
                       [Request(0, 0.0, 9, 1, prefix=prefix), Request(1, 5.0, 9, 6, prefix=prefix),
                        Request(2, 5.0, 2, 6)],
                       num_gpu_blocks=10, block_size=2, enable_prefix_caching=True)
    at5 = next(s for s in run.steps if s.time == 5.0)
    assert at5.rows == [(1, 8, 1, True)] and at5.tables == {1: [0, 1, 2, 3, 5]}


def test_a_pipelined_replica_keeps_one_prompt_mid_chunk():
    """With two micro-batches in flight, a new prompt starts chunking only while no other
    is mid-chunk (SGLang's single ``chunked_req``): two prompts mid-chunk in a tight pool
    would hold every block between them, neither able to go on, and the run would stall.
    Fast and exact agree."""
    s = assert_fast_equals_exact([
        "model=tiny", "seed=9725", "policy=sglang", "policy.chunked_prefill_size=128",
        "workload.qps=100", "workload.num_requests=30", "workload.prompt_len.max=600",
        "workload.output_len.max=20", "policy.max_num_seqs=3",
        "kv.num_gpu_blocks_override=60", "cluster.pipeline_parallel_size=2"])
    assert s["completed"] == 30
