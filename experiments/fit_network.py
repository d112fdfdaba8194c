"""Fit the alpha-beta communication model to Vidur's NCCL measurements and print the errors.

    python -m experiments.fit_network [--profiles ../shared/profiles/vidur/network]

The folder is resolved as data paths are (the working directory, then the project root).

The ``size`` column of Vidur's collective profiles is in bytes: its profiler allocates ``n`` fp16
elements and records ``size = n * 2  # bytes`` (vidur/profiling/collectives/
collectives_wrapper.py), and its predictor converts with ``size / embedding_dim / 2``. Read as
element counts, the intra-node all-reduce figures would exceed NVLink's peak.

Per (GPU box, world size) the fit minimises the largest relative error over message-size bins:
one bin for everything below 1 MiB (latency-bound, where repeated measurements scatter between
~10 and ~60 us) and one bin per doubling above it, each compared by its median. The printed
coefficients are what ``conf/network/*.yaml`` holds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import minimize

from executors.network import ring_factor
from sim.errors import ConfigError, exit_on_config_error
from workloads.base import resolve_path

MIB = 2**20
BIN_EDGES = (0, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, float("inf"))
BOXES = {"a100_dgx": "a100_80gb", "h100_dgx": "h100_sxm"}


def load(folder: Path, op: str) -> pd.DataFrame:
    """One of Vidur's collective profiles (``<box>/<op>.csv``), its median column renamed."""
    path = folder / f"{op}.csv"
    if not path.is_file():
        raise ConfigError("--profiles", f"{path} is missing (Vidur's network profiles: "
                          "<profiles>/{a100_dgx,h100_dgx}/{all_reduce,send_recv}.csv)")
    df = pd.read_csv(path)
    need = ["size", "num_workers", "devices_per_node", f"time_stats.{op}.median"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ConfigError("--profiles", f"{path}: missing column {missing[0]!r}")
    return df.rename(columns={f"time_stats.{op}.median": "median_ms"})


def size_bins(sizes: np.ndarray) -> list[np.ndarray]:
    """Boolean masks of the bins that hold at least one size."""
    out = []
    for lo, hi in zip(BIN_EDGES[:-1], BIN_EDGES[1:]):
        m = (sizes >= lo) & (sizes < hi)
        if m.any():
            out.append(m)
    return out


def binned_errors(sizes: np.ndarray, measured_s: np.ndarray,
                  predict) -> list[tuple[float, float, float]]:
    """(bin median size, measured median s, relative error of the model's median) per bin."""
    rows = []
    for m in size_bins(sizes):
        meas = float(np.median(measured_s[m]))
        pred = float(np.median(predict(sizes[m])))
        rows.append((float(np.median(sizes[m])), meas, pred / meas - 1.0))
    return rows


def fit(sizes: np.ndarray, measured_s: np.ndarray, factor: float) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) minimising the worst binned log error."""
    def loss(p: np.ndarray) -> float:
        lat, inv_bw = p[0] * 1e-6, p[1] * 1e-12
        if lat < 0 or inv_bw <= 0:
            return 1e9
        errs = binned_errors(sizes, measured_s, lambda s: lat + factor * s * inv_bw)
        return max(abs(np.log1p(e)) for _, _, e in errs)

    best = None
    for lat0 in (5.0, 20.0, 50.0):
        for inv0 in (3.0, 30.0, 100.0):  # ps per byte
            r = minimize(loss, [lat0, inv0], method="Nelder-Mead",
                         options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 4000})
            if best is None or r.fun < best.fun:
                best = r
    return best.x[0] * 1e-6, 1.0 / (best.x[1] * 1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="../shared/profiles/vidur/network")
    args = ap.parse_args()
    with exit_on_config_error():
        fit_all(resolve_path(args.profiles, "--profiles"))


def fit_all(root: Path) -> None:
    """Fit and print every box's all-reduce and send/recv coefficients (see the module doc)."""
    for box, hw in BOXES.items():
        print(f"# {box} -> conf/network/{hw}.yaml")
        ar = load(root / box, "all_reduce")
        for w in (2, 4, 8):
            g = ar[(ar.num_workers == w) & (ar.devices_per_node == w)]
            s, t = g["size"].to_numpy(float), g["median_ms"].to_numpy() * 1e-3
            lat, bw = fit(s, t, ring_factor(w))
            errs = binned_errors(s, t, lambda x: lat + ring_factor(w) * x / bw)
            print(f"  all_reduce {w}: {{latency_us: {lat * 1e6:.1f}, bus_bandwidth_gbps: "
                  f"{bw / 1e9:.1f}}}  max err {100 * max(abs(e) for *_, e in errs):.1f}%  "
                  + " ".join(f"{e * 100:+.0f}" for *_, e in errs))
        sr = load(root / box, "send_recv")
        for label, dpn in (("intra_node", 2), ("inter_node", 1)):
            g = sr[(sr.num_workers == 2) & (sr.devices_per_node == dpn)]
            s, t = g["size"].to_numpy(float), g["median_ms"].to_numpy() * 1e-3
            lat, bw = fit(s, t, 1.0)
            errs = binned_errors(s, t, lambda x: lat + x / bw)
            print(f"  send_recv {label}: {{latency_us: {lat * 1e6:.1f}, bandwidth_gbps: "
                  f"{bw / 1e9:.1f}}}  max err {100 * max(abs(e) for *_, e in errs):.1f}%")


if __name__ == "__main__":
    main()
