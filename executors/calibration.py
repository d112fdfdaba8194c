"""Calibrated cost model: fit the roofline's prices to measured step times.

A profile CSV (``PROFILE_COLUMNS``; ``experiments/profile.py`` writes one) has one row per
measured step shape. Each row is rebuilt into a ``StepShape``, decomposed into ``StepDrivers``
(the same decomposition the roofline uses) and the ``Coefficients`` are fitted with scipy:
non-negative least squares for a linear start (knee p = 1, where compute and memory times add),
then bounded ``least_squares`` on relative errors for each knee sharpness p of a small grid,
keeping the p with the lowest error on the rows fitted. The result is saved as a small YAML or
JSON hardware profile that ``executor=cost_model executor.profile=<file>`` loads.

Held-out rows (``split_rows``) are never fitted: ``mape_heldout`` is the honest figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from executors.step_terms import (
    ATTENTION_TILE,
    DRIVER_COLUMNS,
    Coefficients,
    StepDecomposer,
    StepDrivers,
    StepShape,
    driver_matrix,
    predict_array,
    predict_jacobian,
    step_shape,
)
from executors.uncertainty import LEVEL, ratio_interval
from sim.config_types import as_float, as_int
from sim.errors import ConfigError
from sim.plan import ScheduledRequest, StepPlan
from sim.specs import ModelSpec

#: The profile CSV schema (docs/calibration.md, "Profile CSV schema", documents each column).
SHAPE_COLUMNS = ("kind", "batch_size", "num_tokens", "num_prefill_seqs", "prefill_chunk",
                 "prefill_cached", "num_decode_seqs", "decode_context", "num_sampled")
TIMING_COLUMNS = ("warmup", "repeats", "median_s", "mean_s", "std_s", "p10_s", "p90_s", "min_s")
META_COLUMNS = ("model", "device", "dtype", "tensor_parallel", "executor", "attention_tile")
PROFILE_COLUMNS = SHAPE_COLUMNS + TIMING_COLUMNS + META_COLUMNS
KINDS = ("decode", "prefill", "mixed")

SHRINK_TOLERANCE = 1e-3  # percentage points of fit MAPE a shrunk coefficient may cost
SHARPNESS_GRID: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, math.inf)
#: How many of a step's requests may carry the first-requests price (``s_per_first_seq``): on
#: the CPU executor the first few requests of a batch cost ~25% more than the rest (their
#: set-up is amortized over larger batches; docs/calibration.md, "A price for a step's first
#: requests").
SEQ_KNEE_GRID: tuple[int, ...] = (2, 4, 8, 16, 32)
#: ``calibrate(run_level=...)``: the speed a profile refitted on serving runs is left at.
RUN_LEVELS = ("mean", "median")
#: Coefficients only serving steps identify (``calibrate(steps=...)``); a rows-only fit
#: leaves them at 0.
SERVING_ONLY = ("s_per_prefill_row",)
MAX_FIT_STEPS = 4000  # serving steps fitted at most (calibrate(steps=...)): the fit's run time
#: Refits on resampled rows behind a profile's step-time interval (``step_time_interval``).
BOOTSTRAP_FITS = 16


# ---- rows <-> plans ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ShapeSpec:
    """One measured step shape: ``num_prefill_seqs`` chunks of ``prefill_chunk`` new tokens
    over ``prefill_cached`` cached ones, plus ``num_decode_seqs`` decode rows over
    ``decode_context`` cached tokens each. The first ``num_sampled`` rows sample."""

    kind: str
    num_prefill_seqs: int = 0
    prefill_chunk: int = 0
    prefill_cached: int = 0
    num_decode_seqs: int = 0
    decode_context: int = 0
    num_sampled: int | None = None  # None: every row samples

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for f in ("num_prefill_seqs", "prefill_chunk", "prefill_cached", "num_decode_seqs",
                  "decode_context"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
        if self.num_prefill_seqs and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1 when num_prefill_seqs > 0")
        if self.num_decode_seqs and self.decode_context < 1:
            raise ValueError("decode_context must be >= 1 for decode rows (one query over a "
                             "non-empty cache)")
        if self.num_prefill_seqs and self.prefill_chunk == 1 and self.prefill_cached > 0:
            raise ValueError("a 1-token chunk over a non-empty cache is a decode row")
        want = {"decode": (False, True), "prefill": (True, False), "mixed": (True, True)}
        has = (self.num_prefill_seqs > 0, self.num_decode_seqs > 0)
        if has != want[self.kind]:
            raise ValueError(f"kind {self.kind!r} with {self.num_prefill_seqs} prefill and "
                             f"{self.num_decode_seqs} decode rows")
        if self.num_sampled is not None and not 0 <= self.num_sampled <= self.batch_size:
            raise ValueError(f"num_sampled must be in [0, {self.batch_size}], "
                             f"got {self.num_sampled}")

    @property
    def batch_size(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_seqs * self.prefill_chunk + self.num_decode_seqs

    @property
    def sampled(self) -> int:
        return self.batch_size if self.num_sampled is None else self.num_sampled

    def rows(self) -> list[tuple[int, int]]:
        """(start_position, num_new_tokens) per row, prefill rows first."""
        return ([(self.prefill_cached, self.prefill_chunk)] * self.num_prefill_seqs
                + [(self.decode_context, 1)] * self.num_decode_seqs)

    def tokens_per_row(self) -> list[int]:
        """KV slots each row holds after the step."""
        return [start + n for start, n in self.rows()]

    def plan(self, block_tables: Sequence[list[int]] | None = None,
             request_ids: Sequence[int] | None = None) -> StepPlan:
        """The StepPlan of this shape (block tables from a KVBlockManager, or empty)."""
        rows = self.rows()
        ids = list(request_ids) if request_ids is not None else list(range(len(rows)))
        tables = list(block_tables) if block_tables is not None else [[] for _ in rows]
        k = self.sampled
        return StepPlan([ScheduledRequest(rid, start, n, table, i < k)
                         for i, (rid, (start, n), table) in enumerate(zip(ids, rows, tables))])

    def shape(self) -> StepShape:
        return step_shape(self.plan())

    def as_row(self) -> dict[str, Any]:
        return {"kind": self.kind, "batch_size": self.batch_size, "num_tokens": self.num_tokens,
                "num_prefill_seqs": self.num_prefill_seqs, "prefill_chunk": self.prefill_chunk,
                "prefill_cached": self.prefill_cached, "num_decode_seqs": self.num_decode_seqs,
                "decode_context": self.decode_context, "num_sampled": self.sampled}


_INT_SHAPE_COLUMNS = ("num_prefill_seqs", "prefill_chunk", "prefill_cached", "num_decode_seqs",
                      "decode_context", "num_sampled")


def _cell(row: dict[str, Any], col: str, where: str, integer: bool) -> int | float:
    """One numeric cell of a profile row: an integer (or integral float) for ``integer``, else a
    finite number; a numeral string counts (pandas reads a column with one bad cell as text).
    Errors name the column, the file and the line."""
    if col not in row:
        raise ConfigError(f"profile.{col}", f"missing column in {where}")
    value = row[col]
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"profile.{col}", f"{where}: not a number: {row[col]!r}") from None
    try:
        return as_int(value, col) if integer else as_float(value, col)
    except ConfigError as e:  # as_* word it; the file and line are ours to add
        raise ConfigError(f"profile.{col}", f"{where}: {e.message}") from None


def shape_from_row(row: dict[str, Any], where: str) -> ShapeSpec:
    """Rebuild a row's shape, checking its redundant columns (batch_size, num_tokens)."""
    if "kind" not in row:
        raise ConfigError("profile.kind", f"missing column in {where}")
    ints = [int(_cell(row, col, where, integer=True)) for col in _INT_SHAPE_COLUMNS]
    try:
        spec = ShapeSpec(str(row["kind"]), *ints)
    except ValueError as e:
        raise ConfigError("profile", f"{where}: {e}") from None
    for col in ("batch_size", "num_tokens"):
        if _cell(row, col, where, integer=True) != getattr(spec, col):
            raise ConfigError(f"profile.{col}", f"{where}: {row[col]} does not match the "
                              f"shape columns ({getattr(spec, col)})")
    return spec


def read_profile_csv(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a profile CSV, validated (errors name the file, line and column); shape
    columns come back as ints and ``median_s`` as a float, whatever pandas read them as."""
    import pandas as pd

    df = pd.read_csv(path)
    missing = [c for c in SHAPE_COLUMNS + ("median_s",) if c not in df.columns]
    if missing:
        raise ConfigError(f"profile.{missing[0]}", f"missing column in {path}")
    rows = df.to_dict("records")
    for i, row in enumerate(rows):
        where = f"{path} line {i + 2}"
        spec = shape_from_row(row, where)
        row.update({col: getattr(spec, col) for col in SHAPE_COLUMNS[1:]})  # typed, checked
        t = float(_cell(row, "median_s", where, integer=False))
        if not t > 0:
            raise ConfigError("profile.median_s", f"{where}: must be > 0, got {row['median_s']}")
        row["median_s"] = t
    if not rows:
        raise ConfigError("profile", f"{path} has no rows")
    return rows


def split_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Indices (fit, held out): within each kind, rows sorted by shape alternate between the
    two, so the held-out shapes interleave the fitted ones but are never fitted."""
    fit: list[int] = []
    held: list[int] = []
    for kind in KINDS:
        idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
        idx.sort(key=lambda i: tuple(int(rows[i][c]) for c in SHAPE_COLUMNS[1:]))
        fit += idx[0::2]
        held += idx[1::2]
    return sorted(fit), sorted(held)


# ---- fitting ----------------------------------------------------------------------------------
def mape(pred: np.ndarray, y: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(100.0 * np.mean(np.abs(np.asarray(pred) / np.asarray(y) - 1.0)))


@dataclass
class Fit:
    coefficients: Coefficients
    mape_fit: float  # percent, on the rows fitted
    per_sharpness: dict[float, float] = field(default_factory=dict)  # p -> MAPE on the fit rows


def _linear_design(X: np.ndarray, seq_knee: int = 0) -> np.ndarray:
    """Design matrix of the p = 1 model (every knee a sum, so linear in the coefficients): one
    column per coefficient, the prediction with that coefficient 1 and the others 0. A
    coefficient whose column is all zero is not driven by the data and stays 0."""
    eye = np.eye(len(Coefficients.names()))
    return np.column_stack([predict_array(e, X, 1.0, seq_knee) for e in eye])


def fit_coefficients(drivers: Sequence[StepDrivers], y: Sequence[float],
                     sharpness: float | Sequence[float] | None = None,
                     active: Sequence[str] | None = None,
                     scale: Sequence[float] | None = None, loss: str = "soft_l1",
                     seq_knee: int | Sequence[int] | None = None) -> Fit:
    """Fit ``Coefficients`` to measured step seconds ``y`` (relative error is minimised).

    ``sharpness``: one knee p, or a grid to choose from (default ``SHARPNESS_GRID``).
    ``seq_knee``: how many of a step's requests ``s_per_first_seq`` prices, or a grid to
    choose from (default ``SEQ_KNEE_GRID`` when ``s_per_first_seq`` is fitted, else 0).
    ``active``: coefficient names to fit (default: every one whose drivers are non-zero in the
    data); the others are 0.
    ``scale``: each residual is ``(predicted - y) / scale`` (default ``y``: relative error).
    With a fixed scale (e.g. an earlier prediction) and ``loss="linear"`` a shape measured
    many times is fitted at the mean of its times, which skewed noise puts above the median
    that a relative, robust (``soft_l1``) fit lands near.
    """
    # Column-major: the fit reads the design matrix a column at a time (elementwise, so the
    # same floats), thousands of times.
    X = np.asfortranarray(driver_matrix(list(drivers)))
    yv = np.asarray(y, dtype=float)
    if len(yv) != len(X) or not len(yv):
        raise ValueError(f"{len(X)} driver rows for {len(yv)} times")
    if np.any(~(yv > 0)):
        raise ValueError("measured times must be > 0")
    sv = yv if scale is None else np.asarray(scale, dtype=float)
    if sv.shape != yv.shape or np.any(~(sv > 0)):
        raise ValueError("scale needs one value > 0 per time")
    if scale is None:
        def objective(pred: np.ndarray) -> float:  # what the fit and its shrink judge by
            return mape(pred, yv)
    else:
        def objective(pred: np.ndarray) -> float:  # RMS of the scaled residuals, in percent
            return float(100.0 * np.sqrt(np.mean(((pred - yv) / sv) ** 2)))
    grid = SHARPNESS_GRID if sharpness is None else (
        (sharpness,) if isinstance(sharpness, (int, float)) else tuple(sharpness))
    names = Coefficients.names()
    first = names.index("s_per_first_seq")
    # The first-requests price is fitted only where the steps' batch sizes can tell it from
    # the per-request one: some step has more requests than the smallest knee.
    first_on = (active is None or "s_per_first_seq" in active) and (
        float(X[:, DRIVER_COLUMNS.index("rows")].max()) > min(SEQ_KNEE_GRID))
    if seq_knee is None:
        knees: tuple[int, ...] = (0, *SEQ_KNEE_GRID) if first_on else (0,)
    else:
        knees = (seq_knee,) if isinstance(seq_knee, int) else tuple(seq_knee)
    # The knee: the sharpness is chosen without one, then each knee of the grid is fitted at
    # that sharpness and judged by its sum of squared scaled residuals; a knee is one more
    # price and has to earn it (``_knee_earns_its_price``), so data without the shape keep
    # seq_knee 0.
    fits: dict[int, tuple[float, np.ndarray, np.ndarray]] = {}
    per: dict[float, float] = {}
    for knee in knees:
        A = _linear_design(X, knee)
        on = _active_columns(A, active)
        if not knee:
            on[first] = False
        x_lin = _linear_start(A, yv, sv, on)
        at = _fit_at_knee(X, yv, sv, knee, on, x_lin, A, grid, loss, objective)
        if not fits:  # the first knee tried chooses the sharpness for all of them
            per = {q: e for q, (e, _) in at.items()}
            chosen = grid[0]
            for q in grid[1:]:  # a later sharpness has to be better, not equal
                if at[q][0] < at[chosen][0] - 1e-9:
                    chosen = q
            grid = (chosen,)
        p = grid[0]
        x = at[p][1]
        fits[knee] = (float(np.sum(((predict_array(x, X, p, knee) - yv) / sv) ** 2)), x, on)
    knee = min(knees, key=lambda k: fits[k][0])
    if knee and 0 in fits and not _knee_earns_its_price(fits[0][0], fits[knee][0], len(yv)):
        knee = 0
    _, x, on = fits[knee]
    x = _shrink(x, X, p, knee, on, objective)
    if knee and x[first] == 0.0:
        knee = 0  # no first-requests price: nothing for a knee to place
    err = mape(predict_array(x, X, p, knee), yv)
    return Fit(Coefficients(**dict(zip(names, map(float, x))), sharpness=p, seq_knee=knee),
               err, per)


def _knee_earns_its_price(rss_without: float, rss_with: float, n: int) -> bool:
    """Whether a seq_knee's extra price lowers the squared error enough to keep: by the
    Bayesian information criterion (n ln(RSS ratio) below -ln n, one more parameter), and by
    more than rounding (0.001% of the times, root mean square)."""
    if rss_with >= rss_without:
        return False
    bic_gain = n * math.log(rss_with / rss_without) < -math.log(n) if rss_with > 0 else True
    return bic_gain and math.sqrt(rss_without / n) - math.sqrt(rss_with / n) > 1e-5


def _active_columns(A: np.ndarray, active: Sequence[str] | None) -> np.ndarray:
    """Which coefficients a fit varies: those named (default all) whose drivers the data has
    (``A``: ``_linear_design``)."""
    names = Coefficients.names()
    present = np.any(A != 0, axis=0)
    return present if active is None else np.array([n in active for n in names]) & present


def _linear_start(A: np.ndarray, yv: np.ndarray, sv: np.ndarray,
                  on: np.ndarray) -> np.ndarray:
    """Prices of the additive (p = 1) model (design matrix ``A``) by NNLS, each row divided
    by its scale and aimed at 1 (the relative error when the scale is the time itself; with
    another scale, a start near it): the nonlinear fit's start. (The fit is ill-conditioned
    on a CPU profile, where per-step, per-token and weight-byte prices are nearly collinear:
    another start of equal quality moves single prices by tens of percent and predictions by
    ~0.003%, so only predictions are stable between fits.)"""
    from scipy.optimize import nnls

    x_lin = np.zeros(A.shape[1])
    x_lin[on], _ = nnls(A[:, on] * (1.0 / sv)[:, None], np.ones_like(yv))
    return x_lin


def _prices(z: np.ndarray, idx: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The whole price vector (``Coefficients.names()`` order) of a solver's variables ``z``:
    the prices ``idx`` the fit varies, each in units of its ``scale``; the others 0."""
    x = np.zeros(len(scale))
    x[idx] = z * scale[idx]
    return x


def _fit_at_knee(X: np.ndarray, yv: np.ndarray, sv: np.ndarray, seq_knee: int,
                 on: np.ndarray, x_lin: np.ndarray, A: np.ndarray, grid: tuple[float, ...],
                 loss: str, objective: Callable[[np.ndarray], float],
                 ) -> dict[float, tuple[float, np.ndarray]]:
    """The best fit (objective, prices) at each sharpness of ``grid`` for one ``seq_knee``,
    started from its linear fit ``x_lin`` (design matrix ``A``)."""
    from scipy.optimize import least_squares

    names = Coefficients.names()
    # Scales: each coefficient's "one-row" size, so the solver works on O(1) numbers.
    typical = np.array([np.median(yv) / max(np.median(A[:, j][A[:, j] > 0]), 1e-300)
                        if on[j] else 1.0 for j in range(len(names))])
    scale = np.where(x_lin > 0, x_lin, typical * 1e-2)
    out: dict[float, tuple[float, np.ndarray]] = {}
    # Only the active coefficients are the solver's variables (an inactive one has no
    # residual gradient, but would still enter the solver's step and stopping rules).
    idx = np.flatnonzero(on)
    starts = [np.ones(len(idx)), np.where(x_lin[idx] > 0, 1.0, 10.0)]
    for p in grid:
        best_p: tuple[float, np.ndarray] | None = None
        for z0 in starts:
            def resid(z: np.ndarray, p: float = p) -> np.ndarray:
                return (predict_array(_prices(z, idx, scale), X, p, seq_knee) - yv) / sv

            def jac(z: np.ndarray, p: float = p) -> np.ndarray:
                return (predict_jacobian(_prices(z, idx, scale), X, p, seq_knee, idx)
                        * (scale[idx] / sv[:, None]))

            r = least_squares(resid, z0, jac=jac, bounds=(0.0, np.inf), x_scale=1.0,
                              loss=loss, f_scale=0.05, max_nfev=2000)
            x = _prices(r.x, idx, scale)
            err = objective(predict_array(x, X, p, seq_knee))
            if best_p is None or err < best_p[0]:
                best_p = (err, x)
        assert best_p is not None
        out[p] = best_p
    return out


def _shrink(x: np.ndarray, X: np.ndarray, p: float, seq_knee: int, on: np.ndarray,
            objective: Callable[[np.ndarray], float]) -> np.ndarray:
    """Lower each coefficient as far as the fit allows (``SHRINK_TOLERANCE``).

    A bound that never binds on the profiled shapes (e.g. one decode block's streaming rate
    when no shape leaves a block alone on its SM) is not identified: any value below where it
    starts to bind fits equally well, and a large one would bind on shapes outside the
    profile. The smallest value that fits keeps it out of the way; an identified coefficient
    barely moves (lowering it costs fit error at once)."""
    x = x.copy()
    limit = objective(predict_array(x, X, p, seq_knee)) + SHRINK_TOLERANCE
    for j in np.flatnonzero(on & (x > 0)):
        lo, hi = 0.0, x[j]
        for _ in range(40):
            x[j] = lo if lo == 0.0 and _ == 0 else 0.5 * (lo + hi)
            if objective(predict_array(x, X, p, seq_knee)) <= limit:
                hi = x[j]
                if hi == 0.0:
                    break
            else:
                lo = x[j]
            if hi - lo <= 1e-4 * hi:
                break
        x[j] = hi
    return x


def predict(coefficients: Coefficients, drivers: Sequence[StepDrivers]) -> np.ndarray:
    """Seconds per row (without communication and swap)."""
    x = np.array([getattr(coefficients, n) for n in Coefficients.names()])
    return predict_array(x, driver_matrix(list(drivers)), coefficients.sharpness,
                         coefficients.seq_knee)


# ---- hardware profiles ------------------------------------------------------------------------
@dataclass
class HardwareProfile:
    """Fitted coefficients for one (model, device, dtype, tensor_parallel)."""

    model: str
    device: str
    dtype: str
    tensor_parallel: int
    coefficients: Coefficients
    fit: dict[str, Any] = field(default_factory=dict)  # rows, MAPE on fit / held-out rows
    source: str = ""

    def decomposition(self) -> dict[str, Any]:
        """How the fit decomposed steps (``StepDecomposer``'s keyword arguments but the SM
        count), as a cost model must too; profiles saved before an option load with what they
        were fitted with: 64-row query tiles, the ``fill`` split rule, ``waves`` placement."""
        fit = self.fit
        return {"attention_tile": int(fit.get("attention_tile", ATTENTION_TILE)),
                "split_rule": str(fit.get("attention_split_rule", "fill")),
                "split_kv_len": fit.get("attention_split_kv_len"),
                "decode_placement": str(fit.get("attention_decode_placement", "waves"))}

    def to_dict(self) -> dict[str, Any]:
        c = self.coefficients.as_dict()
        if math.isinf(c["sharpness"]):
            c["sharpness"] = None  # YAML/JSON have no portable infinity; null means max()
        return {"model": self.model, "device": self.device, "dtype": self.dtype,
                "tensor_parallel": self.tensor_parallel, "coefficients": c, "fit": self.fit,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> HardwareProfile:
        if not isinstance(data, dict):
            raise ConfigError("executor.profile", f"{where}: not a mapping")
        for key in ("model", "device", "tensor_parallel", "coefficients"):
            if key not in data:
                raise ConfigError("executor.profile", f"{where}: missing key {key!r}")
        raw = dict(data["coefficients"] or {})
        unknown = sorted(set(raw) - set(Coefficients.names()) - set(Coefficients.SHAPE_FIELDS))
        if unknown:
            raise ConfigError("executor.profile",
                              f"{where}: unknown coefficient {unknown[0]!r}; known: "
                              f"{', '.join(Coefficients.names() + list(Coefficients.SHAPE_FIELDS))}")
        if raw.get("sharpness") is None:
            raw["sharpness"] = math.inf
        knee = raw.pop("seq_knee", 0)
        if isinstance(knee, bool) or not isinstance(knee, int):
            raise ConfigError("executor.profile",
                              f"{where}: seq_knee must be an integer >= 0, got {knee!r}")
        try:
            coeffs = Coefficients(**{k: float(v) for k, v in raw.items()}, seq_knee=knee)
        except (TypeError, ValueError) as e:
            raise ConfigError("executor.profile", f"{where}: {e}") from None
        return cls(str(data["model"]), str(data["device"]), str(data.get("dtype", "")),
                   int(data["tensor_parallel"]), coeffs, dict(data.get("fit") or {}),
                   str(data.get("source", "")))


def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    """Write YAML, or JSON when the name ends in .json."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = profile.to_dict()
    with path.open("w") as f:
        if path.suffix == ".json":
            json.dump(data, f, indent=2)
            f.write("\n")
        else:
            yaml.safe_dump(data, f, sort_keys=False)
    return path


def load_profile(path: str | Path) -> HardwareProfile:
    from workloads.base import resolve_path

    p = resolve_path(str(path), "executor.profile", file=True)
    try:
        with p.open(encoding="utf-8") as f:
            data = json.load(f) if p.suffix == ".json" else yaml.safe_load(f)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError("executor.profile", f"{p}: cannot parse: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError("executor.profile", f"{p}: not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    except OSError as e:
        raise ConfigError("executor.profile", f"{p}: {e.strerror or e}") from None
    return HardwareProfile.from_dict(data, str(p))


def load_profile_for(path: str | Path, model: ModelSpec, tensor_parallel: int) -> HardwareProfile:
    """Load a profile and check it was measured for this model and tensor parallelism."""
    prof = load_profile(path)
    if prof.model != model.name:
        raise ConfigError("executor.profile", f"{path} was fitted for model {prof.model!r}, "
                          f"this run uses {model.name!r}")
    if prof.tensor_parallel != tensor_parallel:
        raise ConfigError("executor.profile", f"{path} was fitted at tensor_parallel="
                          f"{prof.tensor_parallel}, this run uses {tensor_parallel}")
    return prof


def calibrate(rows: Sequence[dict[str, Any]], model: ModelSpec, tensor_parallel: int = 1,
              block_size: int = 16, source: str = "",
              sharpness: float | Sequence[float] | None = None,
              num_sms: int | None = None,
              steps: Sequence[tuple[StepShape, float]] = (),
              statistic: str = "median_s",
              attention_tile: int = ATTENTION_TILE, split_rule: str = "fill",
              split_kv_len: int | None = None,
              decode_placement: str = "launch",
              seq_knee: int | Sequence[int] | None = None,
              step_runs: Sequence[int] | None = None,
              run_level: str = "mean") -> HardwareProfile:
    """Fit a profile to CSV rows (``read_profile_csv``), holding out half the shapes.

    ``seq_knee``: how many of a step's requests carry the first-requests price, or a grid to
    choose from (``fit_coefficients``; default: none or one of ``SEQ_KNEE_GRID``, chosen by
    each fit).

    ``num_sms``: the profiled GPU's SM count (decode attention waves); None (a CPU, or
    unknown) runs every decode thread block in one wave. It is saved with the profile so that
    the cost model decomposes steps exactly as the fit did.

    ``attention_tile``: the query tile prefill attention runs in (``StepDecomposer``; 1 for
    untiled attention, e.g. the real executor's torch kernels on a CPU); saved like ``num_sms``.

    ``split_rule``, ``split_kv_len``: how the profiled decode kernel splits the KV
    (``StepDecomposer``: ``fill``, the generic rule, or ``flash``, FlashAttention's heuristic,
    over a block table of ``split_kv_len`` tokens); saved like ``num_sms``. Profiles saved
    without them were fitted with ``fill`` and load that way. ``decode_placement``: where the
    ``flash`` rule's blocks run (``StepDecomposer``); saved too, and profiles saved without it
    load with ``waves``, the geometry they were fitted with.

    ``statistic``: the timing column fitted, ``median_s`` (robust to outliers) or ``mean_s``
    (what a simulated clock that sums step times needs when step times are skewed by
    interference: on a shared CPU host the mean runs 1 to 3% above the median).

    ``steps``: (shape, measured seconds) of steps recorded in serving runs
    (``executors.recording``), fitted alongside the rows: every other step in recorded order,
    the rest held out (``mape_steps_heldout_pct``, ``busy_steps_heldout_pct``: the summed
    time's error). A profile measures each shape in isolation; in a serving run the steps
    follow the scheduler's host work, which on a CPU device evicts the step's working set from
    the core's caches (docs/calibration.md, "CPU validation"), and only such steps show it.

    ``step_runs``: the serving run each step came from, and ``run_level`` the speed the
    profile is left at: ``mean`` (as fitted: the runs' steps pooled) or ``median`` (every
    price scaled by the median of the runs' measured / predicted summed step times, so that
    the median run is priced at its own speed; with an even count, between the two middle
    runs). On a shared
    host a slow patch inflates a few runs' steps; the pooled fit follows it, while a comparison
    with the median of several real runs does not (docs/calibration.md, "The calibration runs'
    median speed"). Each run's measured / predicted summed time before the scaling is saved as
    ``fit.run_speeds``.
    """
    if run_level not in RUN_LEVELS:
        raise ConfigError("run_level", f"must be one of {', '.join(RUN_LEVELS)}, got "
                          f"{run_level!r}")
    if step_runs is not None and len(step_runs) != len(steps):
        raise ValueError(f"{len(step_runs)} run indices for {len(steps)} steps")
    try:
        dec = StepDecomposer(model, tensor_parallel, block_size, num_sms,
                             attention_tile=attention_tile, split_rule=split_rule,
                             split_kv_len=split_kv_len, decode_placement=decode_placement)
    except ValueError as e:
        raise ConfigError(str(e).split(" ", 1)[0], str(e)) from None
    drivers = [dec.drivers(shape_from_row(r, f"row {i}").shape()) for i, r in enumerate(rows)]
    if statistic not in ("median_s", "mean_s"):
        raise ConfigError("statistic", f"must be median_s or mean_s, got {statistic!r}")
    y = np.array([float(r[statistic]) for r in rows])
    if np.any(~(y > 0)):
        raise ConfigError(f"profile.{statistic}", "every row needs a time > 0")
    fit_idx, held_idx = split_rows(rows)
    if not held_idx:
        fit_idx = held_idx = list(range(len(rows)))  # a single shape: nothing to hold out
    step_drivers = [dec.drivers(shape) for shape, _ in steps]
    step_y = np.array([float(t) for _, t in steps])
    if np.any(~(step_y > 0)):
        raise ValueError("recorded step times must be > 0")
    step_fit = list(range(0, len(steps), 2))
    step_fit = step_fit[::-(-len(step_fit) // MAX_FIT_STEPS)] if step_fit else step_fit
    step_held = list(range(1, len(steps), 2)) or step_fit
    rows_x = [drivers[i] for i in fit_idx]
    # The per prompt row cost shows in serving steps only: a profile's warm one-row prompts
    # cannot tell it from the per-kernel floor.
    f = fit_coefficients(rows_x, y[fit_idx], sharpness,
                         active=[n for n in Coefficients.names() if n not in SERVING_ONLY],
                         seq_knee=seq_knee)
    fitted = (rows_x, y[fit_idx], y[fit_idx], "soft_l1")  # drivers, times, scales, loss
    if steps:
        # Steps are single noisy measurements, fitted at their mean (the simulated clock sums
        # them): absolute residuals over the rows-only fit's prediction, least squares.
        steps_x = [step_drivers[i] for i in step_fit]
        guess = predict(f.coefficients, steps_x)
        fitted = (rows_x + steps_x, np.concatenate([y[fit_idx], step_y[step_fit]]),
                  np.concatenate([y[fit_idx], guess]), "linear")
        f = fit_coefficients(fitted[0], fitted[1], sharpness, scale=fitted[2],
                             loss="linear", seq_knee=seq_knee)
    coefficients, level, run_scale = f.coefficients, {}, 1.0
    if steps and step_runs is not None:
        speeds = run_speeds(predict(coefficients, step_drivers), step_y, step_runs)
        level = {"run_level": run_level, "run_speeds": [round(v, 5) for v in speeds.values()]}
        if run_level == "median":
            run_scale = float(np.median(list(speeds.values())))
            coefficients = coefficients.scaled(run_scale)
            level["run_level_scale"] = round(run_scale, 6)
    pred = predict(coefficients, drivers)
    first = rows[0]
    fit = {"rows_fit": len(fit_idx), "rows_heldout": len(held_idx),
           "mape_fit_pct": round(mape(pred[fit_idx], y[fit_idx]), 3),
           "mape_heldout_pct": round(mape(pred[held_idx], y[held_idx]), 3),
           "num_sms": num_sms, "attention_tile": attention_tile, "statistic": statistic,
           "attention_split_rule": split_rule, "attention_split_kv_len": split_kv_len,
           "attention_decode_placement": decode_placement}
    fit.update(level)
    # The held-out times the interval is judged on: serving steps where there are some (the
    # shapes a run prices), else the profile's held-out rows.
    if steps:
        held_x, held_y = [step_drivers[i] for i in step_held], step_y[step_held]
    else:
        held_x, held_y = [drivers[i] for i in held_idx], y[held_idx]
    lo, hi = bootstrap_interval(f.coefficients, *fitted, held_x, held_y, run_scale)
    fit["step_time_interval"] = {"level": LEVEL, "lo": round(lo, 4), "hi": round(hi, 4),
                                 "bootstrap_fits": BOOTSTRAP_FITS, "heldout": len(held_y)}
    if steps:
        sp = predict(coefficients, [step_drivers[i] for i in step_held])
        sy = step_y[step_held]
        fit.update({"steps_fit": len(step_fit), "steps_heldout": len(step_held),
                    "mape_steps_heldout_pct": round(mape(sp, sy), 3),
                    "busy_steps_heldout_pct": round(float(100.0 * (sp.sum() / sy.sum() - 1.0)), 3)})
    return HardwareProfile(
        model=model.name, device=str(first.get("device", "")), dtype=str(first.get("dtype", "")),
        tensor_parallel=tensor_parallel, coefficients=coefficients, fit=fit, source=source)


def bootstrap_interval(coefficients: Coefficients, drivers: Sequence[StepDrivers],
                       y: np.ndarray, scale: np.ndarray, loss: str,
                       held_drivers: Sequence[StepDrivers], held_y: np.ndarray,
                       level_factor: float = 1.0, fits: int = BOOTSTRAP_FITS,
                       seed: int = 0) -> tuple[float, float]:
    """The ``LEVEL`` interval of measured / predicted held-out time over ``fits`` refits of
    ``coefficients`` to the fitted rows resampled with replacement (their knee kept, the
    loss and scales of the fit, started from its prices), the predictions times
    ``level_factor`` (a run-level scaling applied after the fit). The ratios of all refits
    are pooled: the residuals' spread and the coefficients' spread in one interval."""
    from scipy.optimize import least_squares

    names = Coefficients.names()
    x0 = np.array([getattr(coefficients, n) for n in names])
    idx = np.flatnonzero(x0 > 0)  # the prices the fit kept; the others stay 0
    p, knee = coefficients.sharpness, coefficients.seq_knee
    X, Xh = driver_matrix(list(drivers)), driver_matrix(list(held_drivers))
    rng = np.random.default_rng(seed)
    ratios = []
    def resid(z: np.ndarray, Xb: np.ndarray, yb: np.ndarray, sb: np.ndarray) -> np.ndarray:
        return (predict_array(_prices(z, idx, x0), Xb, p, knee) - yb) / sb

    def jac(z: np.ndarray, Xb: np.ndarray, yb: np.ndarray, sb: np.ndarray) -> np.ndarray:
        return predict_jacobian(_prices(z, idx, x0), Xb, p, knee, idx) * (x0[idx] / sb[:, None])

    for _ in range(fits):
        pick = rng.integers(0, len(y), len(y))
        r = least_squares(resid, np.ones(len(idx)), jac=jac, bounds=(0.0, np.inf), loss=loss,
                          f_scale=0.05, max_nfev=200, args=(X[pick], y[pick], scale[pick]))
        x = _prices(r.x, idx, x0)
        ratios.append(held_y / (predict_array(x, Xh, p, knee) * level_factor))
    return ratio_interval(np.concatenate(ratios))


def run_speeds(predicted: np.ndarray, measured: np.ndarray, runs: Sequence[int],
               ) -> dict[int, float]:
    """Each run's measured / predicted summed step time, by run (in order of first step)."""
    out: dict[int, list[float]] = {}
    for run, p, m in zip(runs, predicted.tolist(), measured.tolist()):
        acc = out.setdefault(int(run), [0.0, 0.0])
        acc[0] += m
        acc[1] += p
    return {run: m / p for run, (m, p) in out.items()}
