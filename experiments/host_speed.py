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
coefficient and the roofline knee is a p-norm, so scaling all of them by f scales every term
the profile prices by exactly f: on one device without swaps (the validations so far), every
step's predicted time. TP communication, pipeline sends and swap copies are priced from the
hardware spec and fitted network timings, not the profile, and are not scaled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def speed_ratio(steps: Sequence[Any], executor: Any) -> float:
    """Measured over predicted time, summed over ``steps`` (``RecordedStep``s) that run rows
    and move no KV between pools: >1 means the host ran slower than ``executor`` prices."""
    from executors.recording import is_serving_step

    measured = predicted = 0.0
    for s in steps:
        if is_serving_step(s):
            measured += s.duration
            predicted += executor.breakdown_shape(s.shape).total
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


# ---- the paired figures of a finished validation, again (python -m experiments.host_speed) ----
def own_speeds_from_csv(replay_steps_csv: Path) -> list[float]:
    """Each real run's ``own`` speed from a validation's ``replay_steps.csv`` (its ``run``
    column, 1-based): measured over predicted time of its serving steps."""
    import pandas as pd

    from executors.recording import serving_rows

    serving = serving_rows(pd.read_csv(replay_steps_csv))
    sums = serving.groupby("run")[["measured_s", "predicted_s"]].sum().sort_index()
    return (sums.measured_s / sums.predicted_s).tolist()


def pair_saved(folder: Path, cfg: dict[str, Any], command_line: set[str] | None = None,
               ) -> tuple[list[dict[str, Any]], list[float]]:
    """Re-simulate a finished validation's real runs (``folder``, composed config ``cfg``) at
    their ``own`` host speeds, read back from its ``replay_steps.csv`` and profile: the paired
    runs' summaries (real-run order) and the speeds. What ``validate`` computes in-run (the
    figures may differ in the last bits: the sums are taken in another order).
    ``command_line``: the policy keys its overrides set (``apply_policy_overrides``)."""
    import copy
    import json

    from experiments.simulation import Simulation
    from experiments.analysis.validate_config import (
        _options,
        _sim_cfg,
        apply_policy_overrides,
        cost_model_section,
    )

    doc = json.loads((folder / "validation.json").read_text())
    profile = Path(doc["profile"])
    if not profile.is_file():  # the folder moved: the profile lies beside its outputs
        profile = folder / profile.name
    base = _sim_cfg(cfg)
    apply_policy_overrides(base, _options(cfg).get("policy_overrides"), command_line)
    sim = json.loads((folder / "sim" / "summary.json").read_text())
    speeds = own_speeds_from_csv(folder / "replay_steps.csv")
    out = []
    for i, factor in enumerate(speeds):
        scaled = scaled_profile(profile, factor, folder / "paired_offline" / f"run_{i + 1}.yaml")
        run_cfg = copy.deepcopy(base)
        run_cfg["executor"] = cost_model_section(scaled, _options(cfg).get("cost_model"))
        run_cfg["kv"] = {**run_cfg["kv"], "num_gpu_blocks_override": sim["kv_num_gpu_blocks"],
                         "num_cpu_blocks": sim["kv_num_cpu_blocks"]}
        out.append(Simulation(run_cfg, None).run().summary)
    return out, speeds


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.host_speed FOLDER [override ...]``: the paired figures of a
    finished validation at each run's own speed, with the overrides it ran with (default: its
    ``.hydra/overrides.yaml``), against its real runs."""
    import json
    import sys

    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from experiments.common import validation_files
    from experiments.analysis.validate_config import ROOT, TARGET_STATS, command_line_policy_keys
    from sim.errors import ConfigError

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(main.__doc__, file=sys.stderr)
        return 2
    folder, overrides = Path(args[0]), args[1:]
    saved = folder / ".hydra" / "overrides.yaml"
    if not overrides and saved.is_file():
        overrides = [o for o in yaml.safe_load(saved.read_text()) if not o.startswith("hydra")]
    try:
        validation_files(folder, ["validation.json", "replay_steps.csv", "sim/summary.json",
                                  "real/summary.json"], "a finished validation")
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = OmegaConf.to_container(compose(config_name="validate", overrides=overrides),
                                         resolve=True)
        paired, speeds = pair_saved(folder, cfg, command_line_policy_keys(overrides))
    except (ConfigError, HydraException) as e:  # a bad folder, or an override Hydra refuses
        print(f"config error: {e}", file=sys.stderr)
        return 2
    real = [json.loads((folder / name / "summary.json").read_text()) for name in
            ["real"] + [f"real_{i}" for i in range(2, len(paired) + 1)]]
    keys = {"TTFT": "ttft", "TPOT": "tpot", "E2E": "e2el"}
    print(f"{folder} ({' '.join(overrides)}): speeds x{min(speeds):.3f} to x{max(speeds):.3f}")
    for metric, stat in TARGET_STATS:
        key = f"{'median' if stat == 'p50' else stat}_{keys[metric]}_ms"
        err = np.median([100.0 * (p[key] / r[key] - 1.0) for p, r in zip(paired, real)])
        print(f"{metric} {stat}: paired err {err:+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
