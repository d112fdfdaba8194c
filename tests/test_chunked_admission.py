"""Chunked prefill admits as vLLM v0 and Sarathi-Serve do: only if the whole pending prefill's
blocks fit above the watermark, and it holds them all from its first chunk (regression tests
for an audit's repros). And ``policy.enable_chunked_prefill=true`` is refused on policies whose
steps are not chunked prefill's. Tiny pools, exact block ids; each step takes 1 s."""

from __future__ import annotations

import pytest

from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.request import Request, RequestStatus
from tests.harness import run_requests
from tests.helpers import compose_cfg

CP = {"name": "chunked_prefill", "max_num_batched_tokens": 8, "max_num_seqs": 4}


def test_a_prompt_waits_until_all_its_blocks_fit_instead_of_thrashing():
    # 10 blocks of 4. Request 0 (prompt 16, 12 outputs) decodes; request 1 (24-token prompt,
    # 6 blocks) arrives at 0.5. Per-chunk allocation admitted it with 5 blocks free, it ran
    # dry mid-prefill and was recomputed 4 times; now it waits for 0 and runs once.
    reqs = [Request(0, 0.0, 16, 12), Request(1, 0.5, 24, 2)]
    run = run_requests(CP, reqs, num_gpu_blocks=10, block_size=4)
    rows = [st.rows for st in run.steps]
    assert rows[:2] == [[(0, 0, 8, False)], [(0, 8, 8, True)]]
    # Steps 2-12: 0 decodes alone while it holds 5, then 6, then 7 blocks (5, 4, 3 free).
    assert rows[2:13] == [[(0, 16 + i, 1, True)] for i in range(11)]
    assert [len(run.steps[i].tables[0]) for i in (2, 6, 10)] == [5, 6, 7]
    assert rows[13:] == [[(1, 0, 8, False)], [(1, 8, 8, False)], [(1, 16, 8, True)],
                         [(1, 24, 1, True)]]
    # All 6 blocks from the first chunk on (the never-used 7-9, then 0's, freed tail first).
    assert [run.steps[i].tables[1] for i in (13, 14, 15)] == [[7, 8, 9, 6, 5, 4]] * 3
    assert run.metrics.num_preemptions == 0
    assert [r.num_preemptions for r in reqs] == [0, 0]
    assert (reqs[1].ttft, reqs[1].e2e_latency) == (15.5, 16.5)


def test_the_watermark_applies_to_the_whole_prompt_not_the_first_chunk():
    # 10 blocks, watermark 0.2 = 2 blocks kept free. At step 1, request 0 holds 3 blocks.
    def run(prompt):
        reqs = [Request(0, 0.0, 8, 6), Request(1, 0.5, prompt, 1)]
        return run_requests({**CP, "max_num_seqs": 2, "kv_watermark": 0.2}, reqs,
                            num_gpu_blocks=10, block_size=4)

    # 20 tokens = 5 blocks: 7 free - 5 = 2, exactly the watermark: admitted at once.
    fits = run(20)
    assert fits.steps[1].rows == [(0, 8, 1, True), (1, 0, 7, False)]
    assert fits.steps[1].tables == {0: [0, 1, 2], 1: [3, 4, 5, 6, 7]}
    # 24 tokens = 6 blocks would leave 1: it waits (its 7-token first chunk alone would have
    # fit) until 0 has finished at step 5.
    waits = run(24)
    assert [st.rows for st in waits.steps[1:6]] == [[(0, 8 + i, 1, True)] for i in range(5)]
    assert waits.steps[6].rows == [(1, 0, 8, False)]
    assert waits.steps[6].tables == {1: [4, 5, 6, 7, 8, 9]}


def test_later_chunks_need_no_block_and_a_swap_moves_every_block_held():
    # 7 blocks of 4, 4-token steps. Request 1 (20-token prompt) holds all 5 of its blocks
    # from its first 3-token chunk. When request 0 needs a 3rd block at step 5, 1 (latest
    # arrival) is swapped out with all 5 blocks, the 2 it has not filled yet included
    # (vLLM v0 swaps the whole block table too), and comes back with all 5.
    reqs = [Request(0, 0.0, 4, 8), Request(1, 0.5, 20, 2)]
    run = run_requests({"name": "chunked_prefill", "max_num_batched_tokens": 4,
                        "max_num_seqs": 2, "preemption_mode": "swap"},
                       reqs, num_gpu_blocks=7, block_size=4, num_cpu_blocks=8)
    s = run.steps
    assert [st.rows for st in s[1:5]] == [[(0, 4 + i, 1, True), (1, 3 * i, 3, False)]
                                          for i in range(4)]
    assert all(st.tables[1] == [2, 3, 4, 5, 6] for st in s[1:5])
    assert s[5].rows == [(0, 8, 1, True)] and s[5].swapped_out == [1]
    assert s[5].swap_out == [(2, 0), (3, 1), (4, 2), (5, 3), (6, 4)]
    assert s[5].tables == {0: [0, 1, 6]}
    assert [st.rows for st in s[6:8]] == [[(0, 9, 1, True)], [(0, 10, 1, True)]]  # 0 ends
    assert s[8].swap_in == [(0, 5), (1, 4), (2, 3), (3, 2), (4, 6)]
    assert [st.rows for st in s[8:]] == [[(1, 12, 4, False)], [(1, 16, 4, True)],
                                         [(1, 20, 1, True)]]
    assert s[8].tables == s[9].tables == {1: [5, 4, 3, 2, 6]}
    assert s[10].tables == {1: [5, 4, 3, 2, 6, 1]}  # its first decode token's new block
    assert [r.num_preemptions for r in reqs] == [0, 1] and run.metrics.num_swaps == 1


def test_a_recomputed_chunked_prompt_is_readmitted_once_with_all_its_blocks():
    # The same as above by recompute: 1 is preempted once and re-prefills from 0 only when
    # its 5 blocks fit, in 4-token chunks that never need another block.
    reqs = [Request(0, 0.0, 4, 8), Request(1, 0.5, 20, 2)]
    run = run_requests({"name": "chunked_prefill", "max_num_batched_tokens": 4,
                        "max_num_seqs": 2, "preemption_mode": "recompute"},
                       reqs, num_gpu_blocks=7, block_size=4)
    s = run.steps
    assert s[5].recomputed == [1] and s[5].tables == {0: [0, 1, 6]}
    assert [st.rows for st in s[8:13]] == [[(1, 4 * i, 4, i == 4)] for i in range(5)]
    assert all(st.tables == {1: [5, 4, 3, 2, 6]} for st in s[8:13])
    assert [r.num_preemptions for r in reqs] == [0, 1]
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


def test_fcfs_re_prefill_larger_than_a_step_holds_its_blocks_from_the_first_chunk():
    # FCFS, 8-token steps, 9 blocks of 2. Request 1 is recomputed at step 5 with prompt 6 +
    # 5 generated = 11 tokens, more than a step: it re-prefills in two chunks. It is
    # readmitted only once all 6 blocks fit (0 has finished); per-chunk allocation readmitted
    # it on its first chunk's 4 blocks and had it preempted 4 times more.
    reqs = [Request(0, 0.0, 2, 10), Request(1, 0.0, 6, 8)]
    run = run_requests({"name": "fcfs", "max_num_batched_tokens": 8, "max_num_seqs": 2},
                       reqs, num_gpu_blocks=9, block_size=2)
    s = run.steps
    assert s[5].recomputed == [1]
    assert [st.rows for st in s[5:10]] == [[(0, 6 + i, 1, True)] for i in range(5)]
    assert s[10].rows == [(1, 0, 8, False)] and s[11].rows == [(1, 8, 3, True)]
    assert s[10].tables == s[11].tables == {1: [3, 2, 1, 5, 7, 8]}
    assert [r.num_preemptions for r in reqs] == [0, 1]


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority", "static"])
def test_chunked_prefill_flag_is_refused_where_steps_are_not_chunked(policy):
    # FCFS with the flag ran prefill-only steps of partial prompts while every decode
    # stalled (p99 ITL 131 ms vs 56 ms for policy=chunked_prefill in the audit's run).
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg(f"policy={policy}", "policy.enable_chunked_prefill=true",
                               "workload.num_requests=4"))
    assert e.value.field == "policy.enable_chunked_prefill"
    assert "policy=chunked_prefill" in str(e.value)


@pytest.mark.parametrize("policy", ["chunked_prefill", "fcfs"])
def test_a_recompute_too_long_for_the_pool_above_the_watermark_still_runs(tmp_path, policy):
    """Request 0 (2 + 30 tokens) grows until it is preempted and must re-prefill 28+ tokens:
    8 blocks, more than the 10-block pool holds above its 2-block watermark. Whole-prompt
    admission would wait for ever (SimulationStalled); since waiting cannot help, it is
    admitted without the watermark, its blocks taken chunk by chunk (vLLM v0 would drop it)."""
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,2,30\n0.0,28,13\n")
    summary = Simulation(compose_cfg(
        f"policy={policy}", "workload=trace", f"workload.path={trace}", "kv.block_size=4",
        "kv.num_gpu_blocks_override=10", "kv.num_cpu_blocks=0", "policy.kv_watermark=0.2",
        "policy.max_num_batched_tokens=32", "policy.max_num_seqs=2", "check_integrity=true",
        "record_steps=false"), tmp_path / "out").run().summary
    assert summary["completed"] == 2 and summary["num_preemptions"] >= 1
