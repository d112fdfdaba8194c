"""What ``validate`` reads from its config: its own options (``validate.*``), the main job's
config inside it, the policy overrides it applies and the cost model section it prices with.
Shared by ``experiments/validate.py`` and ``experiments/host_speed.py``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from executors.calibration import RUN_LEVELS
from experiments.analysis.saturation import DEFAULT_FRACTION, check_fraction
from sim.errors import ConfigError, require

ROOT = Path(__file__).resolve().parents[2]  # the project root
#: The end-to-end figures a validation is judged on: each within its target on p50 and p90.
TARGET_STATS = tuple((m, s) for m in ("TTFT", "TPOT", "E2E") for s in ("p50", "p90"))
#: ``validate.host_speed`` values (``experiments/host_speed.py``).
HOST_SPEED_MODES = ("own", "neighbours", "none")
OPTIONS = {"profile", "replay", "cost_model", "seed_profile", "real_repeats", "pin_cpu",
           "policy_overrides", "calibration_runs", "interleave", "fit_statistic", "qps",
           "saturation_fraction", "saturation_num_gpu_blocks", "hardware", "host_speed",
           "calibration_level"}

def _options(cfg: dict[str, Any]) -> dict[str, Any]:
    opts = dict(cfg.get("validate") or {})
    unknown = sorted(set(opts) - OPTIONS)
    if unknown:
        raise ConfigError(f"validate.{unknown[0]}",
                          f"unknown option; known: {', '.join(sorted(OPTIONS))}")
    for key, lo in (("real_repeats", 1), ("calibration_runs", 0)):
        n = opts.get(key, lo)
        require(isinstance(n, int) and not isinstance(n, bool) and n >= lo,
                f"validate.{key}", f"must be an integer >= {lo}, got {n!r}")
    require(opts.get("fit_statistic", "median") in ("median", "mean"), "validate.fit_statistic",
            f"must be median or mean, got {opts.get('fit_statistic')!r}")
    require(opts.get("calibration_level", "median") in RUN_LEVELS, "validate.calibration_level",
            f"must be one of {', '.join(RUN_LEVELS)}, got {opts.get('calibration_level')!r}")
    require(isinstance(opts.get("interleave", False), bool), "validate.interleave",
            f"must be true or false, got {opts.get('interleave')!r}")
    pin = opts.get("pin_cpu")
    require(pin is None or (isinstance(pin, int) and not isinstance(pin, bool) and pin >= 0),
            "validate.pin_cpu", f"must be a core number >= 0 or null, got {pin!r}")
    require(opts.get("qps") in (None, "auto"), "validate.qps",
            f"must be auto (measure the saturation, run at validate.saturation_fraction of it) "
            f"or null (run at workload.qps), got {opts.get('qps')!r}; a fixed offered load is "
            f"workload.qps")
    check_fraction(opts.get("saturation_fraction", DEFAULT_FRACTION))
    blocks = opts.get("saturation_num_gpu_blocks")
    require(blocks is None or (isinstance(blocks, int) and not isinstance(blocks, bool)
                               and blocks >= 1), "validate.saturation_num_gpu_blocks",
            f"must be a block count >= 1 or null (the validated kv.num_gpu_blocks), got "
            f"{blocks!r}")
    require(opts.get("host_speed", "own") in HOST_SPEED_MODES, "validate.host_speed",
            f"must be one of {', '.join(HOST_SPEED_MODES)}, got {opts.get('host_speed')!r}")
    require(opts.get("hardware") in (None, "auto"), "validate.hardware",
            f"must be auto (the conf/hardware spec of the device the real executor runs on) "
            f"or null (the composed hardware=...), got {opts.get('hardware')!r}")
    return opts


def command_line_policy_keys(task_overrides: Sequence[str]) -> set[str]:
    """The ``policy.<key>`` names a Hydra job's command line sets (``policy.x=1``, ``+policy.x``,
    ``++policy.x``; ``policy=<name>`` picks the group and sets none)."""
    keys = set()
    for override in task_overrides:
        name = override.partition("=")[0].lstrip("+~")
        if name.startswith("policy."):
            keys.add(name[len("policy."):].split(".")[0])
    return keys


def apply_policy_overrides(cfg: dict[str, Any], overrides: dict[str, Any] | None,
                           command_line: set[str] | None = None) -> None:
    """Merge ``validate.policy_overrides[<policy name>]`` into ``cfg["policy"]``.

    A key the command line also set is an error, not silently replaced: set it through
    ``validate.policy_overrides`` instead. The command line's keys are ``command_line``
    (``command_line_policy_keys`` of the Hydra job); any key whose value differs from
    ``conf/policy/<name>.yaml`` counts as set too (a config composed in Python has no
    command line to read).
    """
    from policies.base import POLICIES

    for name, table in (overrides or {}).items():
        try:
            POLICIES.get(str(name))
        except KeyError as e:
            raise ConfigError(f"validate.policy_overrides.{name}", str(e.args[0])) from None
        require(isinstance(table, dict), f"validate.policy_overrides.{name}",
                f"must be a mapping of policy keys, got {table!r}")
    policy = cfg["policy"]
    name = str(policy.get("name"))
    table = (overrides or {}).get(name) or {}
    if not table:
        return
    path = ROOT / "conf" / "policy" / f"{name}.yaml"
    defaults = yaml.safe_load(path.read_text()) if path.exists() else {}
    for key, value in table.items():
        field_name = f"validate.policy_overrides.{name}.{key}"
        require(key in policy, field_name, f"policy {name} has no key {key!r}")
        changed = key in defaults and policy[key] != defaults[key] and policy[key] != value
        require(key not in (command_line or set()) and not changed,
                f"policy.{key}", f"set to {policy[key]!r} on the command line, but "
                f"{field_name}={value!r} would replace it: set {field_name} instead")
        policy[key] = value


def _sim_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    """The main job's config: everything but this script's own sections."""
    out = {k: copy.deepcopy(v) for k, v in cfg.items() if k not in ("validate", "profile",
                                                                      "hydra")}
    out["progress"] = bool(cfg.get("progress", False))
    return out


def cost_model_section(profile: Path, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``conf/executor/cost_model.yaml`` with the profile and ``validate.cost_model`` applied."""
    with (ROOT / "conf" / "executor" / "cost_model.yaml").open() as f:
        section = dict(yaml.safe_load(f) or {})
    # The real executor it is compared with runs its host work between steps, whatever
    # engine the policy stands for (a validate.cost_model value still wins).
    section["host_overlap"] = False
    section.update(overrides or {})
    section["profile"] = str(profile)
    return section
