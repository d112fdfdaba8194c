"""The array core (sim/array_core.py) must give what step-by-step simulation gives, and what
the replica loop's fast mode gives, wherever it runs; and run only where it applies."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from executors.recording import RecordingExecutor
from experiments.simulation import Simulation
from policies import POLICIES, make_policy
from policies.budget import preempted_by_key_on_counts
from sim.array_core import _BlockCount
from sim.kv_manager import KVBlockManager
from sim.request import Request, RequestStatus
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.helpers import compose_cfg
from tests.test_fast_forward import _assert_same, _same_runs
from workloads.base import Workload

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

# A small eligible run: the tiny model, a pool that holds every batch the policy may form.
TINY = ("model=tiny", "workload.prompt_len.max=200", "workload.output_len.max=120",
        "kv.num_gpu_blocks_override=20000")
# Lengths drawn uniformly between their min and max, so one-token prompts and outputs occur.
UNIFORM = ("workload.prompt_len.dist=uniform", "workload.output_len.dist=uniform")
# Every policy that states ``array_core`` (a new one is checked by the tests that take this).
ARRAY_CORE = [n for n in POLICIES.names() if POLICIES.get(n).array_core]


def same_or_given_up(over: list[str], may_give_up: bool,
                     reasons: tuple[str, ...] = ("does not fit its KV pool",)) -> dict:
    """``_assert_same`` on ``over``; a run the core gave up to the replica loop (whose files
    are then the replica loop's) only where ``may_give_up``, for one of ``reasons``."""
    s = _assert_same(over)
    if s["step_engine"] != "array_core":
        sim = Simulation(compose_cfg(*over))
        sim.run()
        assert may_give_up, sim.array_core_skipped
        assert any(r in sim.array_core_skipped for r in reasons), sim.array_core_skipped
    return s


def test_the_array_core_policies_are_collected():
    assert {"fcfs", "chunked_prefill", "sjf", "priority", "vllm_v1", "trtllm"} <= set(ARRAY_CORE)


def _engine(*overrides: str) -> str:
    sim = Simulation(compose_cfg(*overrides))
    return sim.run().summary["step_engine"]


def test_random_eligible_runs_equal_exact_and_use_the_core():
    # _assert_same: step columns equal, step and request times to 1e-9, summary keys.
    s = _assert_same([*TINY, *UNIFORM, "policy=fcfs", "workload.num_requests=200",
                      "workload.qps=40", "workload.output_len.min=1",
                      "workload.prompt_len.min=1"])
    assert s["step_engine"] == "array_core"


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(200, 2000), out_min=st.integers(1, 4), block=st.sampled_from([1, 16]),
       itl=st.sampled_from(["exact", "streaming"]))
def test_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget, out_min, block, itl):
    s = _assert_same([*TINY, *UNIFORM, "policy=fcfs", f"seed={seed}", f"workload.qps={qps}",
                      "workload.num_requests=60", f"policy.max_num_seqs={seqs}",
                      f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
                      f"workload.output_len.min={out_min}", f"itl_quantiles={itl}"])
    assert s["step_engine"] == "array_core"


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(40, 600), partials=st.sampled_from([1, 2, 3, None]),
       out_min=st.integers(1, 3), prompt_min=st.sampled_from([1, 2, 50]),
       block=st.sampled_from([1, 16]), pool=st.one_of(st.none(), st.integers(330, 6000)))
# vLLM v1 on a pool that binds: preempted by recompute, readmitted with its own blocks.
@example(seed=0, qps=400.0, seqs=40, budget=600, partials=None, out_min=1, prompt_min=50,
         block=16, pool=1000)
def test_chunked_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget, partials,
                                                             out_min, prompt_min, block, pool):
    """Prompts longer than the step, shared between partial prefills, one-token prompts
    and outputs, chunks of one token (decode rows by their shape). ``partials`` None: vLLM
    v1's step (every running request in order, a prompt's blocks taken chunk by chunk, the
    prefix cache on). ``pool``: a pool of that many tokens, which can bind: vLLM v1
    preempts the latest arrivals where the running requests' grants do not fit, and a
    request recomputed finds what is left of its own blocks in the prefix cache."""
    policy = (["policy=vllm_v1"] if partials is None else
              ["policy=chunked_prefill", f"policy.max_num_partial_prefills={partials}"])
    over = [*TINY, *UNIFORM, *policy, f"seed={seed}", f"workload.qps={qps}",
            "workload.num_requests=60", f"policy.max_num_seqs={min(seqs, budget)}",
            f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
            f"workload.prompt_len.min={prompt_min}", f"workload.output_len.min={out_min}"]
    if pool is not None:
        over.append(f"kv.num_gpu_blocks_override={-(-pool // block)}")
    assert _assert_same(over)["step_engine"] == "array_core"


_V1_PRIORITY = [*TINY, *UNIFORM, "policy=vllm_v1", "policy.scheduling_policy=priority",
                "workload.num_requests=60", "kv.block_size=16"]


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(40, 600), out_min=st.integers(1, 3),
       prompt_min=st.sampled_from([1, 2, 50]), block=st.sampled_from([1, 16]),
       priorities=st.sampled_from(["[0,1]", "[0,1,2]", "[2,1,0,0]"]))
def test_vllm_v1_priority_core_equals_exact_on_random_small_workloads(
        seed, qps, seqs, budget, out_min, prompt_min, block, priorities):
    """vLLM v1's priority scheduling on a pool that cannot bind: its queue in (priority,
    arrival) order, the running requests granted in arrival order (a prompt admitted after
    requests that arrived later may be mid-prefill before them: the core runs that step where
    the grants and rows are every decode first's, and gives the run up elsewhere)."""
    over = [*_V1_PRIORITY, f"seed={seed}", f"workload.qps={qps}",
            f"workload.priorities={priorities}", f"policy.max_num_seqs={min(seqs, budget)}",
            f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
            f"workload.prompt_len.min={prompt_min}", f"workload.output_len.min={out_min}"]
    same_or_given_up(over, True, ("arrived after it",))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(20.0, 800.0), seqs=st.integers(1, 40),
       budget=st.integers(64, 1024), out_min=st.integers(1, 3),
       block=st.sampled_from([1, 4, 16]), pool=st.integers(200, 1500),
       caching=st.booleans(), priorities=st.sampled_from(["[1,1]", "[1,1,2]", "[0,1,2,3]"]))
def test_vllm_v1_priority_core_equals_exact_on_pools_that_bind(
        seed, qps, seqs, budget, out_min, block, pool, caching, priorities):
    """vLLM v1's priority scheduling where the pool binds: a step whose running requests'
    blocks do not fit preempts the running request of the largest (priority, arrival),
    granted already or not, until the rest fit (``decode_victims``); one that preempts
    itself ends the step's grants, and the members after it sit the step out. The run is
    given up where such a step would grant a prompt mid-prefill its chunk (or leave out one
    a token from done)."""
    over = [*_V1_PRIORITY, f"seed={seed}", f"workload.qps={qps}",
            f"workload.priorities={priorities}", f"policy.max_num_seqs={min(seqs, budget)}",
            f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
            "workload.prompt_len.max=200", f"workload.output_len.min={out_min}",
            f"kv.num_gpu_blocks_override={-(-pool // block)}",
            f"kv.enable_prefix_caching={str(caching).lower()}"]
    same_or_given_up(over, True, ("arrived after it", "preempts by priority",
                                  "alone fills the pool"))


@pytest.mark.parametrize("over", [
    ["workload.priorities=[1,1,2]", "seed=5569", "workload.num_requests=57",
     "workload.qps=740.874", "workload.prompt_len.max=50", "workload.prompt_len.min=2",
     "workload.output_len.max=300", "workload.output_len.min=2",
     "policy.max_num_batched_tokens=1944", "policy.max_num_seqs=40", "kv.block_size=4",
     "kv.num_gpu_blocks_override=141", "kv.enable_prefix_caching=true"],
    ["workload.priorities=[1,1]", "seed=8058", "workload.num_requests=57",
     "workload.qps=421.840", "workload.prompt_len.max=200", "workload.prompt_len.min=1",
     "workload.output_len.max=120", "workload.output_len.min=3",
     "policy.max_num_batched_tokens=432", "policy.max_num_seqs=5", "kv.block_size=4",
     "kv.num_gpu_blocks_override=207", "kv.enable_prefix_caching=false"]])
def test_vllm_v1_priority_members_after_a_self_preemption_sit_the_step_out(over):
    """Pools that bind under priority scheduling where a request preempts itself before
    the last running one: the members after it get no token in that step (as in vLLM), on
    the core as on the replica loop, with and without the prefix cache."""
    s = _assert_same([*TINY, *UNIFORM, "policy=vllm_v1", "policy.scheduling_policy=priority",
                      *over])
    assert s["step_engine"] == "array_core" and s["num_preemptions"] > 0


@pytest.mark.parametrize("over", [
    ["workload.priorities=[1,1,2]", "seed=820", "workload.num_requests=43",
     "workload.qps=783.305", "workload.prompt_len.max=600", "workload.prompt_len.min=1",
     "workload.output_len.max=120", "workload.output_len.min=3",
     "policy.max_num_batched_tokens=578", "policy.max_num_seqs=8", "kv.block_size=4",
     "kv.num_gpu_blocks_override=312", "kv.enable_prefix_caching=true"],
    ["workload.priorities=[1,1,2]", "seed=9419", "workload.num_requests=43",
     "workload.qps=158.669", "workload.prompt_len.max=600", "workload.prompt_len.min=50",
     "workload.output_len.max=300", "workload.output_len.min=3",
     "policy.max_num_batched_tokens=696", "policy.max_num_seqs=57", "kv.block_size=4",
     "kv.num_gpu_blocks_override=343", "kv.enable_prefix_caching=true"],
    # (Every member preempted: the step is the kept prompt's chunk alone, and its row
    # counts the recompute.)
    ["workload.priorities=[1,1,2]", "seed=3656", "workload.num_requests=97",
     "workload.qps=88.934", "workload.prompt_len.max=600", "workload.prompt_len.min=1",
     "workload.output_len.max=300", "workload.output_len.min=2",
     "policy.max_num_batched_tokens=555", "policy.max_num_seqs=17", "kv.block_size=4",
     "kv.num_gpu_blocks_override=269", "kv.enable_prefix_caching=true"]])
def test_vllm_v1_priority_preemption_keeps_a_prompt_mid_prefill(over):
    """Pools that bind under priority scheduling where a step that preempts by priority
    keeps a prompt mid-prefill of a higher class: it gets its whole pending prefill in that
    step (the budget covers every running request's), on the core as on the replica loop."""
    s = _assert_same([*TINY, *UNIFORM, "policy=vllm_v1", "policy.scheduling_policy=priority",
                      *over])
    assert s["step_engine"] == "array_core" and s["num_preemptions"] > 0


def test_priority_victims_on_counts():
    """``preempted_by_key_on_counts``: the victim is the largest key, granted already (its
    new block given back too) or not; a request that preempts itself ends the loop."""
    # Row 1 finds no block: row 0 (largest key, granted) gives back its 2 + 1 blocks.
    assert preempted_by_key_on_counts([1, 1, 1], [2, 2, 2], 1,
                                      [(1, 0.0, 0), (0, 1.0, 1), (0, 2.0, 2)]) == ([0], 3, 0)
    # Row 1 is the largest itself: the loop ends there, row 2 gets nothing.
    assert preempted_by_key_on_counts([0, 1, 1], [1, 1, 1], 0,
                                      [(0, 0.0, 0), (1, 1.0, 1), (0, 2.0, 2)]) == ([1], 1, 0)
    # Row 0, granted, is the victim of row 1: without its new block given back, row 2
    # would find none and preempt itself.
    assert preempted_by_key_on_counts([1, 1, 1], [1, 1, 1], 1,
                                      [(2, 0.0, 0), (0, 1.0, 1), (1, 2.0, 2)]) == ([0], 3, 0)
    # Two victims before row 0 fits: the later arrival of the larger class first.
    assert preempted_by_key_on_counts([2, 0, 0], [1, 1, 1], 0,
                                      [(0, 0.0, 0), (1, 1.0, 1), (1, 2.0, 2)]) == ([2, 1], 3, 0)


def test_vllm_v1_priority_runs_on_the_core_with_a_prompt_before_decodes():
    """Under priority scheduling a prompt admitted after later arrivals is mid-prefill
    before their decodes: where the budget covers them all its chunk is the same as with
    every decode first, and the core runs the whole of it. Where it does not (or the prompt
    finishes with its first token, a row among theirs), the run is the replica loop's."""
    s = _assert_same([*_V1_PRIORITY, "workload.priorities=[0,1,2]", "seed=5975",
                      "workload.qps=228.43", "workload.prompt_len.min=1",
                      "workload.output_len.min=3", "policy.max_num_batched_tokens=97",
                      "policy.max_num_seqs=27"])
    assert s["step_engine"] == "array_core"
    fcfs = _assert_same([*_V1_PRIORITY, "workload.priorities=[0,1,2]", "seed=5975",
                         "workload.qps=228.43", "workload.prompt_len.min=1",
                         "workload.output_len.min=3", "policy.max_num_batched_tokens=97",
                         "policy.max_num_seqs=27", "policy.scheduling_policy=fcfs"])
    assert fcfs["mean_ttft_ms"] != s["mean_ttft_ms"]  # (the order counts)
    for over in (
            # (The budget does not cover them all.)
            [*_V1_PRIORITY, "workload.priorities=[0,1,2]", "seed=3977", "workload.qps=297.75",
             "workload.prompt_len.min=2", "workload.output_len.min=2",
             "policy.max_num_batched_tokens=75", "policy.max_num_seqs=12"],
            # (One-token outputs: the prompt's row finishes before a later decode's.)
            [*_V1_PRIORITY, "workload.priorities=[0,1,2]", "seed=5996", "workload.qps=289.74",
             "workload.prompt_len.min=50", "workload.output_len.min=1",
             "workload.output_len.max=2", "policy.max_num_batched_tokens=106",
             "policy.max_num_seqs=34"]):
        fast, exact = _same_runs(over)
        assert ([r[0] for r in fast.requests_sink.rows]
                == [r[0] for r in exact.requests_sink.rows])  # (row order too)
        sim = Simulation(compose_cfg(*over))
        assert sim.run().summary["step_engine"] == "replica" == fast.summary["step_engine"]
        assert "mid-prefill before a request that decodes and arrived after it" in (
            sim.array_core_skipped)


@pytest.mark.parametrize("seed,budget,blocks", [
    (1, 600, 219),  # a chunk that does not fit, at 0.0608 s
    (6, 100, 188),  # one that does not fit once a prompt mid-prefill has its last blocks
])
def test_vllm_v1_admits_by_its_chunks_blocks_on_a_pool_that_can_bind(seed, budget, blocks):
    """vLLM v1 on a pool where a waiting request's chunk does not fit though no running
    request ever finds no block: the core admits each chunk only where its blocks fit
    after the running requests' (a prompt mid-prefill's included), as vLLM v1 does, and
    runs the whole of it."""
    s = _assert_same([*TINY, *UNIFORM, "policy=vllm_v1", f"seed={seed}", "workload.qps=400",
                      "workload.num_requests=60", "policy.max_num_seqs=40",
                      f"policy.max_num_batched_tokens={budget}", "workload.prompt_len.min=50",
                      "workload.output_len.min=1", f"kv.num_gpu_blocks_override={blocks}"])
    assert s["step_engine"] == "array_core" and s["num_preemptions"] == 0


@pytest.mark.parametrize("seed,blocks,caching,preempted,hits,evictions", [
    (0, 60, "true", 23, 1360, 162), (0, 60, "false", 23, 0, 0), (5, 40, "true", 28, 2528, 199)])
def test_vllm_v1_preempts_on_the_core_and_finds_its_own_blocks(seed, blocks, caching,
                                                               preempted, hits, evictions):
    """vLLM v1 on a small pool that binds: the latest arrivals are recomputed where the
    running requests' grants do not fit, and with the prefix cache on each finds what is
    left of its own blocks when admitted again (the rest were handed out: evictions; those
    it found are handed out later, after it finished, and may be too). The core runs it,
    with exact mode's steps, requests and cache figures."""
    s = _assert_same([*TINY, *UNIFORM, "policy=vllm_v1", f"seed={seed}", "workload.qps=400",
                      "workload.num_requests=60", "policy.max_num_seqs=40",
                      "policy.max_num_batched_tokens=600", "workload.prompt_len.min=50",
                      "workload.output_len.min=1", f"kv.num_gpu_blocks_override={blocks}",
                      f"kv.enable_prefix_caching={caching}"])
    assert s["step_engine"] == "array_core"
    assert (s["num_preemptions"], s["prefix_cache_hits"], s["kv_evictions"]) == (
        preempted, hits, evictions)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(200, 2000), out_min=st.integers(1, 4), block=st.sampled_from([1, 16]),
       policy=st.sampled_from([
           ("policy=sjf",), ("policy=sjf", "policy.predictor=noisy"),
           ("policy=sjf", "policy.predictor=bucket", "policy.bucket_edges=[20,60]"),
           ("policy=sjf", "policy.predictor=noisy", "policy.aging_s=0.02"),
           ("policy=sjf", "policy.aging_s=null"),
           ("policy=priority", "policy.preemptive=false", "workload.priorities=[0,1,2]"),
           ("policy=priority", "workload.priorities=[4]")]))
def test_ordered_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget, out_min,
                                                             block, policy):
    """Policies that keep their own waiting order (``indexed_admissions``): admission in
    that order, aging included, and requests finishing in the same step leave in the
    policy's running order (requests.csv's row order is compared)."""
    s = _assert_same([*TINY, *UNIFORM, *policy, f"seed={seed}", f"workload.qps={qps}",
                      "workload.num_requests=60", f"policy.max_num_seqs={seqs}",
                      f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
                      f"workload.output_len.min={out_min}"])
    assert s["step_engine"] == "array_core"


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(20.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(330, 2000), out_min=st.integers(1, 4),
       block=st.sampled_from([1, 4, 16]), pool_tokens=st.integers(330, 1500),
       watermark=st.sampled_from([0.0, 0.01, 0.05, 0.05]),
       mode=st.sampled_from(["recompute", "swap", "swap"]),
       cpu_blocks=st.sampled_from([0, 8, 60, 10_000]),
       policy=st.sampled_from([
           ("policy=fcfs",), ("policy=fcfs",), ("policy=sjf",),
           ("policy=sjf", "policy.predictor=noisy", "policy.aging_s=0.02"),
           ("policy=priority", "policy.preemptive=false", "workload.priorities=[1,2,1]"),
           ("policy=chunked_prefill",), ("policy=chunked_prefill",),
           ("policy=chunked_prefill", "policy.max_num_partial_prefills=2")]))
def test_binding_pool_core_equals_exact_on_random_small_workloads(
        seed, qps, seqs, budget, out_min, block, pool_tokens, watermark, mode, cpu_blocks,
        policy):
    """A pool that binds: admission counts blocks above the watermark, a decode step whose
    new blocks do not fit preempts the last rows in the policy's running order
    (decode_preemptions: FCFS's latest arrivals, SJF's longest predicted remainders,
    priority's lowest classes; chunked prefill's latest arrivals, mid-prefill ones
    included), by recompute (waiting again: FCFS's queue head, the ordered policies' index,
    re-prefilling prompt and tokens, in chunks under chunked prefill) or by swap (back in the order they
    left, or the policy's running order, while seats, budget and blocks above the watermark
    allow; recomputed when the CPU pool is full). Schedules, preemption counts, timestamps
    and requests.csv's row order as step by step."""
    pool = -(-pool_tokens // block)
    if "policy=chunked_prefill" in policy:  # its steps of a few dozen tokens, recompute only
        budget, seqs, mode = budget // 8, min(seqs, budget // 8), "recompute"
    over = [*TINY[:3], *UNIFORM, *policy, f"seed={seed}", f"workload.qps={qps}",
            "workload.num_requests=60", f"policy.max_num_seqs={seqs}",
            f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
            f"workload.output_len.min={out_min}", f"kv.num_gpu_blocks_override={pool}",
            f"policy.kv_watermark={watermark}", f"policy.preemption_mode={mode}",
            f"kv.num_cpu_blocks={cpu_blocks}"]
    sim = Simulation(compose_cfg(*over))
    if sim.run().summary["step_engine"] != "array_core":  # a pool too small for one request
        assert "alone fills the pool" in sim.array_core_skipped or (
            mode == "swap" and "watermark of no block" in sim.array_core_skipped)
        return
    _assert_same(over)


def test_requests_swapped_back_in_finish_after_the_running_rows():
    """A step that swaps requests back in lists them after the running rows, in the order
    they came back: among those finishing in it, a request swapped back in leaves after
    members that arrived later (requests.csv's order, as step by step)."""
    over = ["model=tiny", "workload.prompt_len.max=30", "workload.output_len.max=30", *UNIFORM,
            "policy=fcfs", "seed=9102", "workload.qps=1814.736", "workload.num_requests=40",
            "policy.max_num_seqs=30", "policy.max_num_batched_tokens=1808", "kv.block_size=1",
            "workload.output_len.min=3", "workload.prompt_len.min=1",
            "kv.num_gpu_blocks_override=120", "policy.kv_watermark=0.1",
            "policy.preemption_mode=swap", "kv.num_cpu_blocks=10000"]
    s = _assert_same(over)  # rows in the same order
    assert s["step_engine"] == "array_core" and s["num_swaps"] > 0


def test_a_chunked_step_whose_decodes_all_preempt_themselves_is_no_step():
    """Chunked prefill on a pool that binds: the only decode needs a block, and the latest
    arrival is itself (the prompt mid-prefill arrived before it): it is recomputed, nothing
    is left to run, and the replica plans again at once, with no step (no row, no time),
    as the core does."""
    over = [*TINY[:3], *UNIFORM, "policy=chunked_prefill", "policy.max_num_partial_prefills=2",
            "seed=82", "workload.qps=34.0", "workload.num_requests=60", "policy.max_num_seqs=2",
            "policy.max_num_batched_tokens=41", "kv.block_size=1", "workload.output_len.min=1",
            "kv.num_gpu_blocks_override=330", "policy.kv_watermark=0.0"]
    s = _assert_same(over)
    assert s["step_engine"] == "array_core" and s["num_preemptions"] > 0


def _files(tmp: Path, core: bool, overrides: tuple[str, ...]) -> tuple[pd.DataFrame, ...]:
    out = tmp / f"core_{core}"
    res = Simulation(compose_cfg(f"array_core={str(core).lower()}", *overrides), out).run()
    assert res.summary["step_engine"] == ("array_core" if core else "replica")
    summary = json.loads((out / "summary.json").read_text())
    return pd.read_csv(out / "requests.csv"), pd.read_csv(out / "steps.csv"), summary


@pytest.mark.parametrize("overrides", [
    # The benchmark's workload (Llama-3-8B on an A100), small: long jumps past finishes.
    ("model=llama3_8b", "hardware=a100_80gb", "workload=vidur_bench", "seed=42",
     "workload.num_requests=1500", "workload.qps=6", "policy.max_num_seqs=128",
     "policy.max_num_batched_tokens=4096"),
    # Batches of ten rows or fewer: decode geometry varies with the context there, priced
    # in arrays ahead of the horizon.
    ("model=llama3_8b", "hardware=a100_80gb", "workload=vidur_bench", "seed=3",
     "workload.num_requests=300", "workload.qps=2", "policy.max_num_seqs=6",
     "policy.max_num_batched_tokens=4096", "itl_quantiles=streaming"),
    # Sarathi-Serve with chunk 512 on the benchmark's workload.
    ("model=llama3_8b", "hardware=a100_80gb", "workload=vidur_bench", "seed=42",
     "workload.num_requests=1000", "workload.qps=6", "policy=chunked_prefill",
     "policy.max_num_seqs=128", "policy.max_num_batched_tokens=512"),
    (*TINY, *UNIFORM, "workload.num_requests=300", "workload.qps=300",
     "workload.output_len.min=1", "workload.prompt_len.min=1", "policy=chunked_prefill",
     "policy.max_num_seqs=16", "policy.max_num_batched_tokens=64",
     "policy.max_num_partial_prefills=2", "workload.priorities=[0,1,2]"),
    # Shortest predicted job first with a noisy predictor and aging, on the benchmark's
    # workload; priority classes without preemption, seats full with a queue.
    ("model=llama3_8b", "hardware=a100_80gb", "workload=vidur_bench", "seed=5",
     "workload.num_requests=800", "workload.qps=9", "policy=sjf", "policy.predictor=noisy",
     "policy.aging_s=2", "policy.max_num_seqs=32", "policy.max_num_batched_tokens=4096"),
    (*TINY, *UNIFORM, "workload.num_requests=300", "workload.qps=500", "policy=priority",
     "policy.preemptive=false", "workload.priorities=[2,0,1]", "policy.max_num_seqs=16",
     "workload.output_len.min=1", "workload.prompt_len.min=1"),
    # The benchmark's workload on pools that bind: preemption by recompute, and by swap
    # with a CPU pool small enough that some swaps fall back to recompute.
    ("model=llama3_8b", "hardware=a100_80gb", "workload=vidur_bench", "seed=42",
     "workload.num_requests=600", "workload.qps=8", "policy.max_num_seqs=128",
     "policy.max_num_batched_tokens=4096", "kv.num_gpu_blocks_override=1500"),
    ("model=llama3_8b", "hardware=a100_80gb", "workload=vidur_bench", "seed=42",
     "workload.num_requests=600", "workload.qps=8", "policy.max_num_seqs=128",
     "policy.max_num_batched_tokens=4096", "kv.num_gpu_blocks_override=1500",
     "policy.preemption_mode=swap", "kv.num_cpu_blocks=60"),
    # Many at once, one-token outputs among them, seats full with a queue.
    (*TINY, *UNIFORM, "workload.num_requests=300", "workload.qps=500",
     "workload.output_len.min=1", "workload.prompt_len.min=1", "policy.max_num_seqs=16",
     "workload.priorities=[3,1]"),
])
def test_files_equal_the_replica_loop(tmp_path, overrides):
    """requests.csv, steps.csv and summary.json as the replica loop's fast mode writes them:
    integers equal, times to 1e-9 relative (decode steps priced by other paths), every
    summary key but the loop's own counters."""
    ra, sa, ja = _files(tmp_path, True, overrides)
    rb, sb, jb = _files(tmp_path, False, overrides)
    for a, b in ((ra, rb), (sa, sb)):
        assert list(a.columns) == list(b.columns) and len(a) == len(b)
        for c in a.columns:
            if a[c].dtype.kind == "f":
                assert np.allclose(a[c].fillna(-1), b[c].fillna(-1), rtol=1e-9, atol=0), c
            else:
                assert a[c].equals(b[c]), c
    assert ja.keys() == jb.keys()
    for k in ja.keys() - {"wall_time_s", "num_decode_jumps", "step_engine"}:
        if isinstance(ja[k], float):
            assert ja[k] == pytest.approx(jb[k], rel=1e-9), k
        else:
            assert ja[k] == jb[k], k


def test_same_seed_same_bytes(tmp_path):
    cfg = (*TINY, "workload.num_requests=150", "workload.qps=60", "seed=7")
    texts = []
    for run in range(2):
        out = tmp_path / str(run)
        Simulation(compose_cfg(*cfg), out).run()
        texts.append([(out / f).read_bytes() for f in ("requests.csv", "steps.csv")])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("overrides,reason", [
    (("step_mode=exact",), "step_mode=exact"),
    (("array_core=false",), "array_core=false"),
    (("policy=sjf", "policy.preemptive=true"), "may preempt a running request to admit"),
    (("policy=priority", "workload.priorities=[1,1]"), "may preempt a running request"),
    (("policy=static", "cluster=disaggregated"), "reserves whole lengths"),
    (("check_integrity=true", "kv.num_gpu_blocks_override=500", "kv.num_cpu_blocks=16"), "check_integrity"),
    (("cluster.num_replicas=2", "cluster.router=prefix_aware"),
     "reads more than outstanding request counts and KV usage"),
    (("cluster=disaggregated", "cluster.prefill.pipeline_parallel_size=2", "policy=vllm_v1",
      "policy.scheduling_policy=priority", "kv.enable_prefix_caching=false"),
     "the prefill pool's pipeline stages under policy 'vllm_v1' with a waiting queue"),
    (("kv.num_gpu_blocks_override=300", "policy=chunked_prefill", "policy.preemption_mode=swap"),
     "the KV pool can bind, with policy.preemption_mode=swap under chunked prefill"),
    (("kv.num_gpu_blocks_override=300", "policy=static", "kv.enable_prefix_caching=true"),
     "the KV pool can bind, with prefix caching"),
    (("kv.num_gpu_blocks_override=300", "policy=sjf", "policy.preemptive=true"),
     "may preempt a running request to admit"),
    (("kv.num_gpu_blocks_override=60", "policy.preemption_mode=swap"),
     "swap and a watermark of no block"),
    (("kv.num_gpu_blocks_override=300", "kv.enable_prefix_caching=true"), "prefix caching"),
    (("kv.num_gpu_blocks_override=300", "policy.max_num_batched_tokens=256"),
     "whose recompute (prompt + output - 1 tokens) exceeds policy.max_num_batched_tokens"),
    (("kv.num_gpu_blocks_override=21", "policy.kv_watermark=0.1"), "alone fills the pool"),
    (("model.max_model_len=300",), "longer than model.max_model_len"),
    (("policy=vllm_v1", "policy.max_num_seqs=300", "policy.max_num_batched_tokens=256"),
     "policy.max_num_seqs > policy.max_num_batched_tokens"),
    (("kv.num_gpu_blocks_override=19", "policy=vllm_v1"), "alone fills the pool"),
    (("kv.num_gpu_blocks_override=300", "policy=trtllm", "kv.enable_prefix_caching=true"),
     "the KV pool can bind, with prefix caching"),
    (("kv.num_gpu_blocks_override=18", "policy=trtllm"), "alone fills the pool"),
    (("policy=sglang", "policy.schedule_policy=lpm"), "schedule_policy=lpm"),
    (("policy=sglang", "cluster=disaggregated"), "admits on the free pool"),
])
def test_runs_it_cannot_take_go_to_the_replica_loop(overrides, reason):
    sim = Simulation(compose_cfg(*TINY, "workload.num_requests=30", *overrides))
    s = sim.run().summary
    assert s["step_engine"] == "replica" and reason in sim.array_core_skipped
    assert s["completed"] + s["rejected"] == 30


def test_wrapped_executor_and_kept_requests_go_to_the_replica_loop():
    sim = Simulation(compose_cfg(*TINY, "workload.num_requests=20"), keep_requests=True)
    res = sim.run()
    assert res.summary["step_engine"] == "replica" and len(res.requests) == 20
    sim = Simulation(compose_cfg(*TINY, "workload.num_requests=20"))
    sim.replace_executor(RecordingExecutor(sim.executor))
    assert sim.run().summary["step_engine"] == "replica"
    assert "RecordingExecutor" in sim.array_core_skipped


@settings(max_examples=200, deadline=None)
@given(ctx=st.lists(st.integers(-300, 300), max_size=12), k=st.integers(300, 700),
       bs=st.sampled_from([1, 2, 16, 32]))
def test_block_count_in_closed_form(ctx, k, bs):
    count = _BlockCount(bs)
    for c in ctx:
        count.add(c, 1)
    count.add(5, 1)
    count.add(5, -1)
    assert count.at(k) == sum(-(-(c + k) // bs) for c in ctx)


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.integers(1, 300), min_size=1, max_size=12),
       running=st.integers(0, 5), seqs=st.integers(1, 8), budget=st.integers(8, 700))
def test_head_admissions_is_admits_rule_where_the_pool_cannot_bind(prompts, running, seqs,
                                                                    budget):
    """What FCFS's schedule admits from a queue (a pool that never binds, ``running``
    requests decoding) is what head_admissions says, in count and tokens."""
    running = min(running, seqs)
    budget = max(budget, seqs)
    prompts = [min(p, budget) for p in prompts]  # longer ones are refused at arrival
    policy = make_policy({"name": "fcfs", "max_num_seqs": seqs,
                          "max_num_batched_tokens": budget})
    kv = KVBlockManager(10_000, 16)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    for i in range(running):
        r = Request(100 + i, 0.0, 10, 50)
        r.transition(RequestStatus.RUNNING)
        r.num_computed_tokens = 10
        r.num_output_tokens = 1
        assert kv.allocate_slots(r.request_id, 10) is not None
        queues.add_running(r)
    for i, p in enumerate(prompts):
        queues.waiting.append(Request(i, 1.0, p, 5))
    plan = policy.schedule(builder)
    admitted = [s for s in plan.scheduled if s.start_position == 0]
    count, tokens = policy.head_admissions(prompts, seqs - running)
    assert len(admitted) == count
    assert sum(s.num_new_tokens for s in admitted) == tokens
    assert [s.request_id for s in admitted] == list(range(count))


@settings(max_examples=200, deadline=None)
@given(prompts=st.lists(st.integers(1, 300), min_size=1, max_size=12),
       running=st.lists(st.integers(1, 300), max_size=5), seqs=st.integers(1, 8),
       budget=st.integers(300, 700), block=st.sampled_from([1, 4, 16]),
       pool=st.integers(1, 120), watermark=st.sampled_from([0.0, 0.01, 0.1]),
       recomputed=st.integers(0, 3))
def test_head_admissions_counts_blocks_as_admit_where_the_pool_can_bind(
        prompts, running, seqs, budget, block, pool, watermark, recomputed):
    """On a pool that can bind, FCFS's schedule admits what head_admissions says with the
    pool's free blocks, watermark and block size as ``room``: the whole pending prefill's
    blocks must leave the watermark free (recomputed requests, at the head, re-prefill
    their prompt and the tokens they had sampled)."""
    from sim.step_builder import watermark_blocks

    running = running[:seqs]
    policy = make_policy({"name": "fcfs", "max_num_seqs": seqs,
                          "max_num_batched_tokens": budget, "kv_watermark": watermark})
    kv = KVBlockManager(pool, block)
    wm = watermark_blocks(watermark, pool)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv, kv_watermark=watermark)
    for i, ctx in enumerate(running):
        r = Request(100 + i, 0.0, ctx, 50)
        r.transition(RequestStatus.RUNNING)
        r.num_computed_tokens = ctx
        r.num_output_tokens = 1
        if kv.allocate_slots(r.request_id, ctx) is None:
            break
        queues.add_running(r)
    pending = []
    for i, p in enumerate(prompts):
        r = Request(i, 1.0, p, 50)
        if i < recomputed:  # preempted after sampling a few tokens: it prefills them too
            r.transition(RequestStatus.RUNNING)
            r.num_output_tokens = 1 + i
            r.transition(RequestStatus.PREEMPTED)
        if r.num_pending_tokens > budget or -(-r.num_pending_tokens // block) + wm > pool:
            break  # refused at arrival, or outside the core (alone it would not fit)
        queues.waiting.append(r)
        pending.append(r.num_pending_tokens)
    seats, free = seqs - len(queues.running), kv.num_free_blocks
    count, tokens = policy.head_admissions(pending, seats, (free, wm, block))
    plan = policy.schedule(builder)
    admitted = [s for s in plan.scheduled if s.start_position == 0]
    assert [s.request_id for s in admitted] == list(range(count))
    assert sum(s.num_new_tokens for s in admitted) == tokens


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 2), st.integers(1, 400)),
                     min_size=1, max_size=10),
       block=st.sampled_from([1, 2, 16]), spare=st.integers(0, 3),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]))
def test_decode_preemptions_is_schedules_rule(rows, block, spare, policy):
    """A decode step whose rows' new blocks may not fit: the policy's schedule preempts the
    last ``decode_preemptions(needs, held, free)`` running requests in its running order
    (arrival; priority class; predicted remainder, from the longest), and only those."""
    from sim.kv_manager import blocks_for

    pol = make_policy({"name": policy, "max_num_seqs": 64, "max_num_batched_tokens": 4096})
    kv = KVBlockManager(sum(blocks_for(c, block) for c, _, _ in rows) + spare, block)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    reqs = []
    for i, (ctx, priority, predicted) in enumerate(rows):
        r = Request(i, float(i), ctx, 500, priority)
        r.extra = {"predicted_output_len": float(predicted)}
        r.transition(RequestStatus.RUNNING)
        r.num_computed_tokens = ctx
        r.num_output_tokens = 1
        assert kv.allocate_slots(i, ctx) is not None
        queues.add_running(r)
        reqs.append(r)
    key = pol.decode_run_key()
    order = reqs if key is None else sorted(reqs, key=key)
    ctxs = [r.num_computed_tokens for r in order]
    k = pol.decode_preemptions([1 if c % block == 0 else 0 for c in ctxs],
                               [blocks_for(c, block) for c in ctxs], kv.num_free_blocks)
    pol.schedule(builder)
    preempted = {r.request_id for r in reqs if r.status is RequestStatus.PREEMPTED}
    assert preempted == {r.request_id for r in order[len(order) - k:]}


@settings(max_examples=200, deadline=None)
@given(ctxs=st.lists(st.integers(1, 200), max_size=8),
       partial=st.one_of(st.none(), st.tuples(st.integers(2, 400), st.integers(1, 399))),
       block=st.sampled_from([1, 2, 16]), spare=st.integers(0, 4), budget=st.integers(8, 300),
       queued=st.integers(0, 3))
def test_vllm_v1_decode_preemptions_is_schedules_rule(ctxs, partial, block, spare, budget,
                                                      queued):
    """vLLM v1's step where the running requests' grants may not fit: requests decoding,
    then the prompt mid-prefill (admitted last, holding its computed tokens' blocks, its
    chunk what the budget leaves after the decodes), a queue behind them. The schedule
    preempts the last ``decode_preemptions(needs, held, free)`` of them in arrival order,
    and where it preempts anyone it grants the others their tokens and admits nobody."""
    from sim.kv_manager import blocks_for

    assume(ctxs or partial)
    pol = make_policy({"name": "vllm_v1", "max_num_seqs": 16,
                       "max_num_batched_tokens": max(budget, 16)})
    room = max(budget, 16) - len(ctxs)
    needs, held = [], []
    for c in ctxs:
        needs.append(blocks_for(c + 1, block) - blocks_for(c, block))
        held.append(blocks_for(c, block))
    if partial is not None:
        p, c = partial[0], min(partial[1], partial[0] - 1)
        n = min(p - c, room)
        needs.append(blocks_for(c + n, block) - blocks_for(c, block) if n > 0 else 0)
        held.append(blocks_for(c, block))
    kv = KVBlockManager(sum(held) + spare, block)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    reqs = [_running(queues, kv, i, c, 50, computed=c, held=c, sampled=1)
            for i, c in enumerate(ctxs)]
    if partial is not None:
        reqs.append(_running(queues, kv, len(reqs), p, 5, computed=c, held=c))
    for j in range(queued):
        queues.waiting.append(Request(100 + j, 1.0, 8, 5))
    k = pol.decode_preemptions(needs, held, kv.num_free_blocks)
    plan = pol.schedule(builder)
    preempted = {r.request_id for r in reqs if r.status is RequestStatus.PREEMPTED}
    assert preempted == {r.request_id for r in reqs[len(reqs) - k:]}
    if k:
        grants = {s.request_id: s.num_new_tokens for s in plan.scheduled}
        assert grants == {r.request_id: 1 for r in reqs[:len(reqs) - k]}


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 400), st.integers(0, 2),
                               st.floats(0.0, 2.0)), min_size=1, max_size=12),
       running=st.integers(0, 5), seqs=st.integers(1, 8), budget=st.integers(8, 700),
       now=st.floats(0.0, 3.0),
       policy=st.sampled_from([{"name": "sjf"}, {"name": "sjf", "aging_s": 1.0},
                               {"name": "sjf", "predictor": "noisy", "aging_s": 0.5},
                               {"name": "priority", "preemptive": False}]),
       pool=st.sampled_from([10_000, 10_000, 12, 25]), watermark=st.sampled_from([0.0, 0.1]))
def test_indexed_admissions_is_admits_rule(reqs, running, seqs, budget, now, policy, pool,
                                           watermark):
    """What an ordered policy's schedule admits at ``now`` (its own order, aging included;
    ``running`` requests decoding) is what indexed_admissions says: the same requests in the
    same order, each moved to RUNNING. On a pool that can bind, with its free blocks,
    watermark and block size as ``room``."""
    from sim.step_builder import watermark_blocks

    running = min(running, seqs)
    budget = max(budget, seqs)
    cfg = {**policy, "max_num_seqs": seqs, "max_num_batched_tokens": budget,
           "kv_watermark": watermark}
    by_schedule, by_rule = make_policy(cfg, seed=3), make_policy(cfg, seed=3)
    kv = KVBlockManager(pool, 16)
    wm = watermark_blocks(watermark, pool)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv, kv_watermark=watermark)
    builder.reset(now)
    for i in range(running):
        r = Request(100 + i, 0.0, 10, 50)
        r.extra = {"predicted_output_len": 50.0}  # what SJF's on_arrival would have set
        r.transition(RequestStatus.RUNNING)
        r.num_computed_tokens = 10
        r.num_output_tokens = 1
        if kv.allocate_slots(r.request_id, 10) is None:
            running = i
            break
        queues.add_running(r)
    arrivals = sorted(min(a, now) for *_, a in reqs)
    twins = []
    for i, ((p, out, pri, _), arrival) in enumerate(zip(reqs, arrivals)):
        p = min(p, budget)
        if -(-p // 16) + wm > pool:
            continue  # outside the core: alone it would not fit the pool
        a, b = (Request(i, arrival, p, out, pri) for _ in range(2))
        queues.waiting.append(a)
        by_schedule.on_arrival(a)
        by_rule.on_arrival(b)
        twins.append(b)
    room = None if pool == 10_000 else (kv.num_free_blocks, wm, 16)
    chosen = by_rule.indexed_admissions(now, seqs - running, room)
    plan = by_schedule.schedule(builder)
    admitted = [s.request_id for s in plan.scheduled if s.start_position == 0]
    assert [r.request_id for r in chosen] == admitted
    assert all(r.status is RequestStatus.RUNNING for r in chosen)
    assert all(r.status is RequestStatus.WAITING for r in twins if r not in chosen)


def _running(queues: ReplicaQueues, kv: KVBlockManager, rid: int, prompt: int, output: int,
             computed: int, held: int, sampled: int = 0) -> Request:
    """A running request with ``computed`` prompt tokens computed and ``sampled`` sampled,
    holding blocks for ``held`` tokens."""
    r = Request(rid, 0.0, prompt, output)
    r.transition(RequestStatus.RUNNING)
    r.num_computed_tokens = computed
    r.num_output_tokens = sampled
    assert kv.allocate_slots(rid, held) is not None
    queues.add_running(r)
    return r


@settings(max_examples=150, deadline=None)
@given(decoding=st.integers(0, 6), partial=st.lists(st.tuples(st.integers(2, 400),
                                                              st.integers(0, 399)), max_size=4),
       prompts=st.lists(st.integers(1, 400), max_size=8), seqs=st.integers(4, 16),
       budget=st.integers(16, 600), k=st.integers(1, 3),
       spare=st.sampled_from([None, 0, 8, 30]), watermark=st.sampled_from([0.0, 0.05]))
def test_chunk_plan_is_schedules_step(decoding, partial, prompts, seqs, budget, k, spare,
                                      watermark):
    """chunked_prefill's schedule with requests decoding (their next tokens need no new
    block), prompts mid-prefill (one token or more left) and a queue: the chunks it grants
    are chunk_plan's. On a pool that can bind (``spare`` blocks free), with its free
    blocks, watermark and block size as ``room``."""
    from sim.step_builder import watermark_blocks

    partial = [(p, min(c, p - 1)) for p, c in partial][:max(0, seqs - decoding)]
    decoding = min(decoding, seqs - len(partial))
    budget = max(budget, seqs)
    policy = make_policy({"name": "chunked_prefill", "max_num_seqs": seqs,
                          "max_num_batched_tokens": budget, "max_num_partial_prefills": k,
                          "kv_watermark": watermark})
    held = decoding + sum(-(-p // 16) for p, _ in partial)
    pool = 10_000 if spare is None else held + spare + 1
    kv = KVBlockManager(pool, 16)
    wm = watermark_blocks(watermark, pool)
    prompts = [p for p in prompts if -(-p // 16) + wm <= pool]  # the core's: each fits alone
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv, kv_watermark=watermark)
    rid = 0
    for _ in range(decoding):
        _running(queues, kv, rid, 10, 50, computed=10, held=10, sampled=1)
        rid += 1
    mids = []
    for p, c in partial:  # holding its whole prompt's blocks, c tokens computed
        mids.append(_running(queues, kv, rid, p, 5, computed=c, held=p))
        rid += 1
    for n in prompts:
        queues.waiting.append(Request(rid, 1.0, n, 5))
        rid += 1
    room = None if spare is None else (kv.num_free_blocks, wm, 16)
    plan = policy.schedule(builder)
    grants = {s.request_id: s.num_new_tokens for s in plan.scheduled}
    ones = [r for r in mids if r.prompt_len - r.num_computed_tokens == 1]
    multi = [r for r in mids if r.prompt_len - r.num_computed_tokens > 1]
    chunks, admitted = policy.chunk_plan(
        decoding + len(ones), [r.prompt_len - r.num_computed_tokens for r in multi], prompts,
        len(prompts), seqs - decoding - len(mids), room)
    assert all(grants[r.request_id] == 1 for r in ones)
    assert [grants.get(r.request_id, 0) for r in multi] == chunks + [0] * (len(multi) - len(chunks))
    first_waiting = decoding + len(mids)
    assert [grants.get(first_waiting + j) for j in range(len(admitted))] == admitted
    assert first_waiting + len(admitted) not in grants


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(200, 600), out_min=st.integers(1, 3),
       prompt_min=st.sampled_from([1, 2, 50]), block=st.sampled_from([1, 16]),
       pool=st.sampled_from([None, 25, 60, 400]), chunked=st.booleans(),
       pauses=st.booleans())
def test_trtllm_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget, out_min,
                                                            prompt_min, block, pool, chunked,
                                                            pauses):
    """TensorRT-LLM's guaranteed_no_evict: every request holds its whole length from
    admission on, admitted only while the pool holds it (``pool`` blocks of 16 tokens' worth;
    None: a pool that never binds), prompts whole or, with chunked prefill, the last admitted
    cut to what the budget leaves. ``pauses``: max_utilization instead, admitted on its
    prompt's blocks (with chunked prefill, holding them all from its first chunk), the
    latest arrivals paused (recomputed) when a decode finds no block."""
    capacity = "max_utilization" if pauses else "guaranteed_no_evict"
    over = [*TINY, *UNIFORM, "policy=trtllm", f"seed={seed}", f"workload.qps={qps}",
            "workload.num_requests=60", f"policy.max_num_seqs={seqs}",
            f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
            f"workload.prompt_len.min={prompt_min}", f"workload.output_len.min={out_min}",
            f"policy.enable_chunked_prefill={str(chunked).lower()}",
            f"policy.capacity_scheduler_policy={capacity}"]
    if pool is not None:
        over.append(f"kv.num_gpu_blocks_override={pool * 16 // block}")
    _assert_same(over)
    sim = Simulation(compose_cfg(*over))
    assert sim.run().summary["step_engine"] == "array_core" or (
        pauses and "whose recompute" in sim.array_core_skipped), sim.array_core_skipped


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 1000.0), seqs=st.integers(1, 40),
       budget=st.integers(40, 600), chunk=st.floats(0.0, 1.0), out_min=st.integers(1, 3),
       prompt_min=st.sampled_from([1, 2, 50]), block=st.sampled_from([1, 16]),
       conservativeness=st.sampled_from([0.3, 1.0, 3.0]), clip=st.sampled_from([None, 3, 40]),
       tight=st.one_of(st.none(), st.tuples(st.integers(10, 200), st.integers(5, 100),
                                            st.integers(-60, 1))))
# The estimates stop admission with seats free: a prefill batch is tried after every decode
# batch (the ratio falls with each), and a prompt cut to one token from done is counted.
@example(seed=8151, qps=1000.0, seqs=3, budget=526, chunk=0.89, out_min=1, prompt_min=1,
         block=16, conservativeness=3.0, clip=None, tight=(147, 45, 0))
@example(seed=16, qps=1000.0, seqs=4, budget=316, chunk=3 / 316, out_min=1, prompt_min=1,
         block=16, conservativeness=3.0, clip=None, tight=(133, 41, 1))
# ... and the ratio starts over after the replica has idled (no request at all).
@example(seed=8151, qps=5.0, seqs=3, budget=526, chunk=0.89, out_min=1, prompt_min=1,
         block=16, conservativeness=3.0, clip=None, tight=(147, 45, 0))
# A pool that binds: requests retracted, back from the queue's tail, finish in the same decode
# rows as earlier arrivals (rows, and finishers, in arrival order).
@example(seed=1, qps=100.0, seqs=4, budget=40, chunk=0.0, out_min=1, prompt_min=1, block=1,
         conservativeness=0.3, clip=None, tight=(10, 5, -12))
def test_sglang_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget, chunk,
                                                            out_min, prompt_min, block,
                                                            conservativeness, clip, tight):
    """SGLang's prefill batches apart from its decode batches: prompts cut to the chunk size
    and continued first in the next prefill batch, chunks of one token and prompts left one
    token from done (decoded in the next decode batch), admission by the output estimate
    and a ratio that falls with every decode batch (``conservativeness`` raises it), the
    estimates capped (``clip``: SGLang's 4,096 made small enough to bind). ``tight``:
    (prompt, output, extra blocks) of near-constant lengths on a pool just large enough
    never to run short (extra 0 or 1), where the output estimates stop admission while seats
    are free, or smaller: a decode batch whose blocks do not fit retracts requests (fewest
    outputs first), which rejoin the queue at its tail."""
    over = [*TINY, *UNIFORM, "policy=sglang", f"seed={seed}", f"workload.qps={qps}",
            "workload.num_requests=60", f"policy.max_num_batched_tokens={budget}",
            f"policy.chunked_prefill_size={max(1, round(chunk * budget))}",
            f"policy.schedule_conservativeness={conservativeness}", f"kv.block_size={block}",
            f"workload.prompt_len.min={prompt_min}", f"workload.output_len.min={out_min}"]
    if tight is None:
        over.append(f"policy.max_num_seqs={min(seqs, budget)}")
    else:
        p, o, extra = tight
        seqs = min(seqs, 8)
        one = -(-(p + o - 1) // block)  # a request's blocks at its last token
        over += [f"policy.max_num_seqs={seqs}", f"workload.prompt_len.min={p}",
                 f"workload.prompt_len.max={p}", f"workload.output_len.min={max(1, o - 5)}",
                 f"workload.output_len.max={o}",
                 f"kv.num_gpu_blocks_override={max(seqs * one + extra, one + 1)}"]
    with pytest.MonkeyPatch.context() as mp:
        if clip is not None:
            mp.setattr("policies.sglang.CLIP_MAX_NEW_TOKENS", clip)
        assert _assert_same(over)["step_engine"] == "array_core"


def test_a_policy_stating_no_preemptions_on_counts_is_given_up_where_one_comes(monkeypatch):
    """A policy that states ``array_core`` but neither decode preemptions nor retractions on
    counts (vLLM v1 without its ``decode_preemptions``) runs on a pool that can bind with its
    admission counting blocks until a running request finds none; the run is then the
    replica loop's, from the start."""
    from policies.vllm_v1 import VLLMV1Policy

    monkeypatch.setattr(VLLMV1Policy, "decode_preemptions", None)
    over = [*TINY, *UNIFORM, "policy=vllm_v1", "seed=0", "workload.qps=400",
            "workload.num_requests=60", "policy.max_num_seqs=40",
            "policy.max_num_batched_tokens=600", "workload.prompt_len.min=50",
            "workload.output_len.min=1"]
    s = same_or_given_up([*over, "kv.num_gpu_blocks_override=60"], True)
    assert s["step_engine"] == "replica" and s["num_preemptions"] > 0
    # A pool that could bind but never does: the core runs it all.
    assert _assert_same([*over, "kv.num_gpu_blocks_override=600"])["step_engine"] == "array_core"


def test_sglang_retraction_rule():
    """``retract_decode`` on counts: fewest outputs first, longest prompt first among
    equals, the latest in running order first among those, until the rest hold 20 more
    tokens each (one-token blocks here); the ratio from those left."""
    pol = make_policy({"name": "sglang", "max_num_seqs": 8, "max_num_batched_tokens": 64,
                       "chunked_prefill_size": 64})
    outputs = [5, 1, 1, 3, 1]
    prompts = [10, 30, 30, 10, 20]
    computed = [p + o - 1 for p, o in zip(prompts, outputs)]
    # Each needs 20 blocks to go on 20 tokens, none free: row 2 (the latest of the longest
    # prompts among the fewest outputs) leaves, then row 1, freeing what they hold (30 each).
    assert pol.decode_retractions(outputs, prompts, computed, computed, [50] * 5, 0, 1) == [2, 1]
    assert pol.new_token_ratio == pytest.approx((5 + 3 + 1 + 3 * 20) / 150)
    assert pol.decode_retractions(outputs, prompts, computed, computed, [50] * 5, 100, 1) == []
    # Alone, and its next token finds no block: it leaves too.
    assert pol.decode_retractions([1], [10], [10], [10], [50], 0, 1) == [0]


def test_sglang_retracts_on_the_core():
    """SGLang on a 150-block pool that binds, its cache off: decode batches whose blocks do
    not fit retract requests, which rejoin the queue at its tail; the core runs it, with
    exact mode's steps and requests (with the cache on: the runs below)."""
    caching = "false"
    s = _assert_same([*TINY, *UNIFORM, "policy=sglang", "seed=3", "workload.qps=300",
                      "workload.num_requests=80", "policy.max_num_seqs=40",
                      "policy.max_num_batched_tokens=600", "policy.chunked_prefill_size=300",
                      "kv.block_size=4", "kv.num_gpu_blocks_override=150",
                      f"kv.enable_prefix_caching={caching}"])
    assert s["step_engine"] == "array_core" and s["num_preemptions"] > 0


@pytest.mark.parametrize("over", [
    # Readmitted in different steps.
    ["seed=233", "workload.num_requests=63", "workload.qps=29.257", "workload.prompt_len.min=1",
     "policy.max_num_batched_tokens=1130", "policy.chunked_prefill_size=640",
     "policy.max_num_seqs=43", "kv.block_size=16", "kv.num_gpu_blocks_override=43"],
    # Readmitted in the same prefill batch.
    ["seed=1622", "workload.num_requests=135", "workload.qps=26.893",
     "workload.prompt_len.min=2", "workload.output_len.min=2",
     "policy.max_num_batched_tokens=1426", "policy.chunked_prefill_size=1233",
     "policy.max_num_seqs=62", "policy.schedule_conservativeness=0.3", "kv.block_size=1",
     "kv.num_gpu_blocks_override=961"]])
def test_sglang_retracted_requests_find_their_blocks_moved_up(over):
    """SGLang on a pool that binds: a request retracted earlier comes back from the queue's
    tail before one retracted later, and the blocks it takes back from the free queue move
    the later one's up (what it finds cached then), in a later step or in the same prefill
    batch. The core, as exact mode."""
    s = _assert_same(["model=tiny", *UNIFORM, "policy=sglang", "workload.prompt_len.max=50",
                      "workload.output_len.max=300", "workload.output_len.min=1",
                      "kv.enable_prefix_caching=true", *over])
    assert s["step_engine"] == "array_core" and s["prefix_cache_hits"] > 0


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(200, 2000), batch=st.one_of(st.none(), st.integers(1, 40)),
       out_min=st.integers(1, 3), block=st.sampled_from([1, 16]),
       pool=st.sampled_from([None, 25, 60, 400]), watermark=st.sampled_from([0.0, 0.05]))
def test_static_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget, batch,
                                                            out_min, block, pool, watermark):
    """Static batching: a batch formed only once the last one has ended, over prefill-only
    steps while the token budget alone keeps the next request out, each request holding its
    whole length from admission on (``pool`` blocks of 16 tokens' worth; None: a pool that
    never binds), ``batch`` seats at most."""
    over = [*TINY, *UNIFORM, "policy=static", f"seed={seed}", f"workload.qps={qps}",
            "workload.num_requests=60", f"policy.max_num_seqs={seqs}",
            f"policy.max_num_batched_tokens={budget}", f"kv.block_size={block}",
            f"workload.output_len.min={out_min}", f"policy.kv_watermark={watermark}",
            f"policy.max_batch_size={'null' if batch is None else batch}"]
    if pool is not None:
        over.append(f"kv.num_gpu_blocks_override={pool * 16 // block}")
    if _assert_same(over)["step_engine"] != "array_core":
        sim = Simulation(compose_cfg(*over))
        sim.run()
        reason = sim.array_core_skipped
        assert (pool is not None and "alone fills the pool" in reason) or (
            batch is not None and batch > seqs and "max_batch_size" in reason), reason


@settings(max_examples=200, deadline=None)
@given(members=st.lists(st.tuples(st.integers(1, 300), st.integers(2, 200)), max_size=6),
       forming=st.booleans(), queue=st.lists(st.tuples(st.integers(1, 300),
                                                       st.integers(1, 200)), max_size=8),
       seqs=st.integers(1, 16), batch=st.one_of(st.none(), st.integers(1, 16)),
       budget=st.integers(300, 1200), spare=st.one_of(st.none(), st.integers(0, 120)),
       block=st.sampled_from([1, 16]))
def test_static_head_admissions_is_schedules_step(members, forming, queue, seqs, batch,
                                                  budget, spare, block):
    """Static batching's schedule with a batch decoding (or none: the last has ended), the
    batch open for more or closed, and a queue: the prompts it admits are head_admissions',
    and both leave the batch open or closed alike. ``spare``: free blocks of a pool that can
    bind (None: one that cannot), the watermark aside."""
    cfg = {"name": "static", "max_num_seqs": seqs, "max_batch_size": batch,
           "max_num_batched_tokens": budget}
    policy, mirror = make_policy(cfg), make_policy(cfg)
    kv = KVBlockManager(1 << 14, block)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    rid = 0
    for prompt, output in members[:min(seqs, policy.config.batch_size)]:
        r = _running(queues, kv, rid, prompt, output, computed=prompt,
                     held=prompt + output - 1, sampled=1)
        policy.batch.add(r.request_id)
        rid += 1
    policy.forming = mirror.forming = forming and bool(queues.running)
    if spare is not None:
        kv.allocate_slots("held elsewhere", (kv.num_free_blocks - spare) * block)
    first_waiting = rid
    for prompt, output in queue:
        queues.waiting.append(Request(rid, 1.0, prompt, output))
        rid += 1
    room = None if spare is None else (kv.num_free_blocks, 0, block)
    running = len(queues.running)
    plan = policy.schedule(builder)
    admitted = [s.num_new_tokens for s in plan.scheduled if s.request_id >= first_waiting]
    k, tokens = mirror.head_admissions(
        (p for p, _ in queue), seqs - running, room,
        None if room is None else (p + o - 1 for p, o in queue))
    assert admitted == [p for p, _ in queue[:k]] and tokens == sum(admitted)
    assert mirror.forming == policy.forming


@settings(max_examples=200, deadline=None)
@given(decoding=st.lists(st.tuples(st.integers(1, 300), st.integers(2, 6000),
                                   st.integers(1, 200)), max_size=6),
       partial=st.tuples(st.integers(2, 400), st.integers(0, 399)),
       partial_state=st.sampled_from(["none", "mid", "one_left"]),
       queue=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 8000)), min_size=1,
                      max_size=8),
       seqs=st.integers(1, 16), budget=st.integers(16, 2000), chunk=st.floats(0.0, 1.0),
       spare=st.one_of(st.integers(0, 700), st.integers(700, 20_000)),
       block=st.sampled_from([1, 16]),
       decode_batches=st.integers(0, 800), conservativeness=st.sampled_from([0.3, 1.0, 3.0]))
# The second admission's room, one token short if the first took a block too many.
@example(decoding=[], partial=(2, 0), partial_state="none", queue=[(10, 5), (10, 5)], seqs=16,
         budget=600, chunk=1.0, spare=31, block=1, decode_batches=0, conservativeness=1.0)
# A pool with no free block: the prompt mid-chunk fills the six slots left in its own block.
@example(decoding=[], partial=(100, 10), partial_state="mid", queue=[(5, 5)], seqs=16,
         budget=600, chunk=1.0, spare=0, block=16, decode_batches=0, conservativeness=1.0)
def test_sglang_prefill_plan_is_schedules_step(decoding, partial, partial_state, queue, seqs,
                                               budget, chunk, spare, block, decode_batches,
                                               conservativeness):
    """SGLang's schedule with requests decoding (outputs past the 4,096 its estimates count
    included), a prompt mid-chunk or one token from done, and a queue, at any point of the
    ratio's fall, on pools small enough for its output estimates to stop admission: the
    prefill batch it plans is prefill_plan's, and where it plans a decode batch
    prefill_plan grants nothing. ``spare``: the pool's free tokens, about (the rest held)."""
    cfg = {"name": "sglang", "max_num_seqs": seqs, "max_num_batched_tokens": budget,
           "chunked_prefill_size": max(1, round(chunk * budget)),
           "schedule_conservativeness": conservativeness}
    policy, mirror = make_policy(cfg), make_policy(cfg)
    policy._lower_ratio(decode_batches)
    kv = KVBlockManager(1 << 15, block)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    rid = 0
    decodes = []
    for prompt, output, sampled in decoding[:seqs - (partial_state != "none")]:
        sampled = min(sampled, output - 1)
        decodes.append(_running(queues, kv, rid, prompt, output, computed=prompt + sampled - 1,
                                held=prompt + sampled - 1, sampled=sampled))
        decodes[-1].num_computed_tokens = prompt + sampled - 1
        rid += 1
    mid = None
    if partial_state != "none":
        p = partial[0]
        c = p - 1 if partial_state == "one_left" else min(partial[1], p - 2)
        mid = _running(queues, kv, rid, p, 5, computed=c, held=c)
        rid += 1
    kv.allocate_slots("held elsewhere", (kv.num_free_blocks - spare // block) * block)
    first_waiting = rid
    for prompt, output in queue:
        queues.waiting.append(Request(rid, 1.0, prompt, output))
        rid += 1
    free, running = kv.num_free_blocks, len(queues.running)
    plan = policy.schedule(builder)
    grants = {s.request_id: s.num_new_tokens for s in plan.scheduled}
    ones = [mid] if mid is not None and mid.num_pending_tokens == 1 else []
    multi = [mid] if mid is not None and not ones else []

    def remaining(cap: int) -> int:
        return sum(min(r.max_output_len - r.num_output_tokens, cap) for r in decodes + ones)

    mirror._lower_ratio(decode_batches)
    chunks, admitted = mirror.prefill_plan(
        0, remaining, [r.num_pending_tokens for r in multi],
        [r.num_computed_tokens for r in multi], queue, running, free, block)
    expected = {r.request_id: n for r, n in zip(multi, chunks)}
    expected.update({first_waiting + j: n for j, n in enumerate(admitted)})
    if expected:  # a prefill batch
        assert grants == expected
    else:  # a decode batch (some retracted where the pool cannot hold it)
        assert set(grants) <= {r.request_id for r in decodes + ones}
        assert set(grants.values()) <= {1}


@settings(max_examples=150, deadline=None)
@given(decoding=st.integers(0, 6), partial=st.tuples(st.integers(2, 400), st.integers(0, 399)),
       has_partial=st.booleans(), prompts=st.lists(st.integers(1, 400), max_size=8),
       seqs=st.integers(4, 16), budget=st.integers(16, 600),
       spare=st.sampled_from([None, 0, 1, 3, 8, 30]))
def test_vllm_v1_chunk_plan_is_schedules_step(decoding, partial, has_partial, prompts, seqs,
                                              budget, spare):
    """vLLM v1's schedule with requests decoding, at most one prompt mid-prefill (the
    latest admitted, one token or more left, holding the blocks of its computed tokens) and
    a queue: the chunks it grants are chunk_plan's. On a pool that can bind (``spare``
    blocks free once every running request has its pending tokens' blocks), with that
    room: each admitted chunk takes its own blocks, and the first that does not fit ends
    admission."""
    policy = make_policy({"name": "vllm_v1", "max_num_seqs": seqs,
                          "max_num_batched_tokens": max(budget, seqs)})
    p, c = partial[0], min(partial[1], partial[0] - 1)
    # Blocks the running requests hold, and those the prompt mid-prefill still needs.
    held = min(decoding, seqs - has_partial) + (-(-c // 16) if has_partial else 0)
    to_come = (-(-p // 16) - -(-c // 16)) if has_partial else 0
    kv = KVBlockManager(10_000 if spare is None else max(1, held + to_come + spare), 16)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    rid = 0
    for _ in range(min(decoding, seqs - has_partial)):
        _running(queues, kv, rid, 10, 50, computed=10, held=10, sampled=1)
        rid += 1
    num_decoding = rid
    mid = None
    if has_partial:  # holding the blocks of the tokens it computed
        mid = _running(queues, kv, rid, p, 5, computed=c, held=c)
        rid += 1
    for n in prompts:
        queues.waiting.append(Request(rid, 1.0, n, 5))
        rid += 1
    room = None if spare is None else (kv.num_free_blocks - to_come, 0, 16)
    plan = policy.schedule(builder)
    grants = {s.request_id: s.num_new_tokens for s in plan.scheduled}
    left = None if mid is None else mid.prompt_len - mid.num_computed_tokens
    chunks, admitted = policy.chunk_plan(
        num_decoding + (left == 1), [left] if left is not None and left > 1 else [], prompts,
        len(prompts), seqs - num_decoding - has_partial, room)
    assert not plan.recomputed
    assert all(grants[i] == 1 for i in range(num_decoding))
    if left == 1:
        assert grants[mid.request_id] == 1
    elif mid is not None:
        assert [grants.get(mid.request_id, 0)] == chunks + [0] * (1 - len(chunks))
    first_waiting = num_decoding + has_partial
    assert [grants.get(first_waiting + j) for j in range(len(admitted))] == admitted
    assert first_waiting + len(admitted) not in grants


@settings(max_examples=150, deadline=None)
@given(decoding=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), max_size=6),
       partial=st.tuples(st.integers(2, 400), st.integers(0, 399), st.integers(1, 200)),
       has_partial=st.booleans(),
       queue=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 200)), max_size=8),
       seqs=st.integers(4, 16), budget=st.integers(16, 600), spare=st.sampled_from(
           [None, 0, 8, 30, 80]), chunked=st.booleans())
def test_trtllm_chunk_plan_is_schedules_step(decoding, partial, has_partial, queue, seqs,
                                             budget, spare, chunked):
    """TensorRT-LLM's schedule (guaranteed_no_evict) with requests decoding and at most one
    prompt mid-prefill (the latest admitted), each holding its whole length, and a queue: the
    chunks it grants are chunk_plan's, with ``spare`` blocks free (None: a pool that never
    binds)."""
    if not chunked:
        has_partial = False
    policy = make_policy({"name": "trtllm", "max_num_seqs": seqs, "enable_chunked_prefill":
                          chunked, "max_num_batched_tokens": max(budget, seqs)})
    decoding = decoding[:seqs - has_partial]
    full = lambda p, o: -(-(p + o - 1) // 16)
    held = sum(full(p + 1, o) for p, o in decoding)
    if has_partial:
        held += full(partial[0], partial[2])
    pool = 100_000 if spare is None else max(held + spare, 1)
    kv = KVBlockManager(pool, 16)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    rid = 0
    for p, o in decoding:  # one token sampled, holding its whole length
        _running(queues, kv, rid, p, o + 1, computed=p, held=p + o, sampled=1)
        rid += 1
    mid = None
    if has_partial:
        p, c, o = partial[0], min(partial[1], partial[0] - 1), partial[2]
        mid = _running(queues, kv, rid, p, o, computed=c, held=p + o - 1)
        rid += 1
    for p, o in queue:
        queues.waiting.append(Request(rid, 1.0, p, o))
        rid += 1
    room = None if spare is None else (kv.num_free_blocks, 0, 16)
    plan = policy.schedule(builder)
    grants = {s.request_id: s.num_new_tokens for s in plan.scheduled}
    left = None if mid is None else mid.prompt_len - mid.num_computed_tokens
    prompts = [p for p, _ in queue]
    # (The core takes no run with a prompt over the budget without chunking: refused.)
    assume(chunked or all(p <= max(budget, seqs) for p in prompts))
    lengths = None if spare is None else [p + o - 1 for p, o in queue]
    chunks, admitted = policy.chunk_plan(
        len(decoding) + (left == 1), [left] if left is not None and left > 1 else [],
        prompts, len(prompts), seqs - len(decoding) - has_partial, room, lengths)
    assert all(grants[i] == 1 for i in range(len(decoding)))
    if left == 1:
        assert grants[mid.request_id] == 1
    elif mid is not None:
        assert [grants.get(mid.request_id, 0)] == chunks + [0] * (1 - len(chunks))
    first_waiting = len(decoding) + has_partial
    assert [grants.get(first_waiting + j) for j in range(len(admitted))] == admitted
    assert first_waiting + len(admitted) not in grants


class _ListWorkload(Workload):
    """Requests (arrival, prompt, output) as given."""

    def __init__(self, rows: list[tuple[float, int, int]]) -> None:
        self.rows = rows

    def __iter__(self):
        for rid, (t, p, o) in enumerate(self.rows):
            yield Request(rid, t, p, o)

    @property
    def max_prompt_len(self) -> int:
        return max(p for _, p, _ in self.rows)


def _rows_of(mode: str, rows: list, *overrides: str) -> tuple[list, list, str]:
    sim = Simulation(compose_cfg(f"step_mode={mode}", *TINY, *overrides))
    sim.workload = _ListWorkload(rows)
    res = sim.run()
    steps = [tuple(r[i] for i in (0, 4, 5, 6, 7, 8, 9, 11)) + (float(r[2]),)
             for r in res.steps_sink.rows]
    reqs = sorted((r[0], r[9], r[10], r[11]) for r in res.requests_sink.rows)
    return steps, reqs, res.summary["step_engine"]


_EXACT_PRICES = """model: tiny
device: a100_80gb
dtype: fp16
tensor_parallel: 1
coefficients: {{s_per_step: {step}, s_per_seq: {seq}, s_per_token: 0.0, s_per_flop: 0.0,
  s_per_weight_byte: 0.0, s_per_attn_flop: 0.0, s_per_diag_flop: 0.0, s_per_kv_byte: 0.0,
  s_per_cta_byte: 0.0, s_per_sm_byte: 0.0, s_per_attn_wave: 0.0, s_per_attn_kernel: 0.0,
  s_per_split_partial: 0.0, s_per_kv_tile: 0.0, s_per_prefill_row: 0.0,
  s_per_first_seq: 0.0, sharpness: null, seq_knee: 0}}
fit: {{attention_split_rule: flash, attention_decode_placement: launch}}
source: synthetic
"""


@pytest.mark.parametrize("policy", ARRAY_CORE)
@pytest.mark.parametrize("qps,seq", [(2048, 0.0), (8192, 0.0), (1024, 2.0 ** -14)])
def test_arrivals_exactly_at_step_ends_as_the_replica_orders_them(tmp_path, policy, qps, seq):
    """Steps priced in whole powers of two and constant arrivals at a power-of-two rate:
    arrivals land exactly on step ends, and every mode computes the same floats. A request
    arriving at the very time a step ends is in the queue for the next step only if its
    arrival event came first (simpy: scheduling order), not when the request before it
    arrived during that step."""
    profile = tmp_path / "exact_prices.yaml"
    profile.write_text(_EXACT_PRICES.format(step=2.0 ** -10, seq=seq))
    over = [*TINY, f"policy={policy}", f"executor.profile={profile}", "workload.arrival=constant",
            f"workload.qps={qps}", "workload.num_requests=300"]
    s = _assert_same(over)
    assert s["step_engine"] == "array_core"


def test_a_request_whose_predecessor_arrived_during_the_step_waits_a_step():
    over = ("policy.max_num_seqs=256", "policy.max_num_batched_tokens=256")
    steps, _, _ = _rows_of("exact", [(0.0, 100, 20)], *over)
    end = steps[1][-1]  # step 1 (the prefill) ends when step 2 starts
    rows = [(0.0, 100, 20), (1e-4, 7, 5), (end, 37, 5)]
    core, exact = _rows_of("fast", rows, *over), _rows_of("exact", rows, *over)
    assert core[2] == "array_core" and core[0][:3] == exact[0][:3]
    assert [s[2] for s in core[0][:3]] == [100, 7, 37]  # request 2 gets the third step


@pytest.mark.parametrize("pool,policy,engine", [
    (44, "fcfs", "array_core"), (43, "fcfs", "array_core"),
    (44, "chunked_prefill", "array_core"), (43, "chunked_prefill", "array_core"),
    (43, "static", "array_core")])
def test_a_pool_just_large_enough_never_binds_one_block_less_can(pool, policy, engine):
    """Twelve requests of 100 + 60 tokens at once, four seats: the four hold 4 x 10 blocks
    at their last tokens (block 16). 44 blocks less the watermark's int(4.4) = 4 is exactly
    that: the pool never binds. With 43 (still 4 kept) it can: FCFS and chunked prefill
    stay on the core, which then counts blocks at admission and preempts as they do, and so
    does static batching, which admits on whole lengths. Each equals step-by-step
    simulation."""
    over = ["model=tiny", "workload.prompt_len.dist=uniform", "workload.prompt_len.min=100",
            "workload.prompt_len.max=100", "workload.output_len.dist=uniform",
            "workload.output_len.min=60", "workload.output_len.max=60",
            "workload.num_requests=12", "workload.qps=100000", "policy.max_num_seqs=4",
            "policy.kv_watermark=0.1", f"kv.num_gpu_blocks_override={pool}",
            f"policy={policy}"]
    sim = Simulation(compose_cfg(*over))
    assert sim.run().summary["step_engine"] == engine
    _assert_same(over)


def test_heap_rebuilds_and_dropped_step_times_change_nothing(monkeypatch):
    """The longest-context heap rebuilt at every chance and the step times trimmed as soon
    as they may be: the same outputs as step by step."""
    import sim.array_core as core

    monkeypatch.setattr(core, "_HEAP_PER_SEAT", 0)
    monkeypatch.setattr(core, "_HEAP_EXTRA", 1)
    monkeypatch.setattr(core, "_TIMES_KEPT", 3)
    for policy in ARRAY_CORE:
        chunk = ["policy.chunked_prefill_size=256"] if policy == "sglang" else []
        s = _assert_same([*TINY, *UNIFORM, f"policy={policy}", "workload.num_requests=120",
                          "workload.qps=80", "policy.max_num_seqs=16",
                          "policy.max_num_batched_tokens=256", *chunk])
        assert s["step_engine"] == "array_core"


def test_decreasing_arrivals_go_to_the_replica_loop():
    sim = Simulation(compose_cfg(*TINY))
    sim.workload = _ListWorkload([(1.0, 10, 5), (0.5, 10, 5)])
    res = sim.run()
    assert res.summary["step_engine"] == "replica" and "decrease" in sim.array_core_skipped


def test_ids_beyond_64_bits_go_to_the_replica_loop():
    sim = Simulation(compose_cfg(*TINY))

    class Big(_ListWorkload):
        def __iter__(self):
            for r in super().__iter__():
                r.request_id += 1 << 70
                yield r

    sim.workload = Big([(0.0, 10, 5), (0.5, 10, 5)])
    res = sim.run()
    assert res.summary["step_engine"] == "replica" and "64 bits" in sim.array_core_skipped
    assert res.summary["completed"] == 2
