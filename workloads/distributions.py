"""Seeded samplers for inter-arrival gaps and token lengths, drawn in vectorized chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.config_types import typed_fields
from sim.errors import ConfigError, require
from sim.specs import MODEL_SIZE_LIMITS


# ---- arrivals -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArrivalProcess:
    """Inter-arrival gaps for a target rate ``qps``.

    ``poisson``: exponential gaps (CV 1). ``gamma``: Gamma gaps with the given coefficient of
    variation (CV > 1 is burstier than Poisson). ``constant``: evenly spaced.
    """

    kind: str
    qps: float
    cv: float = 1.0

    def __post_init__(self) -> None:
        require(self.kind in ("poisson", "gamma", "constant"), "workload.arrival",
                f"must be poisson, gamma or constant, got {self.kind!r}")
        require(self.qps > 0, "workload.qps", f"must be > 0, got {self.qps}")
        # Gamma shapes 1 / cv^2 below 1e-4 draw gaps that mostly underflow to 0.
        require(0 < self.cv <= 100, "workload.cv", f"must be in (0, 100], got {self.cv}")

    def gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mean = 1.0 / self.qps
        if self.kind == "poisson":
            return rng.exponential(mean, n)
        if self.kind == "gamma":
            shape = 1.0 / (self.cv**2)
            return rng.gamma(shape, mean / shape, n)
        return np.full(n, mean)


# ---- lengths --------------------------------------------------------------------------------
# The longest length a distribution may draw: model.max_model_len's bound (sim/specs.py).
MAX_LENGTH = MODEL_SIZE_LIMITS["max_model_len"]


@dataclass(frozen=True)
class LengthDistribution:
    """Token-length sampler.

    ``fixed`` {value}; ``uniform`` {min, max} (inclusive); ``lognormal`` {median, sigma, min,
    max}; ``zipf`` {a, min, max}: P(k) proportional to (k - min + 1)^-a on [min, max].
    Samples are clipped to [min, max] and are integers >= 1.
    """

    field: str  # dotted config name, for error messages
    dist: str
    value: int = 0
    median: float = 0.0
    sigma: float = 0.0
    a: float = 0.0
    min: int = 1
    max: int = 1

    @staticmethod
    def from_dict(field: str, data: dict[str, Any]) -> LengthDistribution:
        if not isinstance(data, dict):
            raise ConfigError(field, f"must be a mapping such as {{dist: uniform, min: 1, max: "
                                     f"100}}, got {data!r}")
        data = dict(data)
        dist = data.pop("dist", None)
        known = {"fixed": {"value"}, "uniform": {"min", "max"},
                 "lognormal": {"median", "sigma", "min", "max"}, "zipf": {"a", "min", "max"}}
        if not isinstance(dist, str) or dist not in known:
            raise ConfigError(f"{field}.dist", f"must be one of {sorted(known)}, got {dist!r}")
        every = set().union(*known.values())
        extra = sorted(set(data) - every)
        if extra:
            raise ConfigError(f"{field}.{extra[0]}", f"not a length option; options: "
                              f"{', '.join(sorted(every))}")
        # Parameters of other distributions are ignored, so that a command-line override such
        # as `workload.prompt_len.dist=uniform` works on top of the lognormal default (Hydra
        # merges mappings; it cannot delete the old keys).
        data = {k: v for k, v in data.items() if k in known[dist] and v is not None}
        data = typed_fields(LengthDistribution, data, field)
        missing = sorted(known[dist] - set(data) - ({"min"} if dist != "uniform" else set()))
        if missing:
            raise ConfigError(f"{field}.{missing[0]}", f"required for a {dist} length")
        if dist == "fixed":
            v = data["value"]
            require(1 <= v <= MAX_LENGTH, f"{field}.value", f"must be in [1, {MAX_LENGTH}], got {v}")
            data["min"] = data["max"] = v
        return LengthDistribution(field=field, dist=dist, **data)

    def __post_init__(self) -> None:
        f = self.field
        require(self.min >= 1, f"{f}.min", f"must be >= 1, got {self.min}")
        require(self.min <= MAX_LENGTH, f"{f}.min", f"must be <= {MAX_LENGTH}, got {self.min}")
        require(self.max <= MAX_LENGTH, f"{f}.max", f"must be <= {MAX_LENGTH} tokens (longer "
                                                    f"than any context), got {self.max}")
        require(self.max >= self.min, f"{f}.max", f"must be >= min ({self.min}), got {self.max}")
        if self.dist == "lognormal":
            require(self.median > 0, f"{f}.median", f"must be > 0, got {self.median}")
            require(self.sigma >= 0, f"{f}.sigma", f"must be >= 0, got {self.sigma}")
        if self.dist == "zipf":
            require(self.a > 0, f"{f}.a", f"must be > 0, got {self.a}")
            require(self.max - self.min < 10_000_000, f"{f}.max", "zipf range too large")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.min, self.max + 1, n)
        if self.dist == "lognormal":
            x = rng.lognormal(np.log(self.median), self.sigma, n)
            return np.clip(np.rint(x), self.min, self.max).astype(np.int64)
        ranks = np.arange(1, self.max - self.min + 2, dtype=np.float64)
        p = ranks**-self.a
        return self.min + rng.choice(len(ranks), size=n, p=p / p.sum())
