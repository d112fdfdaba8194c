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
    c = Coefficients(s_per_step=1e-4, s_per_flop=2e-12, s_per_kv_byte=3e-10,
                     s_per_first_seq=1e-5, seq_knee=4, sharpness=2.0)
    s = c.scaled(1.25)
    assert (s.sharpness, s.seq_knee) == (2.0, 4)
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
                          s_per_attn_kernel=5e-11, s_per_prefill_row=1e-4, s_per_first_seq=2e-5,
                          seq_knee=8, sharpness=1.7)
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


def test_pairing_by_neighbours_prices_each_run_at_the_calibration_runs_beside_it(tmp_path):
    """``validate.pair_by_host_speed`` with ``neighbours``: the speeds come from the
    calibration runs in RunSchedule's execution order, and each real run is simulated once at
    its speed; with no calibration runs the pairing is skipped and says why."""
    from experiments.validate import RunSchedule, pair_by_host_speed

    schedule = RunSchedule({"seed": 0}, tmp_path, repeats=3, calibration=2)
    # Job order: cal 0, real 0, cal 1, real 1, real 2. Calibration runs: 2 rows in 2.2 ms
    # and 2.6 ms (x1.1, x1.3 of 1 ms per row); real runs x1.0, x1.2, x0.9.
    schedule.done["calibration"] = [(None, [_step(2, 0.0022)]), (None, [_step(2, 0.0026)])]
    schedule.done["real"] = [(None, [_step(1, t)]) for t in (0.0010, 0.0012, 0.0009)]
    seen = []

    def simulate(profile, name):
        seen.append((name, load_profile(profile).fit["host_speed_factor"]))
        return type("S", (), {"run": lambda self: type("R", (), {"summary": {"n": name}})()})()

    path = save_profile(HardwareProfile("tiny", "cpu", "fp32", 1, Coefficients(s_per_seq=1e-3)),
                        tmp_path / "p.yaml")
    paired, info = pair_by_host_speed("neighbours", schedule, _Priced(), path, simulate,
                                      tmp_path)
    assert info["calibration"] == pytest.approx([1.1, 1.3])
    assert info["own"] == pytest.approx([1.0, 1.2, 0.9])
    assert info["factors"] == pytest.approx([1.2, 1.3, 1.3])
    assert [n for n, _ in seen] == ["paired/real", "paired/real_2", "paired/real_3"]
    assert [f for _, f in seen] == pytest.approx([1.2, 1.3, 1.3])
    assert [p["n"] for p in paired] == ["paired/real", "paired/real_2", "paired/real_3"]
    paired, info = pair_by_host_speed("own", schedule, _Priced(), path, simulate, tmp_path)
    assert info["factors"] == pytest.approx([1.0, 1.2, 0.9]) and len(paired) == 3
    schedule.done["calibration"] = []
    paired, info = pair_by_host_speed("neighbours", schedule, _Priced(), path, simulate,
                                      tmp_path)
    assert paired == [] and "calibration_runs=0" in info["skipped"]
