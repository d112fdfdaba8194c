"""A replica with pipeline stages on the array core (sim/array_pipeline.py) must give what
step-by-step simulation gives, and what the replica loop's pipelined replica gives, and run
only where it applies."""

import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from tests.helpers import compose_cfg
from tests.test_array_core import TINY, UNIFORM, same_or_given_up
from tests.test_cluster_fast_exact import assert_fast_equals_exact
from tests.test_fast_forward import _assert_same

pytestmark = pytest.mark.equivalence


@settings(max_examples=18, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(1.0, 400.0), seqs=st.integers(1, 40),
       budget=st.integers(200, 2000), stages=st.integers(2, 4), out_min=st.integers(1, 3),
       prompt_min=st.sampled_from([1, 50]), block=st.sampled_from([1, 16]),
       arrival=st.sampled_from(["poisson", "poisson", "constant", "gamma"]),
       policy=st.sampled_from([
           ("policy=fcfs",), ("policy=fcfs",), ("policy=sjf",),
           ("policy=sjf", "policy.predictor=noisy", "policy.aging_s=0.02"),
           ("policy=priority", "policy.preemptive=false", "workload.priorities=[1,2,1]"),
           ("policy=chunked_prefill",),
           ("policy=chunked_prefill", "policy.max_num_batched_tokens=48",
            "policy.max_num_partial_prefills=2"),
           ("policy=trtllm",),
           ("policy=trtllm", "policy.capacity_scheduler_policy=max_utilization"),
           ("policy=trtllm", "policy.enable_chunked_prefill=true"),
           ("policy=vllm_v1",), ("policy=static",)]),
       pool=st.one_of(st.none(), st.none(), st.integers(330, 4000)))
# Every request arrives at 0.0, where simpy's clock is the int 0.
@example(seed=3, qps=1e9, seqs=8, budget=400, stages=2, out_min=1, prompt_min=1, block=16,
         arrival="constant", policy=("policy=fcfs",), pool=None)
def test_pipelined_core_equals_exact_on_random_small_workloads(seed, qps, seqs, budget,
                                                               stages, out_min, prompt_min,
                                                               block, arrival, policy, pool):
    """Micro-batches in flight in a flow shop of ``stages``: prefill-only batches of the
    prompts the policy admits (seats counting requests in flight; FCFS's queue, or SJF's and
    priority's own order, aging included), else the decoding requests not in flight, whose
    groups merge as they leave (finishers in the policy's running order); under chunked
    prefill, those decodes with the prompts one token from done and chunks of the prompts
    mid-prefill and admitted (prompts in flight counting among the partial prefills);
    TensorRT-LLM's steps without chunked prefill (each request holding its whole length
    from admission under guaranteed_no_evict); vLLM v1's (the running requests in arrival
    order, prompts taking blocks chunk by chunk); static batches (whole lengths held, a
    batch formed while the last has ended); one-token outputs finishing with their prompt; constant and bursty arrivals (an arrival
    as a batch leaves or stage 0 frees). ``pool``: a pool of that many tokens, which can bind:
    admission counts blocks above the watermark, and the run is given up to the replica
    loop where a decode micro-batch's blocks do not fit."""
    # (The tiny model has two layers: more stages take a model with more.)
    model = TINY if stages == 2 else ("model=llama3_8b", *TINY[1:])
    over = [*model, *UNIFORM, policy[0], f"seed={seed}", f"workload.qps={qps}",
            f"workload.arrival={arrival}", "workload.cv=3.0", "workload.num_requests=60",
            f"policy.max_num_seqs={seqs}", f"policy.max_num_batched_tokens={budget}",
            f"kv.block_size={block}", f"cluster.pipeline_parallel_size={stages}",
            f"workload.prompt_len.min={prompt_min}", f"workload.output_len.min={out_min}",
            *policy[1:]]  # (a policy's own budget comes last)
    if pool is not None:
        over.append(f"kv.num_gpu_blocks_override={-(-pool // block)}")
    # (A policy that grants in arrival order may meet a prompt mid-prefill before a decode.)
    in_order = policy[0] in ("policy=vllm_v1", "policy=trtllm")
    same_or_given_up(over, pool is not None or in_order,
                     ("does not fit its KV pool", "alone fills the pool", "arrived after it"))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(2.0, 600.0), seqs=st.integers(1, 24),
       replicas=st.integers(2, 3), out_min=st.integers(1, 3), block=st.sampled_from([1, 16]),
       router=st.sampled_from(["round_robin", "random", "least_outstanding", "least_kv",
                               "power_of_two"]),
       policy=st.sampled_from([("policy=fcfs",), ("policy=sjf", "policy.predictor=noisy"),
                               ("policy=priority", "policy.preemptive=false",
                                "workload.priorities=[1,2,1]"),
                               ("policy=chunked_prefill", "policy.max_num_batched_tokens=64",
                                "policy.max_num_partial_prefills=2"),
                               ("policy=vllm_v1", "policy.max_num_batched_tokens=64"),
                               ("policy=trtllm",)]),
       pool=st.one_of(st.none(), st.integers(400, 3000)))
def test_pipelined_replicas_behind_a_router_equal_exact(seed, qps, seqs, replicas, out_min,
                                                        block, router, policy, pool):
    """Several pipelined replicas behind a router that reads outstanding counts (finishes
    come as batches leave) and KV usage (blocks taken as each micro-batch is planned):
    each replica pauses before every arrival not yet routed. ``pool``: tokens of a pool
    that can bind (given up where a decode micro-batch's blocks do not fit)."""
    over = [*TINY, *UNIFORM, *policy, f"seed={seed}", f"workload.qps={qps}",
            "workload.num_requests=60", f"policy.max_num_seqs={seqs}", f"kv.block_size={block}",
            "cluster.pipeline_parallel_size=2", f"cluster.num_replicas={replicas}",
            f"cluster.router={router}", f"workload.output_len.min={out_min}"]
    if pool is not None:
        over.append(f"kv.num_gpu_blocks_override={-(-pool // block)}")
    s = assert_fast_equals_exact(over)
    skipped = s["array_core_skipped"]
    assert s["step_engine"] == "array_core" or (
        pool is not None and ("does not fit its KV pool" in skipped
                              or "alone fills the pool" in skipped)) or (
        policy[0] in ("policy=vllm_v1", "policy=trtllm") and "arrived after it" in skipped
    ), skipped


def test_pipelined_core_admits_by_blocks_on_a_pool_that_can_bind():
    """A pool of 188 blocks that a waiting prompt does not fit at times (peak usage 0.995),
    though no decode micro-batch ever finds its blocks missing: admission counts blocks
    above the watermark, as FCFS's does, and the whole run stays on the core."""
    s = _assert_same([*TINY, *UNIFORM, "policy=fcfs", "seed=4", "workload.qps=400",
                      "workload.num_requests=60", "policy.max_num_seqs=24",
                      "workload.prompt_len.min=50", "workload.output_len.min=1",
                      "cluster.pipeline_parallel_size=2", "kv.num_gpu_blocks_override=188"])
    assert s["step_engine"] == "array_core" and s["num_preemptions"] == 0


def test_chunked_prefill_counts_prompts_in_flight_among_its_partial_prefills():
    """``chunk_plan``'s ``in_flight_partials``: a prompt in flight that stays mid-prefill
    takes the one partial prefill allowed, so a prompt longer than the step waits; one that
    fits whole starts anyway."""
    from policies import make_policy

    policy = make_policy({"name": "chunked_prefill", "max_num_batched_tokens": 64,
                          "max_num_seqs": 8})
    assert policy.chunk_plan(2, [], [100], 1, 8) == ([], [62])
    assert policy.chunk_plan(2, [], [100], 1, 8, in_flight_partials=1) == ([], [])
    assert policy.chunk_plan(2, [], [30, 100], 2, 8, in_flight_partials=1) == ([], [30])


def test_chunked_pipelines_run_on_the_core():
    """Chunked prefill on three stages, prompts up to four steps long and two partial
    prefills: the micro-batches of step-by-step simulation, on the core."""
    s = _assert_same(["model=llama3_8b", *TINY[1:], *UNIFORM, "policy=chunked_prefill",
                      "seed=7", "workload.qps=200", "workload.num_requests=80",
                      "policy.max_num_seqs=12", "policy.max_num_batched_tokens=48",
                      "policy.max_num_partial_prefills=2", "workload.output_len.min=1",
                      "cluster.pipeline_parallel_size=3"])
    assert s["step_engine"] == "array_core"
    # Prompts of 1 to 12 tokens in steps of 8 with outputs of 1 to 3: one-token prompts,
    # prompts left one token from done (decode rows), and both finishing with their first
    # token among the decodes that finish (in arrival order).
    s = _assert_same([*TINY, *UNIFORM, "policy=chunked_prefill", "seed=16", "workload.qps=500",
                      "workload.num_requests=200", "workload.prompt_len.min=1",
                      "workload.prompt_len.max=12", "workload.output_len.min=1",
                      "workload.output_len.max=3", "policy.max_num_seqs=4",
                      "policy.max_num_batched_tokens=8", "policy.max_num_partial_prefills=3",
                      "cluster.pipeline_parallel_size=2"])
    assert s["step_engine"] == "array_core"


def test_trtllm_pipelines_hold_whole_lengths_on_the_core():
    """TensorRT-LLM without chunked prefill on two stages: each micro-batch is the decodes
    not in flight and the whole prompts it admits. Under guaranteed_no_evict on a pool that
    binds, a request is admitted only where the pool holds its whole length, which it holds
    until it finishes (no decode takes a block); under max_utilization on one that never
    binds, prompts take their blocks and decodes grow them."""
    over = [*TINY, *UNIFORM, "policy=trtllm", "seed=5", "workload.qps=300",
            "workload.num_requests=80", "policy.max_num_seqs=16",
            "policy.max_num_batched_tokens=400", "cluster.pipeline_parallel_size=2"]
    s = _assert_same([*over, "kv.num_gpu_blocks_override=40"])
    assert s["step_engine"] == "array_core" and s["kv_peak_usage"] > 0.9
    s = _assert_same([*over, "policy.capacity_scheduler_policy=max_utilization"])
    assert s["step_engine"] == "array_core"


def test_static_batches_pipeline_on_whole_lengths():
    """Static batching on two stages, batches of 14 on a pool that binds (peak usage over
    0.9): a batch is formed, maybe over several micro-batches, only once the last has ended,
    each request admitted only where the pool holds its whole length."""
    s = _assert_same([*TINY[:3], *UNIFORM, "policy=static", "seed=801", "workload.qps=109.97",
                      "workload.num_requests=54", "workload.prompt_len.min=50",
                      "policy.max_num_batched_tokens=1376", "policy.max_num_seqs=34",
                      "policy.max_batch_size=14", "kv.block_size=1",
                      "kv.num_gpu_blocks_override=1418", "cluster.pipeline_parallel_size=2"])
    assert s["step_engine"] == "array_core" and s["kv_peak_usage"] > 0.9


def test_vllm_v1_pipelines_leave_grants_out_of_order_to_the_replica_loop():
    """vLLM v1 on four stages: two micro-batches leave the pipeline while stage 0 is busy,
    and a prompt mid-prefill comes free with decodes that arrived after it. Its chunk comes
    first in arrival order, which the core's decode groups do not keep: the run is the
    replica loop's."""
    over = ["model=llama3_8b", *TINY[1:], *UNIFORM, "policy=vllm_v1",
            "model.max_model_len=4096", "seed=8481", "workload.num_requests=104",
            "workload.qps=192.545", "workload.arrival=gamma", "workload.cv=3.0",
            "workload.prompt_len.min=50", "workload.prompt_len.max=600",
            "workload.output_len.min=1", "workload.output_len.max=10",
            "policy.max_num_batched_tokens=613", "policy.max_num_seqs=19",
            "cluster.pipeline_parallel_size=4"]
    s = _assert_same(over)
    sim = Simulation(compose_cfg(*over))
    assert sim.run().summary["step_engine"] == "replica" == s["step_engine"]
    assert "mid-prefill before a decode that arrived after it" in sim.array_core_skipped


def test_vllm_v1_pipelines_take_blocks_chunk_by_chunk():
    """vLLM v1 on two stages, prompts longer than the budget: each chunk takes its own
    tokens' blocks (the pool's peak and every step's blocks in use), and a pool too small
    for the running requests' chunks is given up to the replica loop."""
    over = [*TINY, *UNIFORM, "policy=vllm_v1", "seed=2", "workload.qps=200",
            "workload.num_requests=60", "workload.prompt_len.min=100",
            "policy.max_num_batched_tokens=64", "policy.max_num_seqs=8",
            "cluster.pipeline_parallel_size=2"]
    s = _assert_same(over)
    assert s["step_engine"] == "array_core"
    same_or_given_up([*over, "kv.num_gpu_blocks_override=30"], True)


def _files(overrides: list[str], tmp_path, name: str) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    out = tmp_path / name
    summary = Simulation(compose_cfg(*overrides), out).run().summary
    return summary, pd.read_csv(out / "requests.csv"), pd.read_csv(out / "steps.csv")


@pytest.mark.parametrize("layout", [["cluster.pipeline_parallel_size=3"],
                                    ["cluster.pipeline_parallel_size=2", "cluster.num_replicas=2",
                                     "cluster.router=least_kv"]])
def test_pipelined_core_writes_the_replica_loops_files(tmp_path, layout):
    """requests.csv (the cluster columns; its row order on one replica), steps.csv and the
    summary's figures (each replica's requests routed, busy fraction, peak KV usage, steps)
    are the replica loop's."""
    over = ["model=llama3_8b", *TINY[1:], "policy=fcfs", "workload.num_requests=300",
            "workload.qps=40", "policy.max_num_seqs=24", *layout]
    core, rc, sc = _files([*over, "array_core=true"], tmp_path, "core")
    loop, rl, sl = _files([*over, "array_core=false"], tmp_path, "loop")
    assert core["step_engine"] == "array_core" and loop["step_engine"] == "replica"
    if len(core["replicas"]) > 1:  # (replicas' rows interleave in another order)
        rc, rl = (r.sort_values("request_id", ignore_index=True) for r in (rc, rl))
        sc, sl = (r.sort_values(["replica_id", "step"], ignore_index=True) for r in (sc, sl))
    pd.testing.assert_frame_equal(rc, rl, rtol=1e-9)
    pd.testing.assert_frame_equal(sc, sl, rtol=1e-9)
    skip = {"step_engine", "wall_time_s", "num_decode_jumps"}
    for key, value in loop.items():
        if key in skip:
            continue
        if isinstance(value, float):
            assert core[key] == pytest.approx(value, rel=1e-9), key
        elif key == "replicas":
            for a, b in zip(core[key], value):
                assert a.keys() == b.keys()
                for k, v in b.items():
                    assert a[k] == (pytest.approx(v, rel=1e-9) if isinstance(v, float)
                                    else v), k
        else:
            assert core[key] == value, key


@pytest.mark.parametrize("overrides,reason", [
    (("policy=sjf", "policy.preemptive=true"), "may preempt a running request to admit"),
    (("policy=vllm_v1", "policy.scheduling_policy=priority"),
     "with a waiting queue in priority order"),
    (("policy=sglang",), "pipeline stages under policy 'sglang'"),
    (("cluster.num_replicas=2", "cluster.router=prefix_aware"),
     "router 'prefix_aware' reads more than outstanding request counts and KV usage"),
    (("kv.num_gpu_blocks_override=100", "workload.qps=200"),
     "replica 0's decode micro-batch at "),
    (("kv.num_gpu_blocks_override=19",), "with pipeline stages and a request that alone fills"),
])
def test_pipelines_it_cannot_take_go_to_the_replica_loop(overrides, reason):
    sim = Simulation(compose_cfg(*TINY, "workload.num_requests=30",
                                 "cluster.pipeline_parallel_size=2", *overrides))
    s = sim.run().summary
    assert s["step_engine"] == "replica" and reason in sim.array_core_skipped
    assert s["completed"] + s["rejected"] == 30
