"""Tensor and pipeline parallelism: the fitted communication model against Vidur's NCCL
measurements, the cost model's terms, and the pipelined replica's timeline."""

import numpy as np
import pandas as pd
import pytest
import simpy

import policies
from executors.cost_model import CostModelConfig, RooflineCostModel
from executors.network import load_network, ring_factor
from sim.cluster.pipeline import PipelinedReplica
from sim.kv_manager import KVBlockManager
from sim.memory import plan_memory
from sim.metrics import MetricsCollector
from sim.outputs import REQUEST_COLUMNS, STEP_COLUMNS, CsvSink
from sim.plan import ScheduledRequest, StepPlan
from sim.request import Request
from sim.specs import load_hardware_spec, load_model_spec
from tests.harness import RecordingExecutor
from tests.helpers import SHARED

NETWORK = SHARED / "profiles" / "vidur" / "network"


@pytest.mark.skipif(not NETWORK.is_dir(), reason="../shared/profiles/vidur/network is absent")
@pytest.mark.parametrize("box,hardware", [("a100_dgx", "a100_80gb"), ("h100_dgx", "h100_sxm")])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_all_reduce_model_within_20_percent_of_vidur_measurements(box, hardware, tp):
    from experiments.fit_network import binned_errors

    df = pd.read_csv(NETWORK / box / "all_reduce.csv")
    g = df[(df.num_workers == tp) & (df.devices_per_node == tp)]
    sizes = g["size"].to_numpy(float)  # bytes (see experiments/fit_network.py)
    measured = g["time_stats.all_reduce.median"].to_numpy() * 1e-3
    net = load_network(load_hardware_spec(hardware))
    rows = binned_errors(sizes, measured, lambda s: np.array([net.all_reduce(x, tp) for x in s]))
    assert len(rows) == 7  # below 1 MiB, then 1-2, 2-4, ... 32-64 MiB
    worst = max(abs(e) for *_, e in rows)
    assert worst <= 0.20, rows
    # And the model is not just flat: 64 MiB costs many times the small-message latency.
    assert net.all_reduce(64 * 2**20, tp) > 4 * net.all_reduce(4096, tp)


@pytest.mark.skipif(not NETWORK.is_dir(), reason="../shared/profiles/vidur/network is absent")
@pytest.mark.parametrize("box,hardware", [("a100_dgx", "a100_80gb"), ("h100_dgx", "h100_sxm")])
def test_send_recv_model_within_20_percent_of_vidur_measurements(box, hardware):
    from experiments.fit_network import binned_errors

    df = pd.read_csv(NETWORK / box / "send_recv.csv")
    g = df[(df.num_workers == 2) & (df.devices_per_node == 2)]
    net = load_network(load_hardware_spec(hardware))
    rows = binned_errors(g["size"].to_numpy(float),
                         g["time_stats.send_recv.median"].to_numpy() * 1e-3,
                         lambda s: np.array([net.send_recv(x) for x in s]))
    assert max(abs(e) for *_, e in rows) <= 0.20, rows


def test_cost_model_charges_two_fitted_all_reduces_per_layer():
    m, hw = load_model_spec("llama3_70b"), load_hardware_spec("h100_sxm")
    plan = StepPlan([ScheduledRequest(0, 0, 1024, list(range(64)), True)])
    cm = RooflineCostModel(m, hw, 4)
    msg = 1024 * m.hidden_size * 2
    expected = m.num_layers * 2 * (33.7e-6 + ring_factor(4) * msg / 441.8e9)
    assert cm.breakdown(plan).communication == pytest.approx(expected)
    # Without the fitted file: the hardware spec's interconnect.
    spec = RooflineCostModel(m, hw, 4, CostModelConfig(network="none")).breakdown(plan)
    assert spec.communication == pytest.approx(m.num_layers * 2 * (
        8e-6 + ring_factor(4) * msg / (450e9 * 0.8)))
    # A hardware without a network file (L40S) falls back as well.
    assert load_network(load_hardware_spec("l40s")).all_reduce_fits == {}


def test_pipeline_splits_weights_and_kv_and_adds_stage_sends():
    m, hw = load_model_spec("llama3_70b"), load_hardware_spec("h100_sxm")
    plan = StepPlan([ScheduledRequest(0, 0, 512, list(range(32)), True)])
    tp4 = RooflineCostModel(m, hw, 4)
    pp2 = RooflineCostModel(m, hw, 4, pipeline_parallel=2)
    b1, b2 = tp4.breakdown(plan), pp2.breakdown(plan)
    assert pp2.weight_bytes() < 0.55 * tp4.weight_bytes()
    assert b2.linear == pytest.approx(b1.linear)  # 80 layers either way, 40 per stage
    assert b2.pipeline == pytest.approx(7.7e-6 + 512 * m.hidden_size * 2 / 361.2e9)
    assert b1.pipeline == 0.0
    assert b2.total == pytest.approx(b1.total + b2.pipeline)
    # Memory planner: half the layers per GPU -> twice the KV tokens per block budget, and
    # the freed weight memory on top.
    a = plan_memory(m, hw, block_size=16, tensor_parallel=4,
                    weight_bytes_override=tp4.weight_bytes())
    b = plan_memory(m, hw, block_size=16, tensor_parallel=4, pipeline_parallel=2,
                    weight_bytes_override=pp2.weight_bytes())
    assert b.kv_bytes_per_token == a.kv_bytes_per_token / 2
    assert b.num_gpu_blocks > 2 * a.num_gpu_blocks


def _pipelined(requests, stages=2, step_time=2.0, **policy):
    env = simpy.Environment()
    ex = RecordingExecutor(step_time)
    ex.now = lambda: env.now
    pol = policies.make_policy({"name": "fcfs", "kv_watermark": 0.0, **policy})
    rep = PipelinedReplica(env, 0, pol, ex, KVBlockManager(32, 8), MetricsCollector(),
                           CsvSink(None, REQUEST_COLUMNS), CsvSink(None, STEP_COLUMNS),
                           pipeline_parallel=stages, max_model_len=1000, check_integrity=True)

    def arrivals():
        for r in requests:
            if r.arrival_time > env.now:
                yield env.timeout(r.arrival_time - env.now)
            rep.add_request(r)

    env.process(arrivals())
    env.run()
    return rep, ex


def test_two_stage_pipeline_keeps_two_micro_batches_in_flight():
    # Each batch takes 2 s through two 1 s stages. One 8-token prompt fits a step.
    a, b = Request(0, 0.0, 8, 3), Request(1, 0.0, 8, 3)
    rep, ex = _pipelined([a, b], max_num_batched_tokens=8)
    starts = [(s.time, s.rows) for s in ex.steps]
    assert starts[:4] == [
        (0.0, [(0, 0, 8, True)]),  # a's prefill: stage 0 over [0, 1], stage 1 over [1, 2]
        (1.0, [(1, 0, 8, True)]),  # b enters stage 0 as a moves on
        (2.0, [(0, 8, 1, True)]),  # a is out at 2 and decodes; b is still in flight
        (3.0, [(1, 8, 1, True)]),
    ]
    assert list(a.token_times) == [2.0, 4.0, 6.0]
    assert list(b.token_times) == [3.0, 5.0, 7.0]
    assert rep.num_steps == 6 and rep.kv.num_used_blocks == 0


def test_pipeline_never_schedules_a_request_twice_in_flight():
    # A single request cannot use the second slot: one token per full pipeline latency.
    r = Request(0, 0.0, 8, 4)
    _, ex = _pipelined([r], stages=4, step_time=4.0)
    assert [s.time for s in ex.steps] == [0.0, 4.0, 8.0, 12.0]
    assert list(r.token_times) == [4.0, 8.0, 12.0, 16.0]


def _chunked_pipeline(requests, **policy):
    return _pipelined(requests, name="chunked_prefill", max_num_batched_tokens=8,
                      max_num_seqs=4, **policy)


def test_chunked_prefill_admits_while_a_decode_is_in_flight():
    # a's decode is in flight over [2, 4]; b (two chunks' worth) arrives at 2.5 and starts
    # when stage 0 frees up at 3: a decode in flight is no prompt mid-prefill.
    a, b = Request(0, 0.0, 8, 3), Request(1, 2.5, 12, 2)
    _, ex = _chunked_pipeline([a, b])
    assert [(s.time, s.rows) for s in ex.steps][:5] == [
        (0.0, [(0, 0, 8, True)]),
        (2.0, [(0, 8, 1, True)]),
        (3.0, [(1, 0, 8, False)]),
        (4.0, [(0, 9, 1, True)]),
        (5.0, [(1, 8, 4, True)]),
    ]
    assert list(b.token_times) == [7.0, 9.0]


def test_chunked_prefill_counts_a_prompt_whose_chunk_in_flight_leaves_more():
    # a's first chunk (in flight over [0, 2]) leaves 8 tokens: at 1 a is still a prompt
    # mid-prefill, and max_num_partial_prefills=1 keeps b (longer than a step) waiting. a's
    # last chunk (in flight over [2, 4]) leaves none: at 3 b starts.
    a, b = Request(0, 0.0, 16, 2), Request(1, 0.5, 12, 2)
    _, ex = _chunked_pipeline([a, b])
    assert [(s.time, s.rows) for s in ex.steps][:5] == [
        (0.0, [(0, 0, 8, False)]),
        (2.0, [(0, 8, 8, True)]),
        (3.0, [(1, 0, 8, False)]),
        (4.0, [(0, 16, 1, True)]),
        (5.0, [(1, 8, 4, True)]),
    ]
    # With two allowed, b starts at 1 beside a's chunk in flight, and takes the whole step:
    # a prompt in flight wants none of its tokens.
    a, b = Request(0, 0.0, 16, 2), Request(1, 0.5, 12, 2)
    _, ex = _chunked_pipeline([a, b], max_num_partial_prefills=2)
    assert [(s.time, s.rows) for s in ex.steps][:2] == [
        (0.0, [(0, 0, 8, False)]),
        (1.0, [(1, 0, 8, False)]),
    ]


@pytest.mark.slow
def test_pipelined_simulation_runs_from_the_config(tmp_path):
    from experiments.simulation import run_simulation
    from tests.helpers import small_cfg

    s = run_simulation(small_cfg("model=llama3_70b", "hardware=h100_sxm",
                                 "cluster.tensor_parallel_size=2",
                                 "cluster.pipeline_parallel_size=2", "check_integrity=true"),
                       tmp_path).summary
    assert s["completed"] == 60 and s["pipeline_parallel_size"] == 2 and s["num_gpus"] == 4
