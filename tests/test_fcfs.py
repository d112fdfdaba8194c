"""Golden step plans for FCFS (vLLM v0 default scheduling) on tiny pools."""

from sim.request import Request, RequestStatus
from tests.harness import run_requests

FCFS = {"name": "fcfs", "max_num_seqs": 8, "max_num_batched_tokens": 64}


def test_prefill_step_then_decode_steps_and_exact_blocks():
    reqs = [Request(0, 0.0, 6, 3), Request(1, 0.0, 3, 2)]
    run = run_requests(FCFS, reqs, num_gpu_blocks=12, block_size=4)
    s = run.steps
    # Step 1: both prompts whole, in arrival order; each samples its first token.
    assert s[0].rows == [(0, 0, 6, True), (1, 0, 3, True)]
    assert s[0].tables == {0: [0, 1], 1: [2]}
    # Then decodes: one token each at the next position.
    assert s[1].rows == [(0, 6, 1, True), (1, 3, 1, True)]
    assert s[1].tables == {0: [0, 1], 1: [2]}  # 7th and 4th tokens fit in current blocks
    assert s[2].rows == [(0, 7, 1, True)]  # request 1 finished after 2 tokens
    assert s[2].tables == {0: [0, 1]}
    assert len(s) == 3
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    assert reqs[0].token_times.tolist() == [1.0, 2.0, 3.0]
    assert reqs[1].first_token_time == 1.0 and reqs[1].finish_time == 2.0
    assert run.replica.kv.num_free_blocks == 12


def test_arrival_during_decode_gets_a_prefill_only_step():
    reqs = [Request(0, 0.0, 4, 4), Request(1, 1.5, 4, 1)]
    s = run_requests(FCFS, reqs, num_gpu_blocks=12, block_size=4).steps
    assert [st.rows for st in s] == [
        [(0, 0, 4, True)],
        [(0, 4, 1, True)],
        [(1, 0, 4, True)],  # prefill step: request 0's decode waits (vLLM v0 default)
        [(0, 5, 1, True)],
        [(0, 6, 1, True)],
    ]


def test_token_budget_and_seat_limit_bound_admission():
    reqs = [Request(i, 0.0, 30, 1) for i in range(4)]
    s = run_requests({**FCFS, "max_num_batched_tokens": 64, "max_num_seqs": 8}, reqs,
                     num_gpu_blocks=40, block_size=4).steps
    assert [st.grants for st in s] == [{0: 30, 1: 30}, {2: 30, 3: 30}]
    reqs = [Request(i, 0.0, 4, 1) for i in range(3)]
    s = run_requests({**FCFS, "max_num_seqs": 2}, reqs, num_gpu_blocks=40, block_size=4).steps
    assert [st.grants for st in s] == [{0: 4, 1: 4}, {2: 4}]


def test_memory_pressure_preempts_latest_arrival_by_recompute():
    # 4 blocks of 2 tokens. Two 3-token prompts take 2 blocks each.
    reqs = [Request(0, 0.0, 3, 4), Request(1, 0.1, 3, 4)]
    run = run_requests(FCFS, reqs, num_gpu_blocks=4, block_size=2)
    s = run.steps
    assert [st.rows for st in s] == [
        [(0, 0, 3, True)],
        [(1, 0, 3, True)],  # arrived during step 1: a prefill-only step
        [(0, 3, 1, True), (1, 3, 1, True)],  # 4th tokens fit the second blocks
        [(0, 4, 1, True)],  # 0 needs a 3rd block: 1 (latest arrival) is recomputed
        [(0, 5, 1, True)],  # 1 waits: re-prefilling 5 tokens needs 3 blocks, 1 is free
        [(1, 0, 5, True)],  # 0 finished: 1 re-prefills prompt + its 2 generated tokens
        [(1, 5, 1, True)],
    ]
    assert s[3].recomputed == [1]
    assert s[0].tables[0] == [0, 1] and s[1].tables[1] == [2, 3]
    assert s[3].tables[0] == [0, 1, 3]  # 1's blocks were freed tail first: 3 then 2
    assert s[5].tables[1] == [2, 3, 1]  # free queue was [2] + 0's blocks tail first (3, 1, 0)
    assert reqs[1].num_recomputes == 1 and reqs[1].num_preemptions == 1
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    assert run.metrics.completed == 2


def test_swap_mode_swaps_out_and_back_in_keeping_progress():
    reqs = [Request(0, 0.0, 3, 4), Request(1, 0.1, 3, 4)]
    run = run_requests({**FCFS, "preemption_mode": "swap"}, reqs, num_gpu_blocks=4,
                       block_size=2, num_cpu_blocks=4)
    s = run.steps
    assert s[3].swapped_out == [1] and s[3].recomputed == []
    assert s[3].swap_out == [(2, 0), (3, 1)]
    assert s[3].rows == [(0, 4, 1, True)]
    # After 0 finishes, 1 is swapped back in and decodes from exactly where it stopped:
    # it had 3 prompt + 2 generated tokens, 4 of them computed: position 4, no re-prefill.
    assert s[5].swap_in == [(0, 2), (1, 3)]
    assert s[5].rows == [(1, 4, 1, True)]
    assert reqs[1].num_swaps == 1 and reqs[1].num_recomputes == 0
    assert reqs[1].num_output_tokens == 4
    assert run.replica.kv.num_free_cpu_blocks == 4


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full():
    reqs = [Request(0, 0.0, 3, 4), Request(1, 0.1, 3, 4)]
    run = run_requests({**FCFS, "preemption_mode": "swap"}, reqs, num_gpu_blocks=4,
                       block_size=2, num_cpu_blocks=1)
    assert run.steps[3].recomputed == [1]
    assert run.replica.builder.num_swap_fallbacks == 1
    assert reqs[1].num_recomputes == 1 and reqs[1].num_swaps == 0


def test_request_that_can_never_fit_is_rejected_at_arrival():
    reqs = [Request(0, 0.0, 10, 20), Request(1, 0.0, 4, 2)]
    run = run_requests(FCFS, reqs, num_gpu_blocks=4, block_size=4)
    assert reqs[0].status is RequestStatus.REJECTED
    assert reqs[0].reject_reason.startswith("exceeds_kv_pool")
    assert reqs[1].status is RequestStatus.FINISHED
    assert run.metrics.rejected == 1 and run.metrics.completed == 1
