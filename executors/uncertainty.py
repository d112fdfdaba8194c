"""How far a priced step time may be from a measured one: the interval behind the error bars.

A prediction's error bar comes from the cost model's own measured error. Its residuals on
measured step times (a calibrated profile's held-out shapes under bootstrap refits, or the
roofline's error on measured operator timings) give the ratio measured / predicted; the
interval is the central ``LEVEL`` of those ratios. A run priced with every step time times
the interval's low and high ratio (``executor.step_time_factor``) bounds what the run's
headline figures would be if the cost model were that far off at the run's shapes
(experiments/intervals.py). Each residual counts as one draw of the run's systematic error:
a run spends its time on a few shapes, so the shape-to-shape error does not average out
across its steps. Held-out serving steps carry their per-step noise too, which a run's many
steps would average out: there the interval errs wide.
"""

from __future__ import annotations

import numpy as np

#: The central share of the ratios an interval covers.
LEVEL = 0.9


def ratio_interval(ratios: np.ndarray, level: float = LEVEL,
                   weights: np.ndarray | None = None) -> tuple[float, float]:
    """The central ``level`` of ``ratios`` (measured / predicted), as (low, high) quantiles,
    each ratio weighted by ``weights`` (default: equally). A biased cost model gets an
    interval that does not hold 1."""
    r = np.asarray(ratios, dtype=float)
    if r.ndim != 1 or not len(r) or np.any(~(r > 0)) or np.any(~np.isfinite(r)):
        raise ValueError("ratios must be a non-empty list of finite numbers > 0")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    w = np.ones_like(r) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != r.shape or np.any(~(w > 0)):
        raise ValueError("weights need one value > 0 per ratio")
    order = np.argsort(r)
    r, w = r[order], w[order]
    # Weighted quantiles at the midpoints of each ratio's share of the total weight.
    cum = (np.cumsum(w) - 0.5 * w) / w.sum()
    tail = 0.5 * (1.0 - level)
    lo, hi = np.interp([tail, 1.0 - tail], cum, r)
    return float(lo), float(hi)
