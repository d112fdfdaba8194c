"""Cluster runs through the composed Hydra config: outputs, determinism, validation."""

import json

import pandas as pd
import pytest

from experiments.simulation import Simulation, run_simulation
from sim.cluster.outputs import CLUSTER_REQUEST_COLUMNS
from sim.errors import ConfigError
from sim.outputs import REQUEST_COLUMNS
from sim.report import format_summary
from tests.helpers import small_cfg

CLUSTER_KEYS = ("cluster", "num_replicas", "num_gpus", "router", "replicas")
DISAGG_KEYS = ("num_kv_transfers", "kv_backpressure_count", "mean_kv_transfer_time_ms",
               "p99_kv_transfer_time_ms", "link_utilization", "mean_kv_backpressure_wait_ms")


def test_default_single_replica_writes_only_the_core_columns_and_keys(tmp_path):
    s = run_simulation(small_cfg(), tmp_path).summary
    assert tuple(pd.read_csv(tmp_path / "requests.csv").columns) == REQUEST_COLUMNS
    assert not set(CLUSTER_KEYS) & set(s)


@pytest.mark.parametrize("core", ["true", "false"])  # the array core, or the replica loop
def test_four_replicas_route_every_request_once_and_report_per_replica_counts(tmp_path, core):
    cfg = small_cfg("cluster.num_replicas=4", "cluster.router=power_of_two",
                    "workload.num_requests=200", "workload.qps=40", f"array_core={core}")
    res = run_simulation(cfg, tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["step_engine"] == ("array_core" if core == "true" else "replica")
    assert s["completed"] == 200 and s["num_replicas"] == 4 and s["num_gpus"] == 4
    assert sum(r["routed"] for r in s["replicas"]) == 200
    reqs = pd.read_csv(tmp_path / "requests.csv")
    assert tuple(reqs.columns) == REQUEST_COLUMNS + CLUSTER_REQUEST_COLUMNS
    assert sorted(reqs.request_id) == list(range(200))
    counts = reqs.replica_id.value_counts().sort_index().tolist()
    assert counts == [r["routed"] for r in s["replicas"]]
    assert (reqs.prefill_replica_id == reqs.replica_id).all()
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert sorted(steps.replica_id.unique()) == [0, 1, 2, 3]
    assert steps.groupby("replica_id").size().tolist() == [r["num_steps"] for r in s["replicas"]]
    # (The array core hands out no block ids: no replica objects to look into.)
    assert len(res.replicas) == (0 if core == "true" else 4)
    assert all(r.kv.num_used_blocks == 0 for r in res.replicas)


def test_random_router_is_deterministic_under_the_seed(tmp_path):
    args = ("cluster.num_replicas=3", "cluster.router=random")
    run_simulation(small_cfg(*args), tmp_path / "a")
    run_simulation(small_cfg(*args), tmp_path / "b")
    run_simulation(small_cfg(*args, "seed=5"), tmp_path / "c")
    a = (tmp_path / "a" / "requests.csv").read_text()
    assert a == (tmp_path / "b" / "requests.csv").read_text()
    assert a != (tmp_path / "c" / "requests.csv").read_text()


@pytest.mark.slow
def test_disaggregated_run_conserves_requests_and_reports_the_link(tmp_path):
    cfg = small_cfg("cluster=disaggregated", "cluster.num_prefill_replicas=2",
                    "cluster.num_decode_replicas=2", "cluster.link.preset=ethernet",
                    "+cluster.decode.policy.max_num_seqs=64", "check_integrity=true",
                    "kv.num_gpu_blocks_override=1500",
                    "workload.num_requests=120")
    res = run_simulation(cfg, tmp_path, keep_requests=True)
    s = json.loads((tmp_path / "summary.json").read_text())
    for k in CLUSTER_KEYS + DISAGG_KEYS:
        assert k in s, k
    assert s["completed"] == 120 and s["num_gpus"] == 4 and s["link"] == "ethernet"
    reqs = pd.read_csv(tmp_path / "requests.csv")
    assert sorted(reqs.request_id) == list(range(120))
    multi = reqs[reqs.output_len > 1]
    assert multi.decode_replica_id.isin([2, 3]).all()
    assert (multi.replica_id == multi.decode_replica_id).all()
    assert multi.prefill_replica_id.isin([0, 1]).all()
    assert (multi.kv_transfer_time > 0).all()
    assert s["num_kv_transfers"] == len(multi)
    # Bytes: whole blocks of the prompt, 128 KiB per token for Llama-3-8B fp16.
    blocks = -(-multi.prompt_len // 16)
    assert (multi.kv_transfer_bytes == blocks * 16 * 131_072).all()
    assert s["mean_kv_transfer_time_ms"] == pytest.approx(multi.kv_transfer_time.mean() * 1e3)
    roles = [r["role"] for r in s["replicas"]]
    assert roles == ["prefill", "prefill", "decode", "decode"]
    assert 0 < s["link_utilization"] < 1
    assert all(r.kv.num_used_blocks == 0 for r in res.replicas)


def test_disaggregated_pools_take_their_own_hardware_tp_and_policy():
    cfg = small_cfg("model=llama3_70b", "hardware=h100_sxm", "cluster=disaggregated",
                    "cluster.tensor_parallel_size=4", "cluster.decode.hardware=h200",
                    "cluster.decode.tensor_parallel_size=2",
                    "+cluster.decode.policy.max_num_seqs=32")
    sim = Simulation(cfg)
    pre, dec = sim.pools
    assert (pre.hardware.name, pre.tensor_parallel) == ("h100_sxm", 4)
    assert (dec.hardware.name, dec.tensor_parallel) == ("h200", 2)
    assert dec.first_policy.config.max_num_seqs == 32
    assert pre.first_policy.config.max_num_seqs == 256
    s = sim.run().summary
    assert s["completed"] == 60 and s["num_gpus"] == 6
    # The printed summary names each pool (the head line names the first pool's hardware).
    text = format_summary(s)
    blocks = [r["kv_num_gpu_blocks"] for r in s["replicas"]]
    assert "KV: 16-token blocks (per pool below), peak usage" in text
    assert text.splitlines()[-1] == (f"  pools: 1 prefill on h100_sxm (TP4, {blocks[0]} KV "
                                     f"blocks), 1 decode on h200 (TP2, {blocks[1]} KV blocks)")
    one = format_summary(Simulation(small_cfg("cluster.num_replicas=2")).run().summary)
    assert "pools:" not in one and "KV: " in one.splitlines()[-1]


@pytest.mark.parametrize("overrides,field", [
    (("cluster.num_replicas=0",), "cluster.num_replicas"),
    (("cluster.router=nearest",), "cluster.router"),
    (("cluster.pipeline_parallel_size=0",), "cluster.pipeline_parallel_size"),
    (("+cluster.racks=2",), "cluster.racks"),
    (("cluster=disaggregated", "cluster.num_decode_replicas=0"), "cluster.num_decode_replicas"),
    (("cluster=disaggregated", "cluster.decode_router=x"), "cluster.decode_router"),
    (("cluster=disaggregated", "cluster.link.preset=wifi"), "cluster.link.preset"),
    (("cluster=disaggregated", "+cluster.prefill.policy.max_num_seqs=0"),
     "cluster.prefill.policy.max_num_seqs"),
    (("cluster=disaggregated", "cluster.decode.tensor_parallel_size=0"),
     "cluster.decode.tensor_parallel_size"),
    (("cluster=disaggregated", "cluster.decode.hardware=tpu"), "cluster.decode.hardware"),
])
def test_bad_cluster_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg(*overrides))
    assert e.value.field == field


def test_replicas_draw_their_own_noisy_predictions():
    """Each replica's policy has its own seed: replica 0 keeps the run's seed (a single replica
    draws what it always drew), the others get independent streams, so the k-th request a
    replica receives is not mispredicted by the same factor on every replica."""
    from sim.cluster.pool import replica_seed

    assert replica_seed(7, 0) == 7
    assert len({replica_seed(7, r) for r in range(1, 5)} | {7}) == 5
    res = Simulation(small_cfg("policy=sjf", "policy.predictor=noisy", "cluster.num_replicas=2",
                               "workload.num_requests=40", "seed=7"), keep_requests=True).run()
    assert [r.policy.seed for r in res.replicas] == [7, replica_seed(7, 1)]
    by_replica: dict[int, list[float]] = {0: [], 1: []}
    for req in sorted(res.requests, key=lambda r: r.arrival_time):
        by_replica[req.replica_id].append(req.extra["predicted_output_len"] / req.max_output_len)
    n = min(len(by_replica[0]), len(by_replica[1]))
    assert n >= 10 and by_replica[0][:n] != by_replica[1][:n]
    # Replica 0 of two draws exactly what a single replica draws for its first request.
    single = Simulation(small_cfg("policy=sjf", "policy.predictor=noisy",
                                  "workload.num_requests=1", "seed=7"), keep_requests=True).run()
    assert by_replica[0][0] == (single.requests[0].extra["predicted_output_len"]
                                / single.requests[0].max_output_len)
