"""Error bars: each headline figure of a run with the interval the cost model's error allows.

The cost model's step times are off from a real engine's by a factor whose spread was
measured (``executors/uncertainty.py``): a calibrated profile carries the ``LEVEL`` interval
of measured / predicted time on its held-out shapes under bootstrap refits
(``fit.step_time_interval``); the roofline without a profile has the interval of its error on
Vidur's measured A100/H100 operator timings (``error_bars.roofline_step_time``, printed by
``python -m experiments.check_profiles``). The run is simulated twice more, every step time
times the interval's low and high factor (``executor.step_time_factor``), on the same
arrivals; each headline figure's interval spans its values in those runs (and in the run
itself where the interval holds factor 1). A figure that moves one way with the step time
(latencies up, throughput down) lands on its interval's ends in the two extra runs; one that
does not (a tail ITL or TPOT near a preemption threshold can jump between them) gets only the
span of the three runs. Not covered: TP communication, pipeline sends, swap and offload copies
and KV transfers (priced apart, not scaled) and the workload's own randomness (another seed).

The real executor measures its steps: its runs get no error bars.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sim.errors import ConfigError, require

log = logging.getLogger(__name__)

#: summary.json figures that get ``<name>_lo`` / ``<name>_hi`` beside them.
HEADLINE: tuple[str, ...] = (
    "request_throughput", "output_throughput", "total_token_throughput", "duration",
    "request_goodput",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "p90", "p99")))


@dataclass(frozen=True)
class ErrorBarsConfig:
    """The ``error_bars`` config section (conf/config.yaml)."""

    enabled: bool = True
    step_time: tuple[float, float] | None = None  # [low, high] factors; None: measured
    roofline_step_time: tuple[float, float] = (0.859, 1.271)

    @classmethod
    def from_dict(cls, section: Any) -> ErrorBarsConfig:
        if section is None:
            return cls(enabled=False)
        if not isinstance(section, dict):
            raise ConfigError("error_bars", f"must be a mapping (enabled, step_time, "
                              f"roofline_step_time) or null, got {section!r}")
        known = {"enabled", "step_time", "roofline_step_time"}
        for key in section:
            require(key in known, f"error_bars.{key}",
                    f"unknown option; known: {', '.join(sorted(known))}")
        enabled = section.get("enabled", True)
        require(isinstance(enabled, bool), "error_bars.enabled",
                f"must be true or false, got {enabled!r}")
        step_time = section.get("step_time")
        roofline = section.get("roofline_step_time", cls.roofline_step_time)
        return cls(enabled,
                   None if step_time is None else _factors(step_time, "error_bars.step_time"),
                   _factors(roofline, "error_bars.roofline_step_time"))


def _factors(value: Any, field: str) -> tuple[float, float]:
    """A [low, high] pair of step-time factors, finite, > 0 and in order (the pair need not
    hold 1: a biased cost model's interval lies beside it)."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    require(ok, field, f"must be [low, high] step-time factors, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    require(all(math.isfinite(v) and 0 < v <= 100 for v in (lo, hi)), field,
            f"factors must be finite numbers in (0, 100], got {value!r}")
    require(lo <= hi, field, f"low must be <= high, got {value!r}")
    return lo, hi


def step_time_interval(cfg: dict[str, Any], bars: ErrorBarsConfig,
                       ) -> tuple[float, float, str] | None:
    """(low, high, where it comes from) of the run's step-time factor, or None for no error
    bars (turned off, or an executor that measures its steps). Checked before the run: the
    ends' factors times ``executor.step_time_factor`` must be factors the cost model takes."""
    # Imported here: the cost model (numpy and the executors) is not needed to start the
    # main job's command, whose OBJECTIVES are made of HEADLINE.
    from executors.cost_model import MAX_STEP_TIME_FACTOR

    interval = _step_time_interval(cfg, bars)
    if interval is not None:
        base = (cfg.get("executor") or {}).get("step_time_factor", 1.0)
        if isinstance(base, (int, float)) and not isinstance(base, bool):
            require(base * interval[1] <= MAX_STEP_TIME_FACTOR, "executor.step_time_factor",
                    f"{base} x the error bars' high end {interval[1]} exceeds "
                    f"{MAX_STEP_TIME_FACTOR:g}; lower it or set error_bars.enabled=false")
    return interval


def _step_time_interval(cfg: dict[str, Any], bars: ErrorBarsConfig,
                        ) -> tuple[float, float, str] | None:
    executor = cfg.get("executor") or {}
    if not bars.enabled or executor.get("name", "cost_model") != "cost_model":
        return None
    if bars.step_time is not None:
        return (*bars.step_time, "error_bars.step_time")
    profile = executor.get("profile")
    if profile is None:
        return (*bars.roofline_step_time, "roofline")
    from executors.calibration import load_profile

    interval = load_profile(profile).fit.get("step_time_interval")
    if not isinstance(interval, dict) or not {"lo", "hi"} <= set(interval):
        raise ConfigError("executor.profile", (
            f"{profile} has no fit.step_time_interval for error bars; refit it with "
            f"python -m experiments.calibrate, or set error_bars.step_time or "
            f"error_bars.enabled=false"))
    lo, hi = _factors([interval["lo"], interval["hi"]],
                      f"executor.profile ({profile}): fit.step_time_interval")
    return lo, hi, str(profile)


def _simulate(cfg: dict[str, Any]) -> dict[str, Any]:
    from experiments.simulation import Simulation

    return Simulation(cfg, None).run().summary


def with_intervals(cfg: dict[str, Any], summary: dict[str, Any],
                   simulate: Callable[[dict[str, Any]], dict[str, Any]] = _simulate,
                   ) -> dict[str, Any]:
    """``summary`` with ``<figure>_lo`` / ``_hi`` after each ``HEADLINE`` figure and the
    interval's provenance (``error_bars_*``); unchanged where the run gets no error bars.
    Runs the configuration twice more through ``simulate`` (config -> summary; default: the
    built-in components, without outputs)."""
    from executors.uncertainty import LEVEL

    bars = ErrorBarsConfig.from_dict(cfg.get("error_bars"))
    interval = step_time_interval(cfg, bars)
    if interval is None or summary.get("status", "complete") != "complete":
        return summary
    lo, hi, source = interval
    base = float((cfg.get("executor") or {}).get("step_time_factor", 1.0))
    ends = []
    for factor in (lo, hi):
        run_cfg = copy.deepcopy(cfg)
        run_cfg.setdefault("executor", {})["step_time_factor"] = base * factor
        run_cfg.update(record_steps=False, progress=False)
        log.debug("error bars: the run with every step time x%.3f", factor)
        ends.append(simulate(run_cfg))
    out: dict[str, Any] = {}
    for key, value in summary.items():
        out[key] = value
        if key in HEADLINE and isinstance(value, (int, float)):
            # The run itself is one of the interval's points only if its factor (1) is.
            values = [e[key] for e in ends if isinstance(e.get(key), (int, float))]
            if lo <= 1.0 <= hi or not values:
                values.append(value)
            out[f"{key}_lo"], out[f"{key}_hi"] = min(values), max(values)
    out.update(error_bars_level=LEVEL, error_bars_step_time_lo=lo, error_bars_step_time_hi=hi,
               error_bars_source=source)
    return out
