"""Property tests over every registered policy: random workloads, pool sizes and options.

After every step the KV integrity check holds (the harness runs it); every recorded plan stays
within the token budget and the seat limit; replaying the plans row by row reproduces the
request state machine (a row starts exactly where the request's computed tokens stand, a
recompute restarts from 0 and samples only after prompt + generated tokens, a swap keeps
progress); the block table always covers the computed context; and in the end every request
finished with all its tokens or was rejected, and every block is free again.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import policies
from sim.request import Request, RequestStatus
from tests.harness import Run, run_requests

modes = st.sampled_from(["recompute", "swap"])
tokens = st.integers(16, 64)
seats = st.integers(1, 6)

# One strategy per registered policy; a policy registered without one fails the test below.
POLICY_OPTIONS = {
    "fcfs": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats, "preemption_mode": modes}),
    "static": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats,
        "max_batch_size": st.none() | st.integers(1, 4)}),
    "sjf": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats, "preemption_mode": modes,
        "predictor": st.sampled_from(["oracle", "noisy", "bucket"]),
        "bucket_edges": st.just([4, 12]), "aging_s": st.none() | st.sampled_from([0.0, 3.0]),
        "preemptive": st.booleans(), "preemption_ratio": st.sampled_from([1.5, 4.0])}),
    "chunked_prefill": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats, "preemption_mode": modes,
        "max_num_partial_prefills": st.integers(1, 3)}),
    "priority": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats, "preemption_mode": modes,
        "preemptive": st.booleans()}),
    "vllm_v1": st.fixed_dictionaries({"max_num_batched_tokens": tokens, "max_num_seqs": seats,
                                      "scheduling_policy": st.sampled_from(["fcfs", "priority"])}),
    "trtllm": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats,
        "enable_chunked_prefill": st.booleans(),
        "capacity_scheduler_policy": st.sampled_from(["guaranteed_no_evict",
                                                      "max_utilization"])}),
    "sglang": st.fixed_dictionaries({
        "max_num_batched_tokens": tokens, "max_num_seqs": seats,
        "chunked_prefill_size": st.integers(1, 40),
        "schedule_policy": st.sampled_from(["fcfs", "lpm"]),
        "schedule_conservativeness": st.sampled_from([0.05, 0.3, 1.0, 2.0])}).filter(
            lambda o: max(o["chunked_prefill_size"], o["max_num_seqs"])
            <= o["max_num_batched_tokens"]),
}

workloads = st.lists(
    st.tuples(st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0]), st.integers(1, 30),
              st.integers(1, 16), st.integers(0, 2)),
    min_size=1, max_size=10)
pools = st.tuples(st.sampled_from([1, 2, 4]), st.integers(6, 40), st.integers(0, 20))


def make_requests(spec: list[tuple[float, int, int, int]]) -> list[Request]:
    t, out = 0.0, []
    for i, (gap, prompt, output, pri) in enumerate(spec):
        t += gap
        out.append(Request(i, t, prompt, output, priority=pri))
    return out


def check_run(run: Run, cfg: dict, block_size: int) -> None:
    pol = run.replica.policy.config
    seat_limit = getattr(pol, "batch_size", pol.max_num_seqs)
    by_id = {r.request_id: r for r in run.requests}
    computed = dict.fromkeys(by_id, 0)
    outputs = dict.fromkeys(by_id, 0)
    for i, st_ in enumerate(run.steps):
        assert sum(n for _, _, n, _ in st_.rows) <= pol.max_num_batched_tokens, i
        assert st_.num_running_after <= seat_limit, i
        for rid in st_.recomputed:
            computed[rid] = 0
        for rid, start, n, sample in st_.rows:
            req = by_id[rid]
            assert start == computed[rid], (i, rid, "row does not start where it stopped")
            computed[rid] += n
            assert len(st_.tables[rid]) * block_size >= computed[rid], (i, rid)
            known = req.prompt_len + outputs[rid]
            assert computed[rid] <= known
            assert sample == (computed[rid] == known), (i, rid)
            outputs[rid] += sample
        if cfg["name"] == "chunked_prefill":  # stall-free: every decode ran unless preempted
            lost = set(st_.recomputed) | set(st_.swapped_out)
            for rid, pending in st_.running_before.items():
                assert pending > 1 or rid in st_.grants or rid in lost, (i, rid, "stalled")
    for r in run.requests:
        assert r.status in (RequestStatus.FINISHED, RequestStatus.REJECTED), r
        if r.status is RequestStatus.FINISHED:
            assert r.num_output_tokens == outputs[r.request_id] == r.max_output_len
        else:
            assert r.reject_reason
    kv = run.replica.kv
    assert kv.num_used_blocks == 0 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    assert run.metrics.completed + run.metrics.rejected == len(run.requests)
    assert (run.metrics.num_preemptions
            == run.metrics.num_swaps + run.metrics.num_recomputes)


@pytest.mark.parametrize("name", policies.POLICIES.names())
def test_every_policy_keeps_kv_budgets_and_progress_on_random_workloads(name):
    if name not in POLICY_OPTIONS:
        pytest.fail(f"policy {name!r} has no strategy in POLICY_OPTIONS: add one")

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(options=POLICY_OPTIONS[name], spec=workloads, pool=pools, seed=st.integers(0, 3))
    def check(options, spec, pool, seed):
        block_size, gpu, cpu = pool
        cfg = {"name": name, **options}
        reqs = make_requests(spec)
        run = run_requests(cfg, reqs, num_gpu_blocks=gpu, block_size=block_size,
                           num_cpu_blocks=cpu, seed=seed)
        check_run(run, cfg, block_size)

    check()
