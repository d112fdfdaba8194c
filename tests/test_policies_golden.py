"""Golden step plans on tiny pools for static, sjf, priority and chunked_prefill (fcfs has its
own file): exactly which requests run with how many tokens, and who is preempted, swapped or
resumed. Each step takes 1 simulated second unless stated."""

import pytest

from sim.request import Request, RequestStatus
from tests.harness import run_requests

BIG = {"max_num_batched_tokens": 64, "max_num_seqs": 8}


def rows(run):
    return [st.rows for st in run.steps]


# ---- static -------------------------------------------------------------------------------
def test_static_reserves_whole_length_and_admits_only_after_the_batch_ends():
    reqs = [Request(0, 0.0, 4, 2), Request(1, 0.0, 6, 5), Request(2, 0.0, 3, 1)]
    run = run_requests({"name": "static", **BIG, "max_batch_size": 2}, reqs,
                       num_gpu_blocks=12, block_size=4)
    assert rows(run) == [
        [(0, 0, 4, True), (1, 0, 6, True)],  # batch {0, 1}: prompts in one prefill step
        [(0, 4, 1, True), (1, 6, 1, True)],  # 0 finishes here ...
        [(1, 7, 1, True)],  # ... but 2 waits: the batch runs until its longest ends
        [(1, 8, 1, True)],
        [(1, 9, 1, True)],
        [(2, 0, 3, True)],  # next batch
    ]
    # Prompt + max output - 1 slots reserved at admission: 5 tokens -> 2 blocks, 10 -> 3.
    assert run.steps[0].tables == {0: [0, 1], 1: [2, 3, 4]}
    assert run.steps[4].tables == {1: [2, 3, 4]}  # no block was ever added while decoding
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


def test_static_batch_formation_spans_token_limited_prefill_steps_then_closes():
    reqs = [Request(0, 0.0, 4, 2), Request(1, 0.0, 6, 1), Request(2, 0.0, 2, 3),
            Request(3, 0.5, 2, 1)]
    run = run_requests({"name": "static", "max_num_batched_tokens": 8, "max_num_seqs": 3},
                       reqs, num_gpu_blocks=12, block_size=4)
    assert rows(run) == [
        [(0, 0, 4, True)],  # 1's prompt does not fit the 4 tokens left: batch stays open
        [(1, 0, 6, True), (2, 0, 2, True)],  # batch of B = 3 complete; 3 (t=0.5) is out
        [(0, 4, 1, True), (2, 2, 1, True)],
        [(2, 3, 1, True)],
        [(3, 0, 2, True)],
    ]


def test_static_batch_is_bounded_by_the_kv_reservation():
    # 4 blocks of 4 tokens: 0 reserves 4 + 9 - 1 = 12 tokens (3 blocks); 1 needs 2 more.
    reqs = [Request(0, 0.0, 4, 9), Request(1, 0.0, 4, 4)]
    run = run_requests({"name": "static", **BIG}, reqs, num_gpu_blocks=4, block_size=4)
    assert [st.grants for st in run.steps[:2]] == [{0: 4}, {0: 1}]
    assert run.steps[9].rows == [(1, 0, 4, True)]  # after 0's 9th token
    assert run.metrics.num_preemptions == 0


# ---- sjf ----------------------------------------------------------------------------------
SJF = {"name": "sjf", **BIG, "max_num_seqs": 1, "aging_s": None}


def test_sjf_admits_shortest_predicted_output_first():
    reqs = [Request(0, 0.0, 2, 3), Request(1, 0.5, 2, 5), Request(2, 0.5, 2, 1),
            Request(3, 0.5, 2, 2)]
    run = run_requests(SJF, reqs, num_gpu_blocks=12, block_size=4)
    firsts = [st.rows[0][0] for st in run.steps if st.rows[0][1] == 0]
    assert firsts == [0, 2, 3, 1]  # FCFS would be 0, 1, 2, 3
    assert reqs[2].extra["predicted_output_len"] == 1.0  # oracle


def test_sjf_aging_serves_requests_that_waited_too_long_in_arrival_order():
    reqs = [Request(0, 0.0, 2, 3), Request(1, 0.5, 2, 5), Request(3, 2.5, 2, 2),
            Request(2, 2.6, 2, 1)]
    no_aging = run_requests(SJF, reqs, num_gpu_blocks=12, block_size=4)
    assert [st.rows[0][0] for st in no_aging.steps if st.rows[0][1] == 0] == [0, 2, 3, 1]
    reqs = [Request(0, 0.0, 2, 3), Request(1, 0.5, 2, 5), Request(3, 2.5, 2, 2),
            Request(2, 2.6, 2, 1)]
    aged = run_requests({**SJF, "aging_s": 2.0}, reqs, num_gpu_blocks=12, block_size=4)
    # At t=3 only 1 has waited 2 s: it goes first although longest. At t=8 both 3 and 2
    # have aged, so they go in arrival order (3 first) although 2 is shorter.
    starts = [(st.time, st.rows[0][0]) for st in aged.steps if st.rows[0][1] == 0]
    assert starts == [(0.0, 0), (3.0, 1), (8.0, 3), (10.0, 2)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptive_sjf_much_shorter_arrival_preempts_long_runner(mode):
    reqs = [Request(0, 0.0, 2, 12), Request(1, 2.5, 2, 2)]
    run = run_requests({**SJF, "preemptive": True, "preemption_ratio": 4.0,
                        "preemption_mode": mode}, reqs, num_gpu_blocks=12, block_size=4,
                       num_cpu_blocks=4)
    s = run.steps
    # t=3: 0 has 3 tokens, 9 predicted to go >= 4 x 2: 1 displaces it.
    assert s[3].rows == [(1, 0, 2, True)]
    assert s[4].rows == [(1, 2, 1, True)]
    if mode == "recompute":
        assert s[3].recomputed == [0]
        assert s[5].rows == [(0, 0, 5, True)]  # re-prefills prompt 2 + 3 generated
    else:
        assert s[3].swapped_out == [0] and s[3].swap_out == [(0, 0)]
        # Block 1 went to request 1; 0 comes back into the next free block, 2, and decodes
        # from exactly where it stopped (4 of its 5 tokens computed): no re-prefill.
        assert s[5].swap_in == [(0, 2)] and s[5].rows == [(0, 4, 1, True)]
    assert reqs[0].num_output_tokens == 12 and reqs[0].num_preemptions == 1


def test_preemptive_sjf_respects_the_ratio():
    reqs = [Request(0, 0.0, 2, 10), Request(1, 2.5, 2, 2)]  # 7 to go < 4 x 2: no preemption
    run = run_requests({**SJF, "preemptive": True, "preemption_ratio": 4.0}, reqs,
                       num_gpu_blocks=12, block_size=4)
    assert run.metrics.num_preemptions == 0
    assert run.steps[10].rows == [(1, 0, 2, True)]


def test_sjf_predictions_are_seeded_per_run():
    def predictions(cfg, seed):
        reqs = [Request(i, 0.0, 2, 1 + (37 * i) % 900) for i in range(300)]
        run_requests({**SJF, **cfg}, reqs, num_gpu_blocks=64, block_size=16, seed=seed,
                     until=0.5)
        return [r.extra["predicted_output_len"] for r in reqs], reqs

    a, reqs = predictions({"predictor": "noisy", "noise_sigma": 0.5}, 7)
    assert a == predictions({"predictor": "noisy", "noise_sigma": 0.5}, 7)[0]
    assert a != predictions({"predictor": "noisy", "noise_sigma": 0.5}, 8)[0]
    import numpy as np
    err = np.log(np.array(a) / [r.max_output_len for r in reqs])
    assert abs(err.std() - 0.5) < 0.06 and abs(err.mean()) < 0.08
    cfg = {"predictor": "bucket", "bucket_edges": [128, 512]}
    exact, reqs = predictions({**cfg, "bucket_accuracy": 1.0}, 0)
    reps = {0: 64.0, 1: 320.0, 2: 1024.0}
    true = [0 if r.max_output_len <= 128 else 1 if r.max_output_len <= 512 else 2 for r in reqs]
    assert exact == [reps[t] for t in true]
    wrong, _ = predictions({**cfg, "bucket_accuracy": 0.0}, 0)
    assert all(p != reps[t] for p, t in zip(wrong, true))
    some, _ = predictions({**cfg, "bucket_accuracy": 0.8}, 0)
    hit = np.mean([p == reps[t] for p, t in zip(some, true)])
    assert 0.72 < hit < 0.88


# ---- priority -----------------------------------------------------------------------------
PRI = {"name": "priority", **BIG, "max_num_seqs": 2}


def test_priority_lower_value_is_admitted_first():
    reqs = [Request(0, 0.0, 2, 1, priority=2), Request(1, 0.0, 2, 1, priority=0),
            Request(2, 0.0, 2, 1, priority=1)]
    run = run_requests({**PRI, "max_num_seqs": 1}, reqs, num_gpu_blocks=12, block_size=4)
    assert [st.rows[0][0] for st in run.steps] == [1, 2, 0]


def test_priority_arrival_preempts_the_lowest_class_and_it_recomputes():
    reqs = [Request(0, 0.0, 2, 4, priority=2), Request(1, 0.0, 2, 4, priority=1),
            Request(2, 1.5, 2, 2, priority=0)]
    run = run_requests(PRI, reqs, num_gpu_blocks=12, block_size=4)
    assert rows(run) == [
        [(1, 0, 2, True), (0, 0, 2, True)],  # class 1 before class 2
        [(1, 2, 1, True), (0, 2, 1, True)],
        [(2, 0, 2, True)],  # class 0 arrives, no seat: class 2 (request 0) is preempted
        [(2, 2, 1, True), (1, 3, 1, True)],  # decodes in priority order
        [(0, 0, 4, True)],  # 2 done: 0 re-prefills prompt 2 + its 2 tokens, samples a 3rd
        [(1, 4, 1, True), (0, 4, 1, True)],  # both finish with their 4th token
    ]
    assert run.steps[2].recomputed == [0]


def test_priority_without_preemption_waits_for_a_seat():
    reqs = [Request(0, 0.0, 2, 4, priority=2), Request(1, 0.0, 2, 4, priority=1),
            Request(2, 1.5, 2, 2, priority=0)]
    run = run_requests({**PRI, "preemptive": False}, reqs, num_gpu_blocks=12, block_size=4)
    assert run.metrics.num_preemptions == 0
    assert run.steps[4].rows == [(2, 0, 2, True)]  # 0 and 1 finished their 4 tokens at t=4


def test_priority_memory_pressure_victim_is_the_lowest_class_not_the_latest_arrival():
    # 3 blocks of 2 tokens; both need a second block at their 3rd token.
    reqs = [Request(0, 0.0, 2, 3, priority=1), Request(1, 0.1, 2, 3, priority=0)]
    run = run_requests({**PRI, "preemption_mode": "swap"}, reqs, num_gpu_blocks=3,
                       block_size=2, num_cpu_blocks=2)
    s = run.steps
    assert s[0].rows == [(0, 0, 2, True)] and s[1].rows == [(1, 0, 2, True)]
    assert s[2].rows == [(1, 2, 1, True)] and s[2].swapped_out == [0]  # fcfs would pick 1
    assert [r.status for r in reqs] == [RequestStatus.FINISHED] * 2


# ---- chunked prefill ----------------------------------------------------------------------
CP = {"name": "chunked_prefill", "max_num_batched_tokens": 8, "max_num_seqs": 4}


def test_chunked_prefill_decodes_first_then_chunks_a_long_prompt():
    reqs = [Request(0, 0.0, 3, 4), Request(1, 0.0, 20, 2)]
    run = run_requests(CP, reqs, num_gpu_blocks=12, block_size=4)
    assert rows(run) == [
        [(0, 0, 3, True), (1, 0, 5, False)],
        [(0, 3, 1, True), (1, 5, 7, False)],  # 0's decode first, the rest of the budget to 1
        [(0, 4, 1, True), (1, 12, 7, False)],
        [(0, 5, 1, True), (1, 19, 1, True)],  # 1's last prompt token samples its first
        [(1, 20, 1, True)],
    ]


def test_chunked_prefill_partial_prefills_share_the_budget():
    def run(k):
        reqs = [Request(0, 0.0, 20, 1), Request(1, 0.0, 4, 1)]
        return rows(run_requests({**CP, "max_num_partial_prefills": k}, reqs,
                                 num_gpu_blocks=12, block_size=4))

    assert run(1) == [[(0, 0, 8, False)], [(0, 8, 8, False)], [(0, 16, 4, True), (1, 0, 4, True)]]
    assert run(2) == [[(0, 0, 4, False), (1, 0, 4, True)], [(0, 4, 8, False)],
                      [(0, 12, 8, True)]]


def test_chunked_prefill_recompute_under_memory_pressure_re_prefills_prompt_and_output():
    # 6 blocks of 2 tokens. Both grow a block at their 5th token; at the 7th, the pool is dry.
    reqs = [Request(0, 0.0, 4, 6), Request(1, 0.0, 4, 6)]
    run = run_requests(CP, reqs, num_gpu_blocks=6, block_size=2)
    assert [(st.rows, st.recomputed) for st in run.steps] == [
        ([(0, 0, 4, True), (1, 0, 4, True)], []),
        ([(0, 4, 1, True), (1, 4, 1, True)], []),
        ([(0, 5, 1, True), (1, 5, 1, True)], []),
        ([(0, 6, 1, True)], [1]),  # 0 needs a 4th block: 1 (latest arrival) is recomputed
        ([(0, 7, 1, True)], []),  # 1 would need 4 blocks for its 7 tokens; 2 are free
        ([(0, 8, 1, True)], []),
        ([(1, 0, 7, True)], []),  # prompt 4 + 3 generated, then it samples its 4th token
        ([(1, 7, 1, True)], []),
        ([(1, 8, 1, True)], []),
    ]
    assert run.steps[3].tables == {0: [0, 1, 4, 5]}  # 1's blocks came back tail first
