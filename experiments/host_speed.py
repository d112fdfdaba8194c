"""Host speed per real run: validation runs paired with the speed of the machine at their time.

On a shared host the real executor's speed drifts between runs by a few percent (other
processes, frequency scaling, cache pressure), and near saturation the queue multiplies that
drift about fourfold in latency: one workload's real runs spread 20-50% in p50 and p90. A
simulation priced with one profile can then only be compared with the runs' median, and it
misses that median by whatever speed the host had on average during the real runs, not by
what the simulator gets wrong.

So the validation also compares run by run: each real run is simulated with the calibrated
profile scaled by the host's speed during that run, and the paired errors' median is reported
(``experiments/validate.py``, the ``paired`` columns). ``own`` (the default) takes the speed
from the run's own recorded steps (measured / predicted summed step time, what its replay's
busy-time error says): the simulation then knows how fast the machine was overall, and nothing
of the schedule, so what is left is the simulator's queueing and its relative step prices. It
also absorbs a global pricing bias of the profile, which is why it is a diagnostic beside the
plain comparison, not a replacement. ``neighbours`` takes the speed from the calibration runs
executed just before and after the real run, independent of it; on the shared CPU host the
speed moves faster than runs alternate (a run's own and its neighbours' speeds differ by ~2%),
so it tracks the drift only partly. Every price the profile sets is a seconds-per-unit
coefficient and the roofline knee is a p-norm, so scaling all of them by f scales every step's
predicted time by exactly f. Swap copies are priced from the hardware spec, not the profile, and are not scaled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: ``validate.host_speed`` values.
MODES = ("own", "neighbours", "none")


def speed_ratio(steps: Sequence[Any], executor: Any) -> float:
    """Measured over predicted time, summed over ``steps`` (``RecordedStep``s) that run rows
    and move no KV between pools: >1 means the host ran slower than ``executor`` prices."""
    measured = predicted = 0.0
    for s in steps:
        shape = s.shape
        if not shape.num_rows or shape.swap_out_blocks or shape.swap_in_blocks:
            continue
        measured += s.duration
        predicted += executor.breakdown_shape(shape).total
    if predicted <= 0:
        raise ValueError("no steps with rows to measure the host speed on")
    return measured / predicted


def neighbour_speeds(order: Sequence[tuple[str, int]], calibration: dict[int, float],
                     ) -> dict[int, float]:
    """For each real run (``("real", i)`` in execution ``order``), the mean speed ratio of the
    nearest calibration run before it and the nearest after it (only one when it is first or
    last). ``calibration`` maps a calibration run's index to its ratio."""
    cal_positions = [(k, calibration[i]) for k, (name, i) in enumerate(order)
                     if name == "calibration"]
    if not cal_positions:
        raise ValueError("no calibration runs to take the host speed from")
    out = {}
    for k, (name, i) in enumerate(order):
        if name != "real":
            continue
        before = [r for p, r in cal_positions if p < k]
        after = [r for p, r in cal_positions if p > k]
        near = ([before[-1]] if before else []) + ([after[0]] if after else [])
        out[i] = float(np.mean(near))
    return out


def scaled_profile(profile_path: Path, factor: float, out_path: Path) -> Path:
    """The fitted profile with every price multiplied by ``factor`` (``Coefficients.scaled``),
    saved to ``out_path``; its ``fit`` notes the factor and the profile it came from."""
    from executors.calibration import load_profile, save_profile

    prof = load_profile(profile_path)
    scaled = dataclasses.replace(
        prof, coefficients=prof.coefficients.scaled(factor),
        fit={**prof.fit, "host_speed_factor": factor, "scaled_from": str(profile_path)})
    return save_profile(scaled, out_path)
