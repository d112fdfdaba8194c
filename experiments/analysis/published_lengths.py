"""The request streams of ``experiments/published.py``: benchmark_serving's ShareGPT sample
(a fitted length model), fixed lengths, and MLPerf's Llama-2-70B samples; arrivals all at
once (``request_rate`` inf) or Poisson.

ShareGPT length model
---------------------
A fit to what the sources state, not the data set. benchmark_serving keeps a ShareGPT
conversation's first prompt and answer when both have >= 4 tokens, the prompt <= 1,024 and
prompt + answer <= 2,048 tokens; the kept pairs average about 202 prompt and 179 answer tokens,
heavy-tailed. The model: prompt and answer lengths independent lognormals, rounded to the
nearest integer, with that filter applied (exactly: the pairs the filter refuses are dropped
from the joint distribution, not clipped). The sources give no spread, so the sigmas are
assumptions (``prompt_sigma`` 1.3, ``output_sigma`` 0.9: prompts mostly short questions with
a long tail of pasted text, answers less spread); the two medians are solved for so that the
means *after the filter* are the stated ones. ``fit_sharegpt`` does that on the exact
discrete distribution (no Monte Carlo), and ``ShareGPTModel.sample`` draws seeded pairs from
it (prompt from its filtered marginal, then the answer given the prompt).

MLPerf lengths
--------------
``mlperf_llama2_lengths.csv`` holds each sample's input length and reference output length
(mean 219). The published runs generated about 290 tokens per sample (tokens/s over
samples/s); each sample's output is its reference length times one factor, rounded, within
[1, ``max_output``] (MLPerf's 1,024-token limit), the factor chosen so that the mean is the
row's tokens per sample. The shape of the reference outputs is kept; which samples really
grew is not known. A run of fewer samples takes evenly spaced ones (the file is not in random
order: its first lines have shorter prompts than the whole).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import fsolve
from scipy.stats import norm

from sim.config_types import as_float, as_int
from sim.errors import ConfigError, require
from sim.request import Request
from sim.workload import Workload

SHAREGPT_DEFAULTS = {"prompt_mean": 202.0, "output_mean": 179.0, "prompt_sigma": 1.3,
                     "output_sigma": 0.9, "min_len": 4, "max_prompt": 1024, "max_total": 2048}


# ---- ShareGPT -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShareGPTModel:
    """Independent rounded lognormals (``exp(mu) `` the median) under benchmark_serving's
    filter: both >= ``min_len``, prompt <= ``max_prompt``, prompt + output <= ``max_total``."""

    prompt_mu: float
    prompt_sigma: float
    output_mu: float
    output_sigma: float
    min_len: int = 4
    max_prompt: int = 1024
    max_total: int = 2048

    def _pmf(self, mu: float, sigma: float, hi: int) -> np.ndarray:
        """P(round(X) = k) for k = 0 .. hi, X lognormal(mu, sigma)."""
        edges = np.log(np.arange(hi + 2) - 0.5, where=np.arange(hi + 2) > 0.5,
                       out=np.full(hi + 2, -np.inf))
        return np.diff(norm.cdf((edges - mu) / sigma))

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt lengths, their filtered probabilities, the output pmf over 0 .. max_total)."""
        lo = self.min_len
        prompts = np.arange(lo, self.max_prompt + 1)
        p_pmf = self._pmf(self.prompt_mu, self.prompt_sigma, self.max_prompt)[lo:]
        o_pmf = self._pmf(self.output_mu, self.output_sigma, self.max_total)
        o_pmf[:lo] = 0.0
        o_cdf = np.cumsum(o_pmf)
        weight = p_pmf * o_cdf[self.max_total - prompts]  # P(prompt) * P(lo <= output <= cap)
        return prompts, weight / weight.sum(), o_pmf

    def means(self) -> tuple[float, float]:
        """The mean prompt and output lengths of the pairs the filter keeps (exact)."""
        prompts, p_prob, o_pmf = self.tables()
        caps = self.max_total - prompts
        o_cdf = np.cumsum(o_pmf)
        o_sum = np.cumsum(np.arange(len(o_pmf)) * o_pmf)
        return (float(prompts @ p_prob),
                float(p_prob @ (o_sum[caps] / o_cdf[caps])))

    def sample(self, n: int, rng: np.random.Generator,
               stratified: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """``n`` seeded (prompt, output) pairs from the filtered distribution, each drawn by
        its inverse CDF (the prompt from its marginal, then the output given the prompt).
        ``stratified``: the uniforms are a Latin hypercube (one in each 1/n of [0, 1) per
        length, paired at random), so that a few hundred pairs have close to the model's
        means; plain random draws of this heavy tail move a 500-pair mean by about 5%."""
        prompts, p_prob, o_pmf = self.tables()
        if stratified:
            u_p, u_o = ((rng.permutation(n) + rng.random(n)) / n for _ in range(2))
        else:
            u_p, u_o = rng.random(n), rng.random(n)
        i = np.searchsorted(np.cumsum(p_prob), u_p, side="right")
        p = prompts[np.minimum(i, len(prompts) - 1)]
        o_cdf = np.cumsum(o_pmf)
        caps = self.max_total - p
        o = np.searchsorted(o_cdf, u_o * o_cdf[caps], side="right")
        return p.astype(np.int64), np.clip(o, self.min_len, caps).astype(np.int64)


def fit_sharegpt(opts: dict[str, Any] | None = None) -> ShareGPTModel:
    """The model whose filtered means are ``prompt_mean`` / ``output_mean`` for the given
    sigmas (``SHAREGPT_DEFAULTS`` for what ``opts`` leaves out)."""
    o = {**SHAREGPT_DEFAULTS, **(opts or {})}
    unknown = sorted(set(o) - set(SHAREGPT_DEFAULTS))
    if unknown:
        raise ConfigError(f"experiment.sharegpt.{unknown[0]}",
                          f"unknown option; known: {', '.join(SHAREGPT_DEFAULTS)}")
    f = "experiment.sharegpt."
    lo, max_p, max_t = (as_int(o[k], f + k, minimum=1)
                        for k in ("min_len", "max_prompt", "max_total"))
    require(max_p + lo <= max_t, f + "max_total", "must leave room for an output after the "
            "longest prompt")
    p_mean, o_mean, p_sig, o_sig = (as_float(o[k], f + k) for k in
                                    ("prompt_mean", "output_mean", "prompt_sigma",
                                     "output_sigma"))
    require(p_sig > 0 and o_sig > 0, f + "prompt_sigma", "the sigmas must be > 0")
    require(lo < p_mean < max_p, f + "prompt_mean", f"must lie in ({lo}, {max_p})")
    require(lo < o_mean < max_t - max_p, f + "output_mean",
            f"must lie in ({lo}, {max_t - max_p})")

    def model(mu: np.ndarray) -> ShareGPTModel:
        return ShareGPTModel(float(mu[0]), p_sig, float(mu[1]), o_sig, lo, max_p, max_t)

    def gap(mu: np.ndarray) -> list[float]:
        mp, mo = model(mu).means()
        return [math.log(mp / p_mean), math.log(mo / o_mean)]

    # From the untruncated lognormals' medians for these means.
    start = np.array([math.log(p_mean) - p_sig**2 / 2, math.log(o_mean) - o_sig**2 / 2])
    with np.errstate(invalid="ignore", divide="ignore"):
        mu, _, ok, msg = fsolve(gap, start, full_output=True, xtol=1e-10)
    fitted = model(mu)
    if ok != 1 or max(abs(g) for g in gap(mu)) > 1e-6:
        raise ConfigError("experiment.sharegpt", f"no lognormal fit for these means and "
                          f"sigmas ({msg})")
    return fitted


# ---- MLPerf ---------------------------------------------------------------------------------
def read_mlperf_lengths(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, reference output lengths) of ``mlperf_llama2_lengths.csv``."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"input_length", "output_length"}
        if not need <= set(reader.fieldnames or ()):
            raise ConfigError("published_dir", f"{path}: needs the columns {sorted(need)}, "
                              f"has {reader.fieldnames}")
        ins, outs = [], []
        for line, row in enumerate(reader, start=2):
            try:
                i, o = int(row["input_length"]), int(row["output_length"])
            except (TypeError, ValueError):
                raise ConfigError("published_dir", f"{path}:{line}: lengths must be "
                                  f"integers, got {row}") from None
            require(i >= 1 and o >= 1, "published_dir", f"{path}:{line}: lengths must be >= 1")
            ins.append(i)
            outs.append(o)
    return np.array(ins, dtype=np.int64), np.array(outs, dtype=np.int64)


def scaled_outputs(reference: np.ndarray, mean: float, max_output: int) -> np.ndarray:
    """``reference`` times one factor, rounded and kept within [1, ``max_output``], the
    factor chosen (by bisection) so that the mean is ``mean`` to within rounding."""
    require(1 <= mean < max_output, "experiment.mlperf.output_mean",
            f"must lie in [1, {max_output}), got {mean}")

    def scaled(f: float) -> np.ndarray:
        return np.clip(np.rint(reference * f), 1, max_output).astype(np.int64)

    lo, hi = 0.0, float(max_output)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if scaled(mid).mean() < mean else (lo, mid)
    return scaled(hi)


# ---- the workload ---------------------------------------------------------------------------
class LengthsWorkload(Workload):
    """Requests with given arrival times and lengths (lengths only: a cost model's run)."""

    def __init__(self, arrivals: np.ndarray, prompts: np.ndarray, outputs: np.ndarray,
                 about: str) -> None:
        self.arrivals, self.prompts, self.outputs = arrivals, prompts, outputs
        self.about = about

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def max_prompt_len(self) -> int:
        return int(self.prompts.max())

    def __iter__(self) -> Iterator[Request]:
        for rid, (t, p, o) in enumerate(zip(self.arrivals.tolist(), self.prompts.tolist(),
                                            self.outputs.tolist())):
            yield Request(rid, t, p, o)

    def describe(self) -> str:
        return self.about


def arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """benchmark_serving's send times: all at 0 for an infinite rate, else the first at 0 and
    exponential gaps of mean 1 / ``rate`` (a Poisson process)."""
    if math.isinf(rate):
        return np.zeros(n)
    require(rate > 0, "workload.request_rate", f"must be > 0 or inf, got {rate}")
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])


def build_workload(section: dict[str, Any], seed: int) -> LengthsWorkload:
    """The workload of a ``{name: published, dataset: ...}`` section (what
    ``experiments.published.row_setup`` writes): ``fixed`` (``input_len``, ``output_len``),
    ``sharegpt`` (``sharegpt``: the length model's options) or ``mlperf`` (``path``,
    ``output_mean``: null for the reference lengths, ``max_output``)."""
    s = dict(section)
    dataset = s.get("dataset")
    n = as_int(s.get("num_prompts"), "workload.num_prompts", minimum=1)
    rate = float(s.get("request_rate", math.inf))
    # One child stream per quantity: the lengths do not move with the arrivals.
    g_arr, g_len = (np.random.default_rng(c) for c in np.random.SeedSequence(seed).spawn(2))
    if dataset == "fixed":
        i = as_int(s.get("input_len"), "workload.input_len", minimum=1)
        o = as_int(s.get("output_len"), "workload.output_len", minimum=1)
        prompts, outputs = np.full(n, i), np.full(n, o)
        about = f"fixed {i}/{o}"
    elif dataset == "sharegpt":
        prompts, outputs = fit_sharegpt(s.get("sharegpt")).sample(n, g_len)
        about = "ShareGPT length model"
    elif dataset == "mlperf":
        ins, ref = read_mlperf_lengths(Path(str(s.get("path"))))
        require(n <= len(ins), "experiment.mlperf_samples",
                f"the lengths file has {len(ins)} samples, {n} asked for")
        mean, cap = s.get("output_mean"), as_int(s.get("max_output", 1024),
                                                 "experiment.mlperf.max_output", minimum=1)
        # Fewer than all: evenly spaced samples (the file is not in random order, so its
        # first lines are not a fair sample), scaled among themselves.
        pick = np.arange(n) * len(ins) // n
        prompts, outputs = ins[pick], ref[pick]
        if mean is not None:
            outputs = scaled_outputs(outputs, float(mean), cap)
        about = "MLPerf Llama-2-70B samples"
    else:
        raise ConfigError("workload.dataset", f"must be fixed, sharegpt or mlperf, got "
                          f"{dataset!r}")
    return LengthsWorkload(arrivals(n, rate, g_arr), prompts, outputs,
                           f"{about}: {n} requests at {rate} req/s")
