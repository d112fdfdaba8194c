"""Helpers the experiment scripts share: run one in-memory simulation from a config dict with
overrides, and score requests against latency SLOs."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from sim.request import Request, RequestStatus
from sim.simulation import Simulation, SimulationResult


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``override`` merged in (mappings recursively)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def simulate(cfg: dict[str, Any]) -> SimulationResult:
    """One full simulation, nothing written to disk, finished/rejected requests kept."""
    cfg = {**cfg, "progress": False}
    return Simulation(cfg, None, keep_requests=True).run()


def slo_attainment(requests: Iterable[Request], total: int, ttft_s: float, tpot_s: float) -> float:
    """DistServe's attainment: the fraction of all ``total`` requests that finished with
    TTFT <= ``ttft_s`` and TPOT <= ``tpot_s`` (a one-token output has no TPOT and meets it);
    rejected requests miss."""
    ok = 0
    for r in requests:
        if r.status is not RequestStatus.FINISHED:
            continue
        tpot = r.tpot
        if r.ttft <= ttft_s and (tpot is None or tpot <= tpot_s):
            ok += 1
    return ok / total
