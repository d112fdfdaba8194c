"""Prefill/decode disaggregation on tiny cases with fixed 1 s steps: exact timelines, the KV
link, back-pressure, and conservation across the cluster."""

import copy
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from experiments.simulation import run_simulation
from sim.cluster.link import LinkConfig
from sim.request import Request, RequestStatus
from tests.cluster_harness import run_disaggregated
from tests.helpers import compose_cfg

# Harness defaults: 1 s steps, 1000 bytes of KV per token, a link of 16,000 B/s and 0.5 s
# latency, so a 32-token prompt (two 16-token blocks) takes 2.0 s + 0.5 s to move.
XFER = 2.5


def test_single_request_ttft_is_prefill_time_and_first_decode_follows_the_transfer():
    r = Request(0, 0.0, 32, 3)
    run = run_disaggregated([r])
    assert r.ttft == 1.0  # one prefill step, no queueing
    assert list(r.token_times) == [1.0, 1.0 + XFER + 1.0, 1.0 + XFER + 2.0]
    assert r.status is RequestStatus.FINISHED and r.replica_id == 1
    row = run.rows[0]
    assert (row["prefill_replica_id"], row["decode_replica_id"]) == (0, 1)
    assert row["kv_transfer_bytes"] == 32_000
    assert float(row["kv_backpressure_wait"]) == 0.0
    assert float(row["kv_transfer_time"]) == pytest.approx(XFER)
    # The prefill replica ran one step; the decode replica's first step continues at position
    # 32 over the two transferred blocks plus a fresh one for token 33.
    pre, dec = run.executors
    assert [s.rows for s in pre.steps] == [[(0, 0, 32, True)]]
    assert [(s.time, s.rows) for s in dec.steps] == [
        (1.0 + XFER, [(0, 32, 1, True)]), (2.0 + XFER, [(0, 33, 1, True)])]
    assert dec.steps[0].tables[0] == [0, 1, 2]
    for rep in run.replicas:
        assert rep.kv.num_used_blocks == 0


def test_queueing_adds_to_ttft_and_transfers_queue_on_the_link():
    a, b = Request(0, 0.0, 32, 2), Request(1, 0.0, 32, 2)
    run = run_disaggregated([a, b], prefill_policy={"name": "fcfs", "max_num_seqs": 1})
    assert a.ttft == 1.0 and b.ttft == 2.0  # b's prefill waited one step for a's
    # a holds the ports from 1 to 3 and lands at 3.5; b asks at 2, sends 3..5, lands at 5.5.
    assert a.token_times[1] == 1.0 + XFER + 1.0
    assert b.token_times[1] == 5.5 + 1.0
    rows = {r["request_id"]: r for r in run.rows}
    assert float(rows[0]["kv_transfer_time"]) == pytest.approx(2.5)
    assert float(rows[1]["kv_transfer_time"]) == pytest.approx(3.5)  # 1 s queued on the port
    s = run.deployment.summary(run.env.now)
    assert s["num_kv_transfers"] == 2 and s["kv_backpressure_count"] == 0
    assert s["link_utilization_per_port"][0] == pytest.approx(4.0 / run.env.now)


def test_decode_pool_full_makes_the_request_wait_on_the_prefill_side_holding_its_blocks():
    # Decode replica: 3 blocks. a (32 + 17 tokens) fills it; b must wait until a finishes.
    a, b = Request(0, 0.0, 32, 17), Request(1, 0.0, 32, 2)
    link = LinkConfig(bandwidth_gbps=1e-3, latency_us=0.0)  # 32 ms per prompt
    run = run_disaggregated([a, b], decode_blocks=3, link=link)
    dep = run.deployment
    assert dep.num_backpressured == 1
    assert a.ttft == b.ttft == 1.0  # one prefill step for both
    rows = {r["request_id"]: r for r in run.rows}
    assert float(rows[0]["kv_backpressure_wait"]) == 0.0
    # b could only reserve when a finished and freed the decode blocks.
    assert float(rows[1]["kv_backpressure_wait"]) == pytest.approx(a.finish_time - 1.0)
    assert b.token_times[1] == pytest.approx(a.finish_time + 0.032 + 1.0)
    assert dep.summary(run.env.now)["kv_backpressure_count"] == 1


def test_backpressure_keeps_prefill_blocks_until_the_transfer():
    a, b = Request(0, 0.0, 32, 17), Request(1, 0.0, 32, 2)
    run = run_disaggregated([a, b], decode_blocks=3,
                            link=LinkConfig(bandwidth_gbps=1e-3, latency_us=0.0))
    pre = run.replicas[0]
    # While b waited, the prefill replica's KV still held b's two blocks: the peak is 4
    # (a's and b's prompts) even though a's left after 32 ms.
    assert pre.kv.peak_used_blocks == 4
    assert pre.kv.num_used_blocks == 0


def test_one_token_request_finishes_on_the_prefill_replica():
    r = Request(0, 0.0, 20, 1)
    run = run_disaggregated([r])
    assert r.finish_time == 1.0 and r.replica_id == 0
    assert run.rows[0]["decode_replica_id"] == ""
    assert run.deployment.link.num_transfers == 0


def test_decode_pool_that_cannot_hold_the_request_rejects_it_at_arrival():
    r = Request(0, 0.0, 32, 40)  # 71 tokens -> 5 blocks > 3
    run = run_disaggregated([r], decode_blocks=3)
    assert r.status is RequestStatus.REJECTED and "decode replica" in r.reject_reason
    assert run.metrics.rejected == 1 and len(run.rows) == 1


def test_tensor_parallel_lanes_divide_the_transfer_time():
    r = Request(0, 0.0, 32, 2)
    run_disaggregated([r], lanes=2)
    assert r.token_times[1] == 1.0 + (1.0 + 0.5) + 1.0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20), st.integers(1, 60), st.integers(1, 30)),
                min_size=1, max_size=25),
       st.integers(1, 3), st.integers(1, 3), st.sampled_from(["round_robin", "least_outstanding",
                                                               "least_kv", "power_of_two"]))
def test_conservation_every_request_finishes_exactly_once_on_one_decode_replica(
        specs, num_prefill, num_decode, router):
    reqs = [Request(i, t, p, o) for i, (t, p, o) in enumerate(specs)]
    run = run_disaggregated(reqs, num_prefill=num_prefill, num_decode=num_decode,
                            prefill_blocks=12, decode_blocks=8, block_size=8,
                            link=LinkConfig(bandwidth_gbps=1e-5, latency_us=1e5),
                            router=router, decode_router=router,
                            prefill_policy={"name": "fcfs", "max_num_batched_tokens": 64})
    ids = [r["request_id"] for r in run.rows]
    assert sorted(ids) == list(range(len(reqs)))  # one row per request
    decode_ids = set(range(num_prefill, num_prefill + num_decode))
    for r in reqs:
        if r.status is RequestStatus.REJECTED:
            continue
        assert r.status is RequestStatus.FINISHED and r.num_output_tokens == r.max_output_len
        assert run.finished.count(r) == 1
        if r.max_output_len > 1:
            assert r.replica_id in decode_ids
    assert run.metrics.completed + run.metrics.rejected == len(reqs)
    assert run.deployment.num_unfinished == 0 and not run.deployment.records
    for rep in run.replicas:
        assert rep.kv.num_used_blocks == 0
        rep.kv.check_integrity()


# ---- regressions: any policy on either pool --------------------------------------------------

def test_static_decode_pool_reserves_whole_length_at_transfer():
    # a needs 3 blocks in all (32 + 17 - 1 tokens), b one. Reserving only the transferred KV
    # (2 blocks for a) let b in, and a's decode at position 32 found no slot for static batching.
    a, b = Request(0, 0.0, 32, 17), Request(1, 0.0, 16, 2)
    run = run_disaggregated([a, b], decode_blocks=3, decode_policy={"name": "static"})
    dec = run.executors[1]
    assert dec.steps[0].tables[0] == [0, 1, 2]  # a's whole length from its first decode
    assert run.deployment.num_backpressured == 1  # b waited for a's blocks
    assert float(run.rows[1]["kv_backpressure_wait"]) == pytest.approx(a.finish_time - 1.0)
    assert a.status is b.status is RequestStatus.FINISHED


def test_static_decode_pool_batches_transfers_that_land_while_a_batch_decodes():
    a, b = Request(0, 0.0, 16, 5), Request(1, 1.2, 16, 3)
    run = run_disaggregated([a, b], decode_policy={"name": "static"})
    # b lands at 3.7 while a's batch decodes; it holds its blocks and waits for a's end.
    assert list(a.token_times) == [1.0, 3.5, 4.5, 5.5, 6.5]
    assert list(b.token_times) == [2.2, 7.5, 8.5]
    assert [(s.time, s.rows, s.tables) for s in run.executors[1].steps][3:] == [
        (5.5, [(0, 19, 1, True)], {0: [0, 1]}),
        (6.5, [(1, 16, 1, True)], {1: [2, 3]}), (7.5, [(1, 17, 1, True)], {1: [2, 3]})]


def test_static_on_both_pools_batches_each_side():
    reqs = [Request(0, 0.0, 16, 5), Request(1, 0.0, 16, 3), Request(2, 0.0, 16, 2)]
    static2 = {"name": "static", "max_batch_size": 2}
    run = run_disaggregated(reqs, prefill_policy=static2, decode_policy=static2,
                            prefill_blocks=4)
    pre, dec = run.executors
    # A prefill replica holds prompts only (1 block each, StepBuilder.held_length): c's batch
    # starts as soon as a's and b's has ended, while their KV is still on its way out.
    assert [(s.time, [r[0] for r in s.rows]) for s in pre.steps] == [(0.0, [0, 1]), (1.0, [2])]
    assert [(s.time, [r[0] for r in s.rows]) for s in dec.steps] == [
        (2.5, [0]), (3.5, [0]), (4.5, [0]), (5.5, [0]), (6.5, [1, 2]), (7.5, [1])]


def test_static_prefill_pool_rejects_what_it_could_never_reserve():
    # An 80-token prompt: 5 blocks > 4 the prefill replica has (it holds prompts only).
    r = Request(0, 0.0, 80, 2)
    run = run_disaggregated([r], prefill_policy={"name": "static"}, prefill_blocks=4)
    assert r.status is RequestStatus.REJECTED and "exceeds_kv_pool" in r.reject_reason
    assert run.deployment.num_unfinished == 0


def test_sjf_prefill_forgets_a_request_it_handed_off_once_the_decode_side_recomputes_it():
    # x is admitted by predicted length (not yet aged), leaving a live by-arrival entry on the
    # prefill replica; the 4-block decode replica recomputes x at 5.75 (PREEMPTED there);
    # y's admission at 6.5 walked that entry as aged and waiting: "not in deque".
    a, x, y = Request(0, 0.0, 4, 10), Request(1, 0.5, 4, 10), Request(2, 6.5, 4, 2)
    run = run_disaggregated([a, x, y], prefill_policy={"name": "sjf", "aging_s": 2.0},
                            decode_blocks=4, block_size=4)
    assert x.num_recomputes == 1 and x.replica_id == 1
    assert [r.status for r in (a, x, y)] == [RequestStatus.FINISHED] * 3
    assert [s.rows for s in run.executors[0].steps][-1] == [(2, 0, 4, True)]  # y alone


def test_sjf_decode_pool_predicts_the_remaining_output_of_transferred_requests():
    reqs = [Request(0, 0.0, 16, 9), Request(1, 0.0, 16, 3), Request(2, 0.0, 16, 5)]
    run = run_disaggregated(reqs, decode_policy={"name": "sjf"},
                            link=LinkConfig(bandwidth_gbps=1.0, latency_us=0.0))
    # Oracle: 1 token generated + the remaining (max - 1) = the whole output.
    assert [r.extra["predicted_output_len"] for r in reqs] == [9.0, 3.0, 5.0]
    # Once all three decode there, rows go shortest predicted remainder first.
    full = [[row[0] for row in s.rows] for s in run.executors[1].steps if len(s.rows) == 3]
    assert full and all(order == [1, 2, 0] for order in full)
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


# ---- every policy on every side, through the real config, under KV pressure -----------------

# Options beyond name and preemption mode, per policy; a policy registered without an entry
# fails the test below, so new policies join this property.
SIDE_OPTIONS = {
    "fcfs": st.fixed_dictionaries({"max_num_seqs": st.sampled_from([4, 256])}),
    "static": st.fixed_dictionaries({"max_batch_size": st.none() | st.integers(1, 8)}),
    "sjf": st.fixed_dictionaries({
        "predictor": st.sampled_from(["oracle", "noisy", "bucket"]),
        "aging_s": st.sampled_from([None, 0.0, 0.5, 30.0]), "preemptive": st.booleans()}),
    "chunked_prefill": st.fixed_dictionaries({"max_num_batched_tokens": st.sampled_from(
        [256, 512])}),
    "priority": st.fixed_dictionaries({"preemptive": st.booleans()}),
    "vllm_v1": st.fixed_dictionaries({"max_num_batched_tokens": st.sampled_from([512, 2048]),
                                      "preemption_mode": st.just("recompute")}),
    "sglang": st.fixed_dictionaries({"chunked_prefill_size": st.sampled_from([256, 2048]),
                                     "schedule_policy": st.sampled_from(["fcfs", "lpm"]),
                                     "preemption_mode": st.just("recompute")}),
    "trtllm": st.fixed_dictionaries({
        "capacity_scheduler_policy": st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
        "enable_chunked_prefill": st.booleans(), "preemption_mode": st.just("recompute")}),
}
# Policies that preempt by recompute only (no swap space, or retraction).
RECOMPUTE_ONLY = ("vllm_v1", "sglang", "trtllm")
side_policies = st.sampled_from(sorted(SIDE_OPTIONS)).flatmap(
    lambda name: SIDE_OPTIONS[name].map(lambda opts: {"name": name, **opts}))


@cache
def _base_cfg(cluster: str) -> dict:
    # Short prompts and outputs, tight pools: decodes run the pools dry, so both sides preempt
    # (recompute or swap), and transfers wait for decode blocks.
    return compose_cfg(
        f"cluster={cluster}", "workload.num_requests=40", "workload.qps=40",
        "workload.prompt_len.median=150", "workload.prompt_len.max=500",
        "workload.output_len.median=150", "workload.output_len.max=500",
        "workload.priorities=[1,1,1]", "kv.num_cpu_blocks=30", "check_integrity=true",
        "record_steps=false", *(["cluster.num_replicas=2"] if cluster == "single" else []))


def test_every_policy_has_cluster_property_options():
    assert set(SIDE_OPTIONS) == set(policies.POLICIES.names())


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["single", "disaggregated"]), side_policies, side_policies,
       st.sampled_from(["recompute", "swap"]), st.integers(40, 120), st.integers(0, 10_000))
def test_any_policies_on_either_deployment_finish_every_request_with_intact_kv(
        cluster, first, second, mode, blocks, seed):
    cfg = copy.deepcopy(_base_cfg(cluster))
    cfg["seed"] = seed
    cfg["kv"]["num_gpu_blocks_override"] = blocks
    if cluster == "single":  # two co-located replicas running ``first``
        cfg["policy"] = {**first, "preemption_mode": mode if first["name"] not in
                         RECOMPUTE_ONLY else "recompute"}
    else:  # ``first`` on the prefill pool, ``second`` on the decode pool
        cfg["policy"] = {"name": "fcfs", "preemption_mode": mode}
        cfg["cluster"]["prefill"]["policy"] = first
        cfg["cluster"]["decode"]["policy"] = second
    res = run_simulation(cfg)  # check_integrity: the KV pools are checked after every step
    s = res.summary
    assert s["completed"] + s["rejected"] == 40
    assert res.deployment.num_unfinished == 0
    for rep in res.replicas:
        assert rep.kv.num_used_blocks == 0 and not rep.kv.block_tables
        rep.kv.check_integrity()
