"""Typed config fields: a wrong type, a non-finite number or an out-of-range value is refused
when the run is built, with a ConfigError naming the field (never truthy strings, silent
truncation, or a raw traceback mid-run)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.config_types import as_bool, as_float, as_int, typed_fields
from sim.errors import ConfigError
from sim.memory import plan_memory
from sim.specs import load_hardware_spec, load_model_spec
from tests.helpers import compose_cfg, small_cfg


# ---- the helpers ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2.5, "abc", "3", True, False, None, math.nan, math.inf, [1]])
def test_int_field_refuses(value):
    with pytest.raises(ConfigError, match=r"^a\.b: must be an integer") as e:
        as_int(value, "a.b")
    assert e.value.field == "a.b"


@pytest.mark.parametrize("value,expected", [(3, 3), (0, 0), (-2, -2), (2.0, 2), (1e5, 100_000)])
def test_int_field_takes_integers_and_integral_floats(value, expected):
    out = as_int(value, "f")
    assert out == expected and type(out) is int


def test_int_minimum_is_inclusive():
    assert as_int(0, "seed", minimum=0) == 0
    with pytest.raises(ConfigError, match=r"^seed: must be >= 0, got -1$"):
        as_int(-1, "seed", minimum=0)


@pytest.mark.parametrize("value,match", [
    ("abc", r"must be a number, got 'abc' \(a string\)"),
    ("1.5", r"must be a number, got '1.5' \(a string\)"),
    (True, r"must be a number, got True \(bool\)"),
    (None, r"must be a number, got None"),
    (math.nan, r"must be a finite number, got nan"),
    (-math.inf, r"must be a finite number, got -inf"),
])
def test_float_field_refuses(value, match):
    with pytest.raises(ConfigError, match=r"^x\.y: " + match):
        as_float(value, "x.y")


@pytest.mark.parametrize("value", ["no", "false", "yes", "true", "maybe", 0, 1, None, 1.0])
def test_bool_field_takes_only_bools(value):
    with pytest.raises(ConfigError, match=r"^p\.q: must be true or false, got "):
        as_bool(value, "p.q")
    assert as_bool(True, "p.q") is True and as_bool(False, "p.q") is False


@given(st.integers(-10**18, 10**18))
def test_every_integer_passes_an_int_and_a_float_field(n):
    assert as_int(n, "f") == n
    assert as_float(n, "f") == float(n)


@given(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()))
def test_no_fractional_float_passes_an_int_field(x):
    with pytest.raises(ConfigError):
        as_int(x, "f")


@dataclass(frozen=True)
class _Example:
    name: str
    count: int = 1
    rate: float | None = None
    flag: bool = False
    sizes: list[int] | None = None


def test_typed_fields_coerces_by_annotation_and_passes_other_types_through():
    data = {"name": 7, "count": 4.0, "rate": 2, "flag": True, "sizes": ["x"], "extra": "kept"}
    out = typed_fields(_Example, data, "sec")
    assert out == {"name": 7, "count": 4, "rate": 2.0, "flag": True, "sizes": ["x"],
                   "extra": "kept"}
    assert type(out["count"]) is int and type(out["rate"]) is float
    assert data["count"] == 4.0  # the input is not modified
    assert typed_fields(_Example, {"rate": None}, "sec") == {"rate": None}
    with pytest.raises(ConfigError, match=r"^sec\.count: must be set \(a int\), got null$"):
        typed_fields(_Example, {"count": None}, "sec")
    with pytest.raises(ConfigError, match=r"^sec\.flag: must be true or false, got 'no'"):
        typed_fields(_Example, {"flag": "no"}, "sec")


# ---- whole runs: refused when built, naming the field ---------------------------------------
@pytest.mark.parametrize("overrides,field", [
    # bools: YAML 1.1 "no"/"yes" arrive as strings; never truthy
    (["policy.enable_chunked_prefill=no"], "policy.enable_chunked_prefill"),
    (["policy.enable_chunked_prefill=maybe"], "policy.enable_chunked_prefill"),
    (["policy.enable_chunked_prefill=1"], "policy.enable_chunked_prefill"),
    (["record_steps=no"], "record_steps"),
    (["check_integrity=yes"], "check_integrity"),
    (["workload.token_ids=no"], "workload.token_ids"),
    (["model=qwen25_7b", "model.attention_bias=no"], "model.attention_bias"),
    (["policy=priority", "policy.preemptive=no"], "policy.preemptive"),
    # ints: no fractions, no strings
    (["policy.max_num_seqs=2.5"], "policy.max_num_seqs"),
    (["policy.max_num_seqs=abc"], "policy.max_num_seqs"),
    (["workload.num_requests=2.5"], "workload.num_requests"),
    (["kv.block_size=16.5"], "kv.block_size"),
    (["kv.num_gpu_blocks_override=abc"], "kv.num_gpu_blocks_override"),
    (["cluster.tensor_parallel_size=1.5"], "cluster.tensor_parallel_size"),
    (["executor.attention_ctas_per_sm=2.5"], "executor.attention_ctas_per_sm"),
    (["hardware.num_sms=1.5"], "hardware.num_sms"),
    (["workload.prompt_len.max=4096.5"], "workload.prompt_len.max"),
    (["workload.shared_prefix_len=abc"], "workload.shared_prefix_len"),
    (["policy=chunked_prefill", "policy.max_num_partial_prefills=1.5"],
     "policy.max_num_partial_prefills"),
    (["seed=abc"], "seed"),
    (["seed=-1"], "seed"),
    (["seed=1.5"], "seed"),
    # floats: numbers, finite
    (["workload.qps=abc"], "workload.qps"),
    (["workload.qps=inf"], "workload.qps"),
    (["workload.cv=nan"], "workload.cv"),
    (["kv.gpu_memory_utilization=abc"], "kv.gpu_memory_utilization"),
    (["policy.kv_watermark=nan"], "policy.kv_watermark"),
    (["workload.prompt_len.sigma=abc"], "workload.prompt_len.sigma"),
    # ranges
    (["kv.activation_reserve_gib=-100"], "kv.activation_reserve_gib"),
    (["workload.priorities=[0,0]"], "workload.priorities"),
    (["workload.priorities=[1,-1]"], "workload.priorities[1]"),
    (["workload.priorities=[1,abc]"], "workload.priorities[1]"),
    (["workload.priorities=3"], "workload.priorities"),
    # cluster sections
    (["cluster=disaggregated", "cluster.decode.tensor_parallel_size=abc"],
     "cluster.decode.tensor_parallel_size"),
    (["cluster=disaggregated", "+cluster.decode.policy.enable_chunked_prefill=no"],
     "cluster.decode.policy.enable_chunked_prefill"),
    (["cluster=disaggregated", "cluster.num_decode_replicas=1.5"], "cluster.num_decode_replicas"),
    (["cluster=disaggregated", "+cluster.link.bandwidth_gbps=abc"],
     "cluster.link.bandwidth_gbps"),
    # The real executor's section (torch imported only when it is built).
    (["executor=real", "model=tiny", "device=cpu", "executor.warmup=no"], "executor.warmup"),
    (["executor=real", "model=tiny", "device=cpu", "executor.defer_gc=no"],
     "executor.defer_gc"),
    (["executor=real", "model=tiny", "device=cpu", "executor.temperature=abc"],
     "executor.temperature"),
    (["executor=real", "model=tiny", "device=cpu", "executor.num_threads=1.5"],
     "executor.num_threads"),
    (["executor=real", "model=tiny", "device=cpu", "executor.weight_seed=-1"],
     "executor.weight_seed"),
])
def test_bad_value_is_refused_at_build_time_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        Simulation(small_cfg(*overrides))
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


@pytest.mark.parametrize("override,field", [
    ("workload.max_output_len=0", "workload.max_output_len"),  # was an error mid-run
    ("workload.max_output_len=2.5", "workload.max_output_len"),
    ("workload.time_scale=nan", "workload.time_scale"),
    ("workload.start=abc", "workload.start"),
    ("workload.num_requests=2.5", "workload.num_requests"),
    ("workload.token_ids=no", "workload.token_ids"),
])
def test_bad_trace_option_is_refused_at_build_time_naming_the_field(tmp_path, override, field):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,20,6\n")
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg("workload=trace", f"workload.path={trace}", override))
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


@cache
def _small() -> dict:
    return small_cfg()  # composed once; Simulation copies the sections it reads


@pytest.mark.parametrize("key", ["progress", "check_integrity", "record_steps"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1])
def test_top_level_flags_take_only_bools(key, value):
    cfg = {**_small(), key: value}
    with pytest.raises(ConfigError, match=rf"^{key}: must be true or false"):
        Simulation(cfg)


def test_well_typed_values_still_build_and_integral_floats_count():
    sim = Simulation(small_cfg("policy.enable_chunked_prefill=false", "workload.num_requests=60.0",
                               "seed=7", "workload.priorities=[1,0.5]",
                               "kv.activation_reserve_gib=0"))
    assert sim.workload.num_requests == 60 and type(sim.workload.num_requests) is int
    assert sim.policy.config.enable_chunked_prefill is False
    assert sim.seed == 7 and sim.memory.activation_bytes == 0
    assert sim.workload.priorities == [1.0, 0.5]


def test_negative_activation_reserve_is_refused_by_the_planner_too():
    with pytest.raises(ConfigError, match=r"^kv\.activation_reserve_gib: must be >= 0"):
        plan_memory(load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb"),
                    block_size=16, activation_reserve_override_bytes=-2**30)


# ---- spec files -----------------------------------------------------------------------------
def test_h200_computes_like_an_h100():
    """Same GH100 compute (SMs, dense peaks): the same calibrated GEMM efficiency."""
    h100, h200 = load_hardware_spec("h100_sxm"), load_hardware_spec("h200")
    assert (h200.num_sms, h200.peak_tflops_fp16) == (h100.num_sms, h100.peak_tflops_fp16)
    assert h200.compute_efficiency == h100.compute_efficiency


def test_qwen25_7b_length_is_its_checkpoints():
    m = load_model_spec("qwen25_7b")
    assert (m.hf_name, m.max_model_len) == ("Qwen/Qwen2.5-7B", 131072)
