"""Memory math against the published figures, and the roofline cost model's floors."""

import pytest

from executors.cost_model import RooflineCostModel
from sim.errors import ConfigError
from sim.memory import plan_memory
from sim.plan import ScheduledRequest, StepPlan
from sim.specs import known_hardware, known_models, load_hardware_spec, load_model_spec


@pytest.mark.parametrize("name,kv_bytes", [("llama3_8b", 131_072), ("llama3_70b", 327_680),
                                           ("llama31_405b", 516_096)])
def test_kv_bytes_per_token_fp16(name, kv_bytes):
    assert load_model_spec(name).kv_bytes_per_token == kv_bytes


def test_llama3_8b_weights_are_16_06_gb():
    assert round(load_model_spec("llama3_8b").weight_bytes() / 1e9, 2) == 16.06


def test_dtypes_change_bytes():
    base = load_model_spec("llama3_8b")
    assert load_model_spec("llama3_8b", kv_cache_dtype="fp8").kv_bytes_per_token == 65_536
    int4 = load_model_spec("llama3_8b", weight_dtype="int4").weight_bytes()
    fp8 = load_model_spec("llama3_8b", weight_dtype="fp8").weight_bytes()
    assert int4 < fp8 < base.weight_bytes()
    # Embedding + LM head stay 16-bit: 2 x 128256 x 4096 x 2 bytes.
    assert int4 > 2 * 128_256 * 4096 * 2


def test_tensor_parallel_divides_weights_and_kv():
    m = load_model_spec("llama3_70b")
    assert m.weight_bytes(4) == pytest.approx(m.weight_bytes() / 4, rel=1e-3)
    assert m.kv_bytes_per_token_per_rank(4) == m.kv_bytes_per_token / 4


def test_memory_planner_follows_vllm_rule():
    m, hw = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    p = plan_memory(m, hw, block_size=16, gpu_memory_utilization=0.9,
                    activation_reserve_override_bytes=2e9)
    expected = int((80 * 2**30 * 0.9 - m.weight_bytes() - 2e9) // (131_072 * 16))
    assert p.num_gpu_blocks == expected
    assert p.num_cpu_blocks == 4 * 2**30 // (131_072 * 16)
    assert plan_memory(m, hw, block_size=16, num_gpu_blocks_override=100).num_gpu_blocks == 100


def test_model_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError, match="cluster.tensor_parallel_size"):
        plan_memory(load_model_spec("llama3_70b"), load_hardware_spec("a100_80gb"), block_size=16)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ConfigError, match="llama3_8b"):
        load_model_spec("llama9")
    with pytest.raises(ConfigError, match="a100_80gb"):
        load_hardware_spec("tpu")
    assert {"tiny", "llama2_7b", "llama3_8b", "llama3_70b", "llama31_405b", "mistral_7b",
            "qwen25_7b"} <= set(known_models())
    assert {"a100_40gb", "a100_80gb", "h100_sxm", "h200", "l40s"} <= set(known_hardware())


def _decode_plan(batch: int, ctx: int) -> StepPlan:
    blocks = list(range(ctx // 16 + 1))
    return StepPlan([ScheduledRequest(i, ctx, 1, blocks, True) for i in range(batch)])


def test_llama3_8b_batch1_decode_near_weight_read_floor():
    m, hw = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    floor = m.weight_bytes() / (hw.memory_bandwidth_gbps * 1e9)
    assert 0.007 < floor < 0.008
    t = RooflineCostModel(m, hw).execute(_decode_plan(1, 512)).duration
    assert abs(t - floor) / floor <= 0.15, (t, floor)


def test_prefill_2048_is_compute_bound():
    m, hw = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    cm = RooflineCostModel(m, hw)
    plan = StepPlan([ScheduledRequest(0, 0, 2048, list(range(128)), True)])
    flop_floor = 2 * (m.num_params - m.embedding_params) * 2048 / (hw.peak_tflops_fp16 * 1e12)
    b = cm.breakdown(plan)
    assert b.total >= flop_floor
    # Every projection sits on the compute side of its roofline.
    weight_read = m.weight_bytes() / (hw.memory_bandwidth_gbps * 1e9)
    assert b.linear > 5 * weight_read


def test_decode_time_grows_with_batch_and_context():
    cm = RooflineCostModel(load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb"))
    t = lambda b, c: cm.execute(_decode_plan(b, c)).duration  # noqa: E731
    assert t(1, 512) < t(64, 512) < t(64, 4096)


def test_tensor_parallel_adds_communication_and_cuts_compute():
    m, hw = load_model_spec("llama3_70b"), load_hardware_spec("h100_sxm")
    plan = StepPlan([ScheduledRequest(0, 0, 1024, list(range(64)), True)])
    b2, b4 = (RooflineCostModel(m, hw, tp).breakdown(plan) for tp in (2, 4))
    assert b4.linear < b2.linear
    assert b2.communication > 0 and b4.communication > 0


def test_swap_blocks_cost_pcie_time():
    m, hw = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    cm = RooflineCostModel(m, hw)
    plan = _decode_plan(4, 100)
    base = cm.execute(plan).duration
    plan.swap_out.extend((i, i) for i in range(100))
    block_bytes = 131_072 * 16
    expected = hw.pcie_latency_us * 1e-6 + 100 * block_bytes / (hw.pcie_bandwidth_gbps * 1e9)
    assert cm.execute(plan).duration - base == pytest.approx(expected)


def test_steps_without_decode_rows_are_priced_once_per_shape(monkeypatch):
    """execute keeps the duration of a step without decode rows by its shape: the same float
    as pricing the shape afresh, and new coefficients price anew."""
    from dataclasses import replace

    from executors.step_terms import step_shape

    cm = RooflineCostModel(load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb"))
    prompt = StepPlan([ScheduledRequest(0, 0, 300, list(range(19)), True)])
    first = cm.execute(prompt).duration
    assert cm.execute(StepPlan([ScheduledRequest(7, 0, 300, list(range(40, 59)), True)])
                      ).duration == first == cm.duration(step_shape(prompt))
    assert list(cm._no_decode.values()) == [first]
    chunk = StepPlan([ScheduledRequest(0, 256, 44, list(range(19)), True)])
    assert cm.execute(chunk).duration == cm.duration(step_shape(chunk)) != first
    assert len(cm._no_decode) == 2
    # Decode rows are priced every time (their contexts grow every step): never kept.
    cm.execute(_decode_plan(3, 100))
    assert len(cm._no_decode) == 2
    # Full: priced, not kept.
    import executors.cost_model as cost_model

    monkeypatch.setattr(cost_model, "NO_DECODE_SHAPES_KEPT", 2)
    other = StepPlan([ScheduledRequest(0, 0, 17, [0, 1], True)])
    assert cm.execute(other).duration == cm.duration(step_shape(other))
    assert len(cm._no_decode) == 2
    cm.coefficients = replace(cm.roofline, s_per_step=1e-3)
    assert not cm._no_decode
    again = cm.execute(prompt).duration
    assert again == cm.duration(step_shape(prompt)) and again > first
