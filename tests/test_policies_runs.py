"""Policies over longer runs: SJF aging under sustained overload, preemption counts in
summary.json, seeded predictions through the real config, config errors naming the field,
and the StepBuilder's reservation API that static batching uses."""

from __future__ import annotations

import pytest

from experiments.simulation import Simulation, run_simulation
from sim.errors import ConfigError
from sim.kv_manager import KVBlockManager
from sim.request import Request, RequestStatus
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.harness import run_requests
from tests.helpers import small_cfg


def overload() -> list[Request]:
    """One seat, one step per second. Five short requests (1 or 2 steps each) at t=0, then
    one every 1.25 s for 300 s: 1.2x the capacity, so shorter requests always wait. A long
    request (8 steps) arrives at t=0.5."""
    reqs = [Request(i, 0.0, 2, 1 + i % 2) for i in range(5)]
    reqs += [Request(i, 1.25 * (i - 4), 2, 1 + i % 2) for i in range(5, 245)]
    reqs.append(Request(999, 0.5, 2, 8))
    return reqs


def queue_delays(reqs: list[Request]) -> dict[int, float]:
    return {r.request_id: r.first_scheduled_time - r.arrival_time for r in reqs}


def test_sjf_aging_serves_every_request_under_sustained_overload():
    cfg = {"name": "sjf", "max_num_seqs": 1, "max_num_batched_tokens": 64}
    starved = overload()
    run_requests({**cfg, "aging_s": None}, starved, num_gpu_blocks=64, block_size=4)
    aged = overload()
    run_requests({**cfg, "aging_s": 10.0}, aged, num_gpu_blocks=64, block_size=4)
    fcfs = overload()
    run_requests({**cfg, "name": "fcfs"}, fcfs, num_gpu_blocks=64, block_size=4)
    for reqs in (starved, aged, fcfs):
        assert all(r.status is RequestStatus.FINISHED for r in reqs)
    # Without aging the long request runs only once the overload is over (t > 300 s) ...
    assert queue_delays(starved)[999] > 300
    # ... with aging it heads the queue as soon as it has waited 10 s.
    assert queue_delays(aged)[999] <= 10.0 + 2
    # And no request waits much longer than under FCFS: aged requests go in arrival order.
    worst_fcfs = max(queue_delays(fcfs).values())
    assert max(queue_delays(aged).values()) <= worst_fcfs + 10.0 + 2
    assert max(queue_delays(starved).values()) > 4 * worst_fcfs


def test_summary_counts_preemptions_of_each_kind():
    common = ("kv.num_gpu_blocks_override=150", "workload.num_requests=80", "workload.qps=40")
    rec = run_simulation(small_cfg(*common)).summary
    assert rec["num_preemptions"] > 0 and rec["num_swaps"] == 0
    assert rec["num_recomputes"] == rec["num_preemptions"] and rec["num_swap_fallbacks"] == 0
    swap = run_simulation(small_cfg(*common, "policy.preemption_mode=swap",
                                    "kv.num_cpu_blocks=80")).summary
    assert swap["num_swaps"] > 0 and swap["num_swap_fallbacks"] > 0
    assert swap["num_preemptions"] == swap["num_swaps"] + swap["num_recomputes"]
    assert swap["num_recomputes"] >= swap["num_swap_fallbacks"]
    assert swap["completed"] == rec["completed"]


def test_sjf_predictions_follow_the_run_seed():
    def run(seed):
        cfg = small_cfg("policy=sjf", "policy.predictor=noisy", f"seed={seed}")
        res = Simulation(cfg, keep_requests=True).run()
        return {r.request_id: r.extra["predicted_output_len"] for r in res.requests}

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["static", "sjf", "chunked_prefill", "priority"])
def test_every_policy_runs_the_default_model_through_the_config(policy):
    res = run_simulation(small_cfg(f"policy={policy}", "workload.priorities=[1,1]",
                                   "kv.num_gpu_blocks_override=1500", "check_integrity=true"))
    assert res.summary["completed"] == 60 and res.summary["policy"] == policy


@pytest.mark.parametrize("override,field", [
    ("policy.predictor=psychic", "policy.predictor"),
    ("policy.bucket_edges=[512,128]", "policy.bucket_edges"),
    ("policy.bucket_accuracy=1.5", "policy.bucket_accuracy"),
    ("policy.preemption_ratio=1.0", "policy.preemption_ratio"),
    ("policy.aging_s=-1", "policy.aging_s"),
    ("+policy.max_batch_size=4", "policy.max_batch_size"),  # a static-only option
])
def test_sjf_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg("policy=sjf", override))
    assert e.value.field == field


@pytest.mark.parametrize("policy,override,field", [
    ("chunked_prefill", "policy.max_num_seqs=1024", "policy.max_num_seqs"),
    ("chunked_prefill", "policy.enable_chunked_prefill=false", "policy.enable_chunked_prefill"),
    ("chunked_prefill", "policy.max_num_partial_prefills=0", "policy.max_num_partial_prefills"),
    ("static", "policy.max_batch_size=0", "policy.max_batch_size"),
    ("priority", "+policy.aging_s=3", "policy.aging_s"),
])
def test_policy_config_errors_name_the_field(policy, override, field):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg(f"policy={policy}", override))
    assert e.value.field == field


def test_reserve_holds_whole_length_only_for_a_request_scheduled_this_step():
    kv = KVBlockManager(num_gpu_blocks=6, block_size=4)
    q = ReplicaQueues()
    step = StepBuilder(q, kv)
    a, b = Request(0, 0.0, 5, 8), Request(1, 0.0, 4, 30)
    q.waiting.extend([a, b])
    with pytest.raises(ValueError, match="scheduled in this step"):
        step.reserve(a, 12)
    assert step.schedule(a, 5)
    assert step.reserve(a, 12)  # prompt 5 + 8 outputs - 1
    assert kv.block_table(0) == [0, 1, 2]
    assert step.build().scheduled[0].block_table == [0, 1, 2]
    assert step.schedule(b, 4)
    assert not step.reserve(b, 33)  # 9 blocks: only 2 more free; nothing changes
    assert kv.block_table(1) == [3] and kv.num_free_blocks == 2
    assert step.granted(a) == 5 and step.granted(b) == 4
    kv.check_integrity()


@pytest.mark.parametrize("kind", ["oracle", "noisy", "bucket"])
def test_predictors_predict_what_remains_after_the_tokens_already_sampled(kind):
    from policies.predictors import make_predictor

    fresh, later = Request(0, 0.0, 8, 600), Request(1, 0.0, 8, 600)
    later.num_output_tokens = 550  # arrived at a decode replica with 550 tokens sampled
    p = make_predictor(kind, seed=0, noise_sigma=0.0, bucket_accuracy=1.0)
    # The true remainders are 600 and 50 (a long and a short class with edges 128, 512).
    assert (p(fresh), p(later)) == {"oracle": (600.0, 50.0), "noisy": (600.0, 50.0),
                                    "bucket": (1024.0, 64.0)}[kind]


@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize("aging", ["0.5", "null"])
def test_sjf_aging_heaps_stay_bounded_over_a_run(mode, aging):
    """SJF's arrival-ordered heaps (aged-first admission, next aging deadline) hold only
    requests that waited recently: admitted and aged entries are dropped as steps go by, in
    both modes, and without aging nothing is indexed there at all."""
    res = Simulation(small_cfg("policy=sjf", f"policy.aging_s={aging}", f"step_mode={mode}",
                               "model=tiny", "workload.num_requests=400",
                               "workload.qps=40")).run()
    policy = res.replicas[0].policy
    assert res.summary["completed"] + res.summary["rejected"] == 400
    if aging == "null":
        assert len(policy.by_arrival) == 0 and len(policy.not_aged) == 0
    else:  # at most the requests of the last aging_s seconds (~20) and a few stale ones
        assert len(policy.not_aged) < 60 and len(policy.by_arrival) < 60
