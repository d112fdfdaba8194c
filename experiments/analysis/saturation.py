"""The saturation throughput of a serving configuration, and an offered load near it.

``experiments/validate.py`` with ``validate.qps: auto`` validates at
``validate.saturation_fraction`` (default 0.85) of the rate this finds, instead of a hand-picked
``workload.qps``. Two probe runs of the validated workload (its requests, lengths and seed;
only the arrival rate differs), each measured as completed requests / makespan (the first
arrival to the last completion, ``summary.json``'s ``request_throughput``):

1. every request offered at once (``BURST_QPS``): the capacity with full batches from the
   first step, an upper bound (nothing arrives late, nothing waits for work);
2. that capacity offered as the workload's own arrival process: more than the server keeps up
   with (it served fewer per second than offered in every run measured), so the rate it
   serves is the saturation throughput. This is how ``docs/calibration.md`` measured the CPU
   by hand: offered 120 req/s, served ~107; the validation ran at 90 (0.84 of it).

With a finite workload (300 requests) the second run's rate is below the first's: arrivals
spread over its first part, and the last requests drain at small batches. That is the rate
this workload sustains, which is what "near saturation" is relative to.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sim.errors import ConfigError, require

log = logging.getLogger(__name__)

#: The first probe's offered load: every request arrives within a microsecond or so.
BURST_QPS = 1e9
#: ``validate.saturation_fraction``'s default: the CPU validation's hand choice was 90 req/s
#: against ~107 served at saturation (0.84).
DEFAULT_FRACTION = 0.85
#: A second probe serving at least this share of its offered load was not over capacity.
KEPT_UP = 0.98

#: One probe: run ``cfg`` (a main-job config) with its outputs in the folder; its summary.
RunFn = Callable[[dict[str, Any], Path], dict[str, Any]]


@dataclass(frozen=True)
class Probe:
    """One saturation probe: the offered and the served rate of one run."""

    offered_qps: float
    completed: int
    makespan_s: float  # first arrival to last completion
    throughput: float  # completed / makespan (req/s)
    num_preemptions: int


@dataclass(frozen=True)
class Saturation:
    """The probes in order; the last one's throughput is the saturation throughput."""

    probes: tuple[Probe, ...]
    fraction: float

    @property
    def throughput(self) -> float:
        return self.probes[-1].throughput

    @property
    def qps(self) -> float:
        """The offered load the validation runs at."""
        return self.fraction * self.throughput

    def as_dict(self) -> dict[str, Any]:
        return {"saturation_throughput": self.throughput, "fraction": self.fraction,
                "qps": self.qps, "probes": [asdict(p) for p in self.probes]}

    def describe(self) -> str:
        first, last = self.probes[0], self.probes[-1]
        return (f"qps auto: all {first.completed} requests at once served "
                f"{first.throughput:.2f} req/s; offered {last.offered_qps:.2f} req/s, served "
                f"{last.throughput:.2f} req/s (saturation); validated at {self.fraction:g} x "
                f"{last.throughput:.2f} = {self.qps:.2f} req/s")


def check_fraction(value: Any) -> float:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1,
            "validate.saturation_fraction", f"must be in (0, 1], got {value!r}")
    return float(value)


def probe(cfg: dict[str, Any], qps: float, run: RunFn, out_dir: Path) -> Probe:
    """Run ``cfg`` offered at ``qps``; its served rate."""
    c = copy.deepcopy(cfg)
    c["workload"]["qps"] = float(qps)
    s = run(c, out_dir)
    completed = int(s["completed"])
    rate = float(s["request_throughput"])
    if completed == 0 or rate <= 0:
        raise ConfigError("validate.qps", f"the saturation probe at {qps:g} req/s completed "
                                          f"{completed} requests (outputs in {out_dir}): no "
                                          f"throughput to measure")
    return Probe(float(qps), completed, completed / rate, rate, int(s.get("num_preemptions", 0)))


def find_saturation(cfg: dict[str, Any], run: RunFn, out_dir: Path,
                    fraction: float = DEFAULT_FRACTION) -> Saturation:
    """The two probes of the module doc, in ``out_dir/saturation`` and ``saturation_2``."""
    fraction = check_fraction(fraction)
    require(cfg.get("workload", {}).get("name") == "synthetic", "validate.qps",
            "auto needs a synthetic workload (its arrival rate is workload.qps); a trace "
            "replays its own arrival times")
    burst = probe(cfg, BURST_QPS, run, out_dir / "saturation")
    log.info("saturation probe 1: every request at once: %d in %.3f s, %.2f req/s",
             burst.completed, burst.makespan_s, burst.throughput)
    served = probe(cfg, burst.throughput, run, out_dir / "saturation_2")
    log.info("saturation probe 2: offered %.2f req/s, served %.2f req/s",
             served.offered_qps, served.throughput)
    if served.throughput >= KEPT_UP * served.offered_qps:
        log.warning("saturation probe 2 kept up with its offered load (%.2f of %.2f req/s): "
                    "the saturation throughput may be higher than measured",
                    served.throughput, served.offered_qps)
    return Saturation((burst, served), fraction)
