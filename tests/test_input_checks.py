"""Input checks on values that would otherwise pass silently:

* tensor parallelism the model's heads cannot be split over (vLLM's rule), which the KV sizing
  floored to ``max(1, kv_heads // tp)``;
* a KV block size that is not a power of two from 1 to 256;
* trace times mixing naive and zone-aware dates (or numbers and dates), and negative times.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.simulation import KVConfig, Simulation
from sim.errors import ConfigError
from sim.memory import plan_memory
from sim.specs import known_models, load_hardware_spec, load_model_spec
from tests.helpers import small_cfg
from workloads import make_workload
from workloads.trace import TraceFormatError

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


# ---- 1. tensor parallelism vs the model's heads ----------------------------------------------

@pytest.mark.parametrize("overrides,field,numbers", [
    # 32 query heads do not split over 3 ranks.
    (("cluster.tensor_parallel_size=3",), "cluster.tensor_parallel_size", ("3", "num_heads=32")),
    # 28 query heads split over 7 or 14 ranks, but 4 KV heads neither split nor replicate evenly.
    (("model=qwen25_7b", "cluster.tensor_parallel_size=7"), "cluster.tensor_parallel_size",
     ("7", "num_kv_heads=4")),
    (("model=qwen25_7b", "cluster.tensor_parallel_size=14"), "cluster.tensor_parallel_size",
     ("14", "num_kv_heads=4")),
    (("model=tiny", "cluster.tensor_parallel_size=3"), "cluster.tensor_parallel_size",
     ("3", "num_heads=4")),
    (("model=qwen25_7b", "cluster=disaggregated", "cluster.decode.tensor_parallel_size=7"),
     "cluster.decode.tensor_parallel_size", ("7", "num_kv_heads=4")),
    (("model=qwen25_7b", "cluster=disaggregated", "cluster.prefill.tensor_parallel_size=7"),
     "cluster.prefill.tensor_parallel_size", ("7", "num_kv_heads=4")),
    # The shared default is named where a pool inherits it.
    (("cluster=disaggregated", "cluster.tensor_parallel_size=6"), "cluster.tensor_parallel_size",
     ("6", "num_heads=32")),
])
def test_tensor_parallel_the_heads_cannot_split_over_is_refused(overrides, field, numbers):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg(*overrides))
    assert e.value.field == field
    for n in numbers:
        assert n in str(e.value)


def test_shared_tensor_parallel_that_no_pool_uses_is_not_checked():
    # Both pools set their own TP, so the shared default of 6 sizes nothing.
    sim = Simulation(small_cfg("model=llama3_70b", "hardware=h100_sxm", "cluster=disaggregated",
                               "cluster.tensor_parallel_size=6",
                               "cluster.prefill.tensor_parallel_size=4",
                               "cluster.decode.tensor_parallel_size=8"))
    assert [p.tensor_parallel for p in sim.pools] == [4, 8]


@pytest.mark.parametrize("overrides,field", [
    (("cluster.tensor_parallel_size=1",), "cluster.tensor_parallel_size"),
    (("cluster=disaggregated", "cluster.tensor_parallel_size=4",
      "cluster.decode.tensor_parallel_size=1"),
     "cluster.decode.tensor_parallel_size"),
    (("cluster=disaggregated", "cluster.tensor_parallel_size=1",
      "cluster.decode.tensor_parallel_size=4"),
     "cluster.tensor_parallel_size"),  # the prefill pool inherits the shared TP that does not fit
])
def test_a_pool_too_big_for_its_gpus_names_the_field_that_set_its_parallelism(overrides, field):
    # Llama-3-70B's ~141 GB of weights do not fit one 80 GB GPU.
    with pytest.raises(ConfigError, match="does not fit") as e:
        Simulation(small_cfg("model=llama3_70b", "hardware=h100_sxm", *overrides))
    assert e.value.field == field


def test_replicated_kv_heads_hold_one_head_per_rank():
    m = load_model_spec("llama3_8b")  # 32 query heads, 8 KV heads, head_dim 128, fp16 KV
    assert [m.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    one_head = 2 * 32 * 1 * 128 * 2  # K and V, 32 layers, 1 head, 128 dims, 2 bytes
    assert m.kv_bytes_per_token_per_rank(8) == m.kv_bytes_per_token_per_rank(16) == one_head
    assert m.kv_bytes_per_token_per_rank(32, pipeline_parallel=2) == one_head / 2
    # The memory planner sizes blocks from the same per-rank bytes.
    plan = plan_memory(m, load_hardware_spec("h100_sxm"), block_size=16, tensor_parallel=16)
    assert plan.kv_bytes_per_token == one_head and plan.kv_bytes_per_block == 16 * one_head
    # And the whole run builds at TP=16 (each rank holds one of the 8 KV heads, twice over).
    sim = Simulation(small_cfg("cluster.tensor_parallel_size=16"))
    assert sim.memory.kv_bytes_per_token == one_head


def test_per_rank_kv_bytes_refuse_rather_than_floor():
    qwen = load_model_spec("qwen25_7b")  # 28 heads, 4 KV heads
    with pytest.raises(ConfigError, match=r"cluster\.tensor_parallel_size: 7 .*num_kv_heads=4"):
        qwen.kv_bytes_per_token_per_rank(7)
    with pytest.raises(ConfigError, match=r"cluster\.tensor_parallel_size: 3 .*num_heads=64"):
        plan_memory(load_model_spec("llama3_70b"), load_hardware_spec("h100_sxm"),
                    block_size=16, tensor_parallel=3)


def test_valid_tensor_parallel_keeps_the_old_per_rank_bytes():
    """Golden check: every shipped model at every TP the rule accepts (up to 64) stores what
    the old ``max(1, kv_heads // tp)`` sizing gave."""
    checked = 0
    for name in known_models():
        m = load_model_spec(name)
        for tp in range(1, 65):
            if m.num_heads % tp or (m.num_kv_heads % tp and tp % m.num_kv_heads):
                continue
            for pp in (1, 2, 3):
                old = (2 * -(-m.num_layers // pp) * max(1, m.num_kv_heads // tp) * m.head_dim
                       * m.kv_bytes_per_element)
                assert m.kv_bytes_per_token_per_rank(tp, pp) == old, (name, tp, pp)
                checked += 1
    assert checked >= 8 * 3 * 4  # every model has at least TP 1, 2, 4 (tiny: 4 heads)


@pytest.mark.parametrize("heads,kv_heads,accepted,refused", [
    # Llama-3-8B (GQA 32/8): split 1..8 KV heads, replicate beyond; 3, 5, 6, 64 refused.
    (32, 8, (1, 2, 4, 8, 16, 32), (3, 5, 6, 12, 64)),
    # Qwen2.5-7B (28/4): TP 7 and 14 divide the query heads but neither divide nor are a
    # multiple of the 4 KV heads; 28 replicates each KV head on 7 ranks.
    (28, 4, (1, 2, 4, 28), (3, 7, 8, 14)),
    # Multi-query (one KV head, replicated on every rank): any TP dividing the 32 heads.
    (32, 1, (1, 2, 4, 8, 16, 32), (3, 64)),
    # Multi-head attention (64/64).
    (64, 64, (1, 2, 8, 32, 64), (3, 48, 128)),
])
def test_tensor_parallel_cases_vllm_accepts_and_refuses(heads, kv_heads, accepted, refused):
    m = dataclasses.replace(load_model_spec("tiny"), num_heads=heads, num_kv_heads=kv_heads)
    for tp in accepted:
        m.check_tensor_parallel(tp)
    for tp in refused:
        with pytest.raises(ConfigError, match="cluster.tensor_parallel_size"):
            m.check_tensor_parallel(tp)


@given(heads_per_kv=st.integers(1, 8), kv_heads=st.integers(1, 16), tp=st.integers(1, 64))
def test_tensor_parallel_rule_matches_vllm(heads_per_kv, kv_heads, tp):
    base = load_model_spec("tiny")
    m = dataclasses.replace(base, num_heads=heads_per_kv * kv_heads, num_kv_heads=kv_heads)
    vllm_ok = m.num_heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)
    if not vllm_ok:
        with pytest.raises(ConfigError) as e:
            m.check_tensor_parallel(tp, "cluster.decode.tensor_parallel_size")
        assert e.value.field == "cluster.decode.tensor_parallel_size" and f"{tp} " in str(e.value)
        return
    per_rank = m.kv_heads_per_rank(tp)
    if tp <= kv_heads:
        assert per_rank * tp == kv_heads  # split evenly, nothing replicated
    else:
        assert per_rank == 1 and tp % kv_heads == 0  # each head on tp / kv_heads ranks


# ---- 2. KV block size -------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, -16, 3, 7, 12, 24, 48, 100, 512, 1024])
def test_block_size_not_a_power_of_two_up_to_256_is_refused(size):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg(f"kv.block_size={size}"))
    assert e.value.field == "kv.block_size"
    assert str(e.value).startswith("kv.block_size: must be a power of two from 1 to 256")
    assert str(e.value).endswith(f"got {size}")


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_power_of_two_block_sizes_are_accepted(size):
    assert KVConfig(block_size=size).block_size == size


@pytest.mark.parametrize("size", [1, 256])
def test_extreme_block_sizes_plan_and_run(size):
    sim = Simulation(small_cfg(f"kv.block_size={size}", "workload.num_requests=10"))
    assert sim.memory.block_size == size
    s = sim.run().summary
    assert s["completed"] == 10 and s["kv_block_size"] == size


# ---- 3. trace timestamps -------------------------------------------------------------------

def _trace(tmp_path, text: str, name: str = "t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return make_workload({"name": "trace", "path": str(p)}, seed=0), p


@pytest.mark.parametrize("rows,match", [
    (["2023-11-16 18:00:00", "2023-11-16 18:00:01+00:00"],
     (r":3: TIMESTAMP '2023-11-16 18:00:01\+00:00' is a date with UTC offset, but line 2's "
     r"'2023-11-16 18:00:00' is a date without UTC offset")),
    (["2023-11-16T18:00:00Z", "2023-11-16T18:00:01Z", "2023-11-16T18:00:02"],
     (r":4: TIMESTAMP '2023-11-16T18:00:02' is a date without UTC offset, but line 2's "
     r"'2023-11-16T18:00:00Z' is a date with UTC offset")),
    (["0.5", "2023-11-16 18:00:01"], (r":3: TIMESTAMP '2023-11-16 18:00:01' is a date without "
                                     r"UTC offset, but line 2's '0.5' is a number")),
    (["2023-11-16 18:00:00", "12"], r":3: TIMESTAMP '12' is a number, but line 2's"),
])
def test_trace_mixing_kinds_of_time_names_file_and_line(tmp_path, rows, match):
    text = HEADER + "".join(f"{t},10,5\n" for t in rows)
    with pytest.raises(TraceFormatError, match=match) as e:
        _trace(tmp_path, text)
    assert e.value.field == "workload.path" and str(e.value).startswith(
        f"workload.path: {tmp_path / 't.csv'}:")


def test_dates_with_different_offsets_are_one_time_axis(tmp_path):
    w, _ = _trace(tmp_path, HEADER + "2023-11-16T18:00:00+00:00,10,5\n"
                                     "2023-11-16T19:00:02+01:00,10,5\n"
                                     "2023-11-16T13:00:03.5-05:00,10,5\n"
                                     "2023-11-16T18:00:04Z,10,5\n")
    assert [r.arrival_time for r in w] == [0.0, 2.0, 3.5, 4.0]


@pytest.mark.skipif(not hasattr(time, "tzset"), reason="needs time.tzset")
def test_naive_dates_read_as_utc_whatever_the_local_zone(tmp_path, monkeypatch):
    # New York falls back an hour at 2023-11-05 06:00 UTC: read as New York local time these
    # naive dates would be 3 hours apart; as UTC (the trace's own clock) they are 2.
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        w, _ = _trace(tmp_path, HEADER + "2023-11-05 00:30:00,10,5\n2023-11-05 02:30:00,10,5\n")
        assert [r.arrival_time for r in w] == [0.0, 7200.0]
    finally:
        monkeypatch.undo()
        time.tzset()
    assert os.environ.get("TZ") != "America/New_York"


@pytest.mark.parametrize("name,text,match", [
    ("t.csv", HEADER + "0,10,5\n-1.5,10,5\n", r"t\.csv:3: TIMESTAMP must be >= 0, got '-1\.5'"),
    ("t.jsonl", ('{"timestamp": 0, "input_length": 10, "output_length": 5}\n\n'
                '{"timestamp": -3, "input_length": 10, "output_length": 5}\n'),
     r"t\.jsonl:3: timestamp must be >= 0, got -3"),
])
def test_negative_trace_times_name_file_and_line(tmp_path, name, text, match):
    with pytest.raises(TraceFormatError, match=match):
        _trace(tmp_path, text, name)


def test_rows_out_of_time_order_replay_sorted_and_stable(tmp_path):
    # Decreasing times are sorted, not refused: equal times keep the file's order, and
    # start / num_requests count in time order.
    text = HEADER + "5,50,1\n1,10,1\n3,30,1\n1,11,1\n0,1,1\n"
    w, p = _trace(tmp_path, text)
    assert [(r.arrival_time, r.prompt_len) for r in w] == [(0, 1), (1, 10), (1, 11), (3, 30),
                                                           (5, 50)]
    part = make_workload({"name": "trace", "path": str(p), "start": 1, "num_requests": 3},
                         seed=0)
    assert [(r.arrival_time, r.prompt_len) for r in part] == [(0, 10), (0, 11), (2, 30)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 2000, "input_length": 20, "output_length": 2}\n'
                     '{"timestamp": 500, "input_length": 5, "output_length": 1}\n')
    w = make_workload({"name": "trace", "path": str(jsonl)}, seed=0)
    assert [(r.arrival_time, r.prompt_len, r.max_output_len) for r in w] == [(0.0, 5, 1),
                                                                             (1.5, 20, 2)]


def test_a_pool_larger_than_the_device_memory_is_a_config_error():
    # 1e12 blocks of Llama-3-8B's 2 MiB cannot exist on one 80 GB GPU; the message says how
    # many can.
    with pytest.raises(ConfigError, match=r"kv\.num_gpu_blocks_override: 1000000000000 "
                                          r"blocks .* at most 40960 fit"):
        Simulation(small_cfg("model=llama3_8b", "hardware=a100_80gb",
                             "kv.num_gpu_blocks_override=1e12"))


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CPU", 7])
def test_a_misspelt_device_is_refused_whichever_executor_runs(device):
    from experiments.simulation import Simulation
    from sim.errors import ConfigError
    from tests.helpers import small_cfg

    with pytest.raises(ConfigError) as e:
        Simulation({**small_cfg(), "device": device})
    assert e.value.field == "device"
