"""The cost model's host time per step (executor.step_overhead_ms, per_seq_overhead_us and
its cap per_seq_overhead_max_seqs, num_scheduler_steps, host_overlap), element-wise kernels'
efficiency, and FP8/INT8 weights on hardware with and without those tensor cores: what each
prices, and that every fast path prices it as the step-by-step one does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executors.cost_model import CostModelConfig, RooflineCostModel, build_cost_model
from executors.step_terms import Coefficients, StepShape, step_shape
from sim.errors import ConfigError
from sim.plan import ScheduledRequest, StepPlan
from sim.specs import load_hardware_spec, load_model_spec
from tests.test_fast_forward import _assert_same

M8 = load_model_spec("llama3_8b")
A100, H100 = load_hardware_spec("a100_80gb"), load_hardware_spec("h100_sxm")


def _cm(hw=A100, model=M8, tp=1, **cfg) -> RooflineCostModel:
    return RooflineCostModel(model, hw, tp, CostModelConfig(**cfg))


def _decode(nd: int, ctx: int = 500) -> StepShape:
    return step_shape(StepPlan([ScheduledRequest(i, ctx, 1, [], True) for i in range(nd)]))


# ---- what the host terms price ---------------------------------------------------------------
def test_per_sequence_host_time_saturates_at_its_cap():
    cm = _cm()
    host = lambda n: cm.breakdown_shape(StepShape(num_rows=n)).overhead
    assert host(1) == 0.3e-3 + 15e-6
    assert host(256) == pytest.approx(0.3e-3 + 256 * 15e-6)
    assert host(257) == host(4096) == host(256)  # 4.14 ms, not 61.7 ms at 4,096
    unbounded = _cm(per_seq_overhead_max_seqs=None)
    assert unbounded.breakdown_shape(StepShape(num_rows=4096)).overhead == pytest.approx(
        0.3e-3 + 4096 * 15e-6)
    # Up to the cap, the same floats as the uncapped price.
    for n in (0, 1, 7, 100, 256):
        assert (cm.breakdown_shape(_decode(max(n, 1))).total
                == unbounded.breakdown_shape(_decode(max(n, 1))).total)


def test_multi_step_scheduling_pays_host_time_once_per_n_steps():
    one, ten = _cm(), _cm(num_scheduler_steps=10)
    for n in (1, 64, 256, 1000):
        s = StepShape(num_rows=n)
        assert ten.breakdown_shape(s).overhead == pytest.approx(
            one.breakdown_shape(s).overhead / 10, rel=1e-15)
    shape = _decode(32)
    b1, b10 = one.breakdown_shape(shape), ten.breakdown_shape(shape)
    assert b10.linear == b1.linear and b10.attention_decode == b1.attention_decode
    assert b10.total < b1.total


def test_overlapped_host_time_costs_only_what_exceeds_the_gpu():
    serial, over = _cm(), _cm(host_overlap=True)
    for nd, ctx in ((1, 10), (64, 500), (256, 2000)):
        s = _decode(nd, ctx)
        b, o = serial.breakdown_shape(s), over.breakdown_shape(s)
        gpu = b.total - b.overhead
        assert o.overhead == 0.0  # a GPU step of an 8B model outlasts 4 ms of host work
        assert o.total == pytest.approx(max(gpu, b.overhead), rel=1e-15)
    # Host-bound: a slow host (10 ms per step) behind a step of the tiny model.
    tiny = load_model_spec("tiny")
    slow = _cm(model=tiny, host_overlap=True, step_overhead_ms=10.0)
    b = slow.breakdown_shape(_decode(4, 50))
    assert b.total == pytest.approx(10e-3 + 4 * 15e-6, rel=1e-12) and b.overhead > 0
    # Swap copies count on the GPU side.
    s = _decode(4, 50)._replace(swap_out_blocks=200)
    b = slow.breakdown_shape(s)
    assert b.total == pytest.approx(max(b.swap + 1e-6, 10e-3 + 60e-6), rel=1e-3)


def test_profile_host_prices_are_amortized_too():
    fitted = Coefficients(s_per_step=2e-4, s_per_seq=1e-5, s_per_flop=4e-15,
                          s_per_weight_byte=5e-13, s_per_first_seq=3e-6, seq_knee=4)
    cm = RooflineCostModel(M8, A100, coefficients=fitted,
                           config=CostModelConfig(num_scheduler_steps=4))
    assert cm.coefficients.s_per_step == 5e-5 and cm.coefficients.s_per_seq == 2.5e-6
    assert cm.coefficients.s_per_first_seq == 7.5e-7 and cm.coefficients.s_per_flop == 4e-15


def test_host_options_are_checked():
    for bad, field in (({"per_seq_overhead_max_seqs": 0}, "per_seq_overhead_max_seqs"),
                       ({"num_scheduler_steps": 0}, "num_scheduler_steps"),
                       ({"elementwise_efficiency": 0}, "elementwise_efficiency"),
                       ({"host_overlap": "yes"}, "host_overlap")):
        with pytest.raises(ConfigError) as e:
            build_cost_model(M8, A100, 1, {"name": "cost_model", **bad})
        assert e.value.field == f"executor.{field}"


def test_elementwise_kernels_run_at_their_share_of_the_bandwidth():
    n = 4096
    ew = lambda cm: cm.breakdown_shape(StepShape(num_tokens=n)).elementwise
    full, measured = _cm(), _cm(elementwise_efficiency=0.6)
    assert ew(measured) == pytest.approx(ew(full) / 0.6, rel=1e-12)
    d = full.decomposer
    bw = A100.memory_bandwidth_gbps * 1e9 * A100.memory_efficiency
    assert ew(full) == pytest.approx(d.layers * n * d._ew_bytes_per_token / bw, rel=1e-12)
    assert ew(measured) == pytest.approx(d.layers * n * d._ew_bytes_per_token / (bw * 0.6))


# ---- FP8 / INT8 weights -----------------------------------------------------------------------
def test_fp8_weights_without_fp8_tensor_cores_run_at_the_fp16_rate_from_one_byte_weights():
    """A100 has no FP8 tensor cores (peak_tflops_fp8 0): an FP8 checkpoint runs as vLLM runs
    it there (weight-only FP8 GEMMs that dequantize to fp16): its GEMMs at the fp16 peak,
    never the FP8 one, its weights streamed at one byte each. H100 runs them at its FP8 peak."""
    assert A100.peak_tflops_fp8 == 0
    fp8, bf16 = load_model_spec("llama3_8b", weight_dtype="fp8"), load_model_spec("llama3_8b")
    n = 8192  # compute bound
    lin = lambda m, hw: _cm(hw, m).breakdown_shape(StepShape(num_tokens=n)).linear
    assert lin(fp8, A100) == pytest.approx(lin(bf16, A100), rel=0.02)  # fp16 rate on A100
    assert lin(fp8, H100) < 0.6 * lin(bf16, H100)  # FP8 tensor cores on H100
    a100 = _cm(A100, fp8)
    assert a100.coefficients.s_per_flop == _cm(A100, bf16).coefficients.s_per_flop
    # Memory bound (one row): half the weight bytes, about half the time, on either GPU.
    one = StepShape(num_tokens=1)
    for hw in (A100, H100):
        t8, t16 = (_cm(hw, m).breakdown_shape(one).linear for m in (fp8, bf16))
        assert t8 == pytest.approx(t16 / 2, rel=0.02)
    # INT8 weights likewise use the INT8 peak where there is one (both have it).
    int8 = load_model_spec("llama3_8b", weight_dtype="int8")
    assert lin(int8, A100) < 0.6 * lin(bf16, A100)
    assert _cm(load_hardware_spec("a100_80gb"), int8).coefficients.s_per_flop == 1.0 / (
        A100.peak_tops_int8 * 1e12 * A100.compute_efficiency)


# ---- every pricing path prices the host time alike ---------------------------------------------
def _models() -> list[RooflineCostModel]:
    tiny = load_model_spec("tiny")
    fitted = Coefficients(s_per_step=2e-4, s_per_seq=1e-5, s_per_token=3e-7, s_per_flop=4e-15,
                          s_per_weight_byte=5e-13, s_per_attn_flop=7e-15, s_per_kv_byte=6e-13,
                          s_per_cta_byte=1e-10, s_per_sm_byte=2e-11, s_per_attn_wave=2e-6,
                          s_per_attn_kernel=5e-6, s_per_first_seq=3e-6, seq_knee=4,
                          sharpness=2.0)
    return [
        _cm(host_overlap=True, num_scheduler_steps=10),
        _cm(host_overlap=True),
        _cm(per_seq_overhead_max_seqs=8, num_scheduler_steps=3),
        # Host-bound at small batches: the max switches sides within a run.
        _cm(model=tiny, host_overlap=True, step_overhead_ms=0.03, per_seq_overhead_us=0.5),
        _cm(model=load_model_spec("llama3_70b"), hw=H100, tp=4, host_overlap=True),
        _cm(model=tiny, host_overlap=True, roofline_sharpness=None, step_overhead_ms=0.02),
        RooflineCostModel(tiny, A100, coefficients=fitted,
                          config=CostModelConfig(host_overlap=True, num_scheduler_steps=2)),
    ]


MODELS = _models()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(MODELS) - 1), nd=st.integers(0, 300), npf=st.integers(0, 3),
       chunk=st.integers(1, 900), cached=st.integers(0, 5000), ctx=st.integers(1, 8000),
       swap=st.sampled_from([0, 0, 4]))
def test_memoized_duration_is_the_breakdown_total_bit_for_bit(which, nd, npf, chunk, cached,
                                                                ctx, swap):
    ex = MODELS[which]
    rows = [ScheduledRequest(i, cached, chunk, [], True) for i in range(npf)]
    rows += [ScheduledRequest(100 + i, ctx + 7 * i, 1, [], i % 2 == 0) for i in range(nd)]
    shape = step_shape(StepPlan(rows))._replace(swap_out_blocks=swap)
    assert ex.duration(shape) == ex.breakdown_shape(shape).total


@pytest.mark.parametrize("which", range(len(MODELS)))
def test_fast_decode_prices_follow_the_breakdown(which):
    """decode_run_durations, decode_step_pricer, decode_stretch_durations and
    decode_durations against the step-by-step breakdown, in host-bound and GPU-bound steps."""
    ex = MODELS[which]
    rng = np.random.default_rng(7 + which)
    for nd in (1, 2, 5, 11, 54, 128, 300):
        mx = int(rng.integers(1, 3000))
        ctx = nd * mx - int(rng.integers(0, nd))
        run = ex.decode_run_durations(nd, ctx, mx, 30)
        assert run[0] == ex.decode_run_durations(nd, ctx, mx, 1)[0]
        for j in (0, 1, 29):
            want = ex.breakdown_shape(StepShape(
                num_tokens=nd, num_sampled=nd, num_rows=nd, decode_ctx=ctx + nd * j,
                decode_max_ctx=mx + j, num_decode=nd)).total
            assert run[j] == pytest.approx(want, rel=1e-13)
        pricer = ex.decode_step_pricer(nd)
        if pricer is not None:
            assert [pricer(ctx + nd * j, mx + j) for j in range(30)] == pytest.approx(
                run.tolist(), rel=1e-15)
        other = (max(nd - 1, 1), ctx + 5 * nd, mx + 30, 7)
        joint = ex.decode_stretch_durations([(nd, ctx, mx, 30), other])
        assert joint == pytest.approx([*run.tolist(),
                                       *ex.decode_run_durations(*other).tolist()], rel=1e-15)
        plan = StepPlan([ScheduledRequest(i, int(c), 1, [], True)
                         for i, c in enumerate(rng.integers(1, 3000, nd))])
        got = ex.decode_durations(plan, 5)
        assert got[4] == pytest.approx(ex.execute(StepPlan([
            ScheduledRequest(r.request_id, r.start_position + 4, 1, [], True)
            for r in plan.scheduled])).duration, rel=1e-13)


HOST = ["model=tiny", "workload.prompt_len.max=200", "workload.output_len.max=120",
        "workload.num_requests=120", "workload.qps=40", "executor.host_overlap=true",
        "executor.num_scheduler_steps=4", "executor.step_overhead_ms=0.05",
        "executor.per_seq_overhead_us=30", "executor.per_seq_overhead_max_seqs=8"]


@pytest.mark.parametrize("extra", [
    ("policy=fcfs", "kv.num_gpu_blocks_override=20000"),  # the array core
    ("policy=fcfs", "array_core=false"),  # the replica loop's decode jumps
    ("policy=chunked_prefill", "policy.max_num_batched_tokens=128", "policy.max_num_seqs=64"),
    ("policy=sjf", "kv.num_gpu_blocks_override=40"),  # preemptions
])
def test_fast_equals_exact_with_overlapped_amortized_host_time(extra):
    s = _assert_same([*HOST, *extra])
    assert s["num_decode_jumps"] > 0 or s["step_engine"] == "array_core"


@pytest.mark.parametrize(("policy", "overlaps"), [("fcfs", False), ("sjf", False),
                                                   ("vllm_v1", True), ("sglang", True),
                                                   ("trtllm", True)])
def test_host_overlap_defaults_to_the_policys_engine(policy, overlaps):
    """``executor.host_overlap: null``: vLLM v1 (asynchronous scheduling) and SGLang (overlap
    scheduler) run the host's work beside the GPU's, the vLLM v0 policies do not; a value
    given wins."""
    from experiments.simulation import Simulation
    from tests.helpers import small_cfg

    def summary(*extra: str) -> dict:
        s = Simulation(small_cfg(f"policy={policy}", *extra), None).run().summary
        return {k: v for k, v in s.items() if k != "wall_time_s"}

    default = summary()
    assert default == summary(f"executor.host_overlap={str(overlaps).lower()}")
    assert default != summary(f"executor.host_overlap={str(not overlaps).lower()}")
