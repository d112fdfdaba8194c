"""Host speed pairing (experiments/host_speed.py): the speed ratio of recorded steps, the
calibration runs beside each real run, and profiles scaled exactly."""

from __future__ import annotations

import pytest

from executors.calibration import HardwareProfile, load_profile, save_profile
from executors.recording import RecordedStep
from executors.step_terms import Coefficients, StepShape
from experiments.host_speed import neighbour_speeds, scaled_profile, speed_ratio


class _Priced:
    """A stand-in cost model: 1 ms per row."""

    def breakdown_shape(self, shape: StepShape):
        return type("B", (), {"total": 1e-3 * shape.num_rows})()


def _step(rows: int, seconds: float, swap_in: int = 0) -> RecordedStep:
    shape = StepShape(num_tokens=rows, num_sampled=rows, num_rows=rows, num_decode=rows,
                      decode_ctx=16 * rows, decode_max_ctx=16, swap_in_blocks=swap_in)
    return RecordedStep(shape, tuple(range(rows)), (True,) * rows, seconds)


def test_speed_ratio_sums_measured_over_predicted_and_skips_swaps_and_empty_steps():
    steps = [_step(2, 0.003), _step(4, 0.005), _step(1, 9.0, swap_in=3),
             RecordedStep(StepShape(num_tokens=0, num_sampled=0, num_rows=0), (), (), 0.5)]
    assert speed_ratio(steps, _Priced()) == pytest.approx(0.008 / 0.006)
    with pytest.raises(ValueError, match="no steps with rows"):
        speed_ratio(steps[2:], _Priced())


def test_neighbours_are_the_calibration_runs_just_before_and_after():
    # Execution order as RunSchedule alternates it: cal, real, cal, real, real.
    order = [("calibration", 0), ("real", 0), ("calibration", 1), ("real", 1), ("real", 2)]
    speeds = neighbour_speeds(order, {0: 1.0, 1: 1.1})
    assert speeds == {0: pytest.approx(1.05), 1: 1.1, 2: 1.1}
    # A real run first in the order only has a calibration run after it.
    assert neighbour_speeds([("real", 0), ("calibration", 0)], {0: 0.9}) == {0: 0.9}
    with pytest.raises(ValueError, match="no calibration runs"):
        neighbour_speeds([("real", 0)], {})


def test_scaled_coefficients_scale_every_price_and_keep_the_knee():
    c = Coefficients(s_per_step=1e-4, s_per_flop=2e-12, s_per_kv_byte=3e-10, sharpness=2.0)
    s = c.scaled(1.25)
    assert s.sharpness == 2.0
    for name in Coefficients.names():
        assert getattr(s, name) == pytest.approx(1.25 * getattr(c, name), rel=1e-15)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale factor"):
            c.scaled(bad)


def test_scaled_profile_prices_every_step_exactly_factor_times(tmp_path):
    """Every term is a price times a driver or a p-norm of such products: the scaled
    profile's cost model prices any step (prefill, decode, mixed) ``factor`` times higher."""
    from executors.cost_model import RooflineCostModel
    from sim.specs import load_hardware_spec, load_model_spec

    coeffs = Coefficients(s_per_step=2e-5, s_per_seq=1e-4, s_per_token=4e-8, s_per_flop=9e-12,
                          s_per_weight_byte=6e-10, s_per_attn_flop=2e-11,
                          s_per_diag_flop=3e-11, s_per_kv_byte=6e-10, s_per_attn_wave=1e-11,
                          s_per_attn_kernel=5e-11, s_per_prefill_row=1e-4, sharpness=1.7)
    path = save_profile(HardwareProfile("tiny", "cpu", "fp32", 1, coeffs, {"rows_fit": 3}),
                        tmp_path / "p.yaml")
    out = scaled_profile(path, 1.0375, tmp_path / "scaled" / "p.yaml")
    prof = load_profile(out)
    assert prof.fit == {"rows_fit": 3, "host_speed_factor": 1.0375, "scaled_from": str(path)}
    model, hw = load_model_spec("tiny"), load_hardware_spec("a100_80gb")
    base = RooflineCostModel(model, hw, coefficients=coeffs, num_sms=None, attention_tile=1)
    scaled = RooflineCostModel(model, hw, coefficients=prof.coefficients, num_sms=None,
                               attention_tile=1)
    shapes = [StepShape(num_tokens=300, num_sampled=1, num_rows=1, num_prefill=1,
                        prefill_q_tokens=300, prefill_kv_tokens=300,
                        prefill_diag_pairs=300 * 300),
              StepShape(num_tokens=24, num_sampled=24, num_rows=24, num_decode=24,
                        decode_ctx=24 * 200, decode_max_ctx=400),
              StepShape(num_tokens=88, num_sampled=9, num_rows=9, num_prefill=1, num_decode=8,
                        decode_ctx=8 * 90, decode_max_ctx=150, prefill_q_tokens=80,
                        prefill_kv_tokens=144, prefill_prefix_pairs=80 * 64,
                        prefill_diag_pairs=80 * 80)]
    for shape in shapes:
        assert scaled.breakdown_shape(shape).total == pytest.approx(
            1.0375 * base.breakdown_shape(shape).total, rel=1e-12)
