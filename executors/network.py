"""Communication times of tensor and pipeline parallelism: alpha-beta models per world size.

    all_reduce(bytes, t) = latency[t] + 2 (t - 1) / t x bytes / bus_bandwidth[t]   (NCCL ring)
    send_recv(bytes)     = latency + bytes / bandwidth                             (stage -> stage)

The coefficients live in ``conf/network/<hardware>.yaml``, fitted to the NCCL timings Vidur
published (``../shared/profiles/vidur/network``; ``python -m experiments.fit_network``
refits them and prints the error table). A hardware without such a file, or a world size the
file does not list, falls back to the hardware spec's interconnect figures:
``interconnect_latency_us`` and ``interconnect_bandwidth_gbps x interconnect_efficiency``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sim.errors import ConfigError
from sim.specs import CONF_DIR, HardwareSpec

NETWORK_DIR = CONF_DIR / "network"


@dataclass(frozen=True)
class AlphaBeta:
    latency_s: float
    bandwidth: float  # bytes/s (bus bandwidth for all-reduce)

    def time(self, nbytes: float, factor: float = 1.0) -> float:
        return self.latency_s + factor * nbytes / self.bandwidth


def ring_factor(world: int) -> float:
    """Bytes each rank sends per byte of an all-reduce (ring algorithm)."""
    return 2.0 * (world - 1) / world


@dataclass(frozen=True)
class NetworkModel:
    fallback: AlphaBeta
    all_reduce_fits: dict[int, AlphaBeta]
    send_recv_fit: AlphaBeta | None = None
    source: str = "hardware spec"

    def all_reduce(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        ab = self.all_reduce_fits.get(world, self.fallback)
        return ab.time(nbytes, ring_factor(world))

    def send_recv(self, nbytes: float) -> float:
        """One pipeline stage's activations to the next stage (same node)."""
        return (self.send_recv_fit or self.fallback).time(nbytes)


def _ab(data: Any, where: str, bw_key: str) -> AlphaBeta:
    if not isinstance(data, dict) or {"latency_us", bw_key} - set(data):
        raise ConfigError(where, f"needs latency_us and {bw_key}, got {data!r}")
    lat, bw = float(data["latency_us"]), float(data[bw_key])
    if lat < 0 or bw <= 0:
        raise ConfigError(where, f"latency_us must be >= 0 and {bw_key} > 0, got {data!r}")
    return AlphaBeta(lat * 1e-6, bw * 1e9)


def load_network(hardware: HardwareSpec, name: str | None = "auto") -> NetworkModel:
    """``name``: ``auto`` (``conf/network/<hardware.name>.yaml`` if it exists), ``none`` (the
    hardware spec only), or the stem of a file in ``conf/network/``."""
    fallback = AlphaBeta(hardware.interconnect_latency_us * 1e-6,
                         hardware.interconnect_bandwidth_gbps * 1e9
                         * hardware.interconnect_efficiency)
    if name is None or name == "none":
        return NetworkModel(fallback, {})
    known = sorted(p.stem for p in NETWORK_DIR.glob("*.yaml"))
    stem = hardware.name if name == "auto" else name
    if stem not in known:  # compared by name: no path is built from an arbitrary value
        if name == "auto":
            return NetworkModel(fallback, {})
        raise ConfigError("executor.network", f"unknown network {name!r}; known: auto, none, "
                                              f"{', '.join(known)}")
    path: Path = NETWORK_DIR / f"{stem}.yaml"
    fits, send_recv, source = _network_file(path, path.stat().st_mtime_ns)
    return NetworkModel(fallback, dict(fits), send_recv, source)


@functools.lru_cache(maxsize=64)
def _network_file(path: Path, mtime_ns: int) -> tuple[dict[int, AlphaBeta], AlphaBeta | None,
                                                      str]:
    """A network file's all-reduce fits, send/recv fit and source, parsed once per version of
    the file (``mtime_ns``): a cluster builds one cost model per replica."""
    data = yaml.safe_load(path.read_text()) or {}
    where = f"{path.name}"
    fits = {int(w): _ab(v, f"{where}: all_reduce.{w}", "bus_bandwidth_gbps")
            for w, v in (data.get("all_reduce") or {}).items()}
    sr = (data.get("send_recv") or {}).get("intra_node")
    return (fits, _ab(sr, f"{where}: send_recv.intra_node", "bandwidth_gbps") if sr else None,
            str(data.get("source", path.name)))
