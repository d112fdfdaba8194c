"""Synthetic workloads: an arrival process and two length distributions, one seeded run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from sim.config_types import MAX_TIME_S, as_bool, as_float, as_int
from sim.errors import ConfigError, require
from sim.request import Request
from workloads.base import WORKLOADS, Workload
from workloads.distributions import ArrivalProcess, LengthDistribution
from workloads.token_ids import TokenIdSource, prefix_group

_CHUNK = 4096  # requests drawn per vectorized batch; does not change the stream
# The most requests one run may replay or generate (a billion requests take hours to simulate).
MAX_REQUESTS = 10**9


class SyntheticWorkload(Workload):
    """Requests from an arrival process and either two length distributions (prompt and
    output) or one total-length distribution split by ``prefill_decode_ratio`` (as Vidur's
    synthetic workloads do: output = ceil(total / (ratio + 1)), prompt = total - output)."""

    def __init__(self, num_requests: int, arrival: ArrivalProcess,
                 prompt_len: LengthDistribution | None, output_len: LengthDistribution | None,
                 seed: int, priorities: list[float] | None = None,
                 total_len: LengthDistribution | None = None,
                 prefill_decode_ratio: float | None = None,
                 token_ids: TokenIdSource | None = None, shared_prefix_len: int = 0,
                 num_prefix_groups: int = 1) -> None:
        require(num_requests >= 1, "workload.num_requests", f"must be >= 1, got {num_requests}")
        require(num_requests <= MAX_REQUESTS, "workload.num_requests",
                f"must be <= {MAX_REQUESTS}, got {num_requests}")
        # The last arrival comes about num_requests / qps seconds in.
        span = num_requests / arrival.qps
        require(span <= MAX_TIME_S, "workload.qps", (
            f"{arrival.qps} req/s spreads {num_requests} requests over about {span:.3g} s, "
            f"beyond {MAX_TIME_S:g} s of simulated time (float times there cannot carry "
            f"microsecond latencies)"))
        if total_len is not None:
            require(prefill_decode_ratio is not None and prefill_decode_ratio > 0,
                    "workload.prefill_decode_ratio", "must be > 0 when workload.total_len is set")
            require(total_len.min >= 2, "workload.total_len.min", "must be >= 2")
        self._n = num_requests
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.seed = seed
        self.priorities = _priority_weights(priorities)
        self.total_len = total_len
        self.prefill_decode_ratio = prefill_decode_ratio
        self.token_ids = token_ids  # None: requests carry lengths only (enough for a cost model)
        # Each prompt starts with one of num_prefix_groups shared prefixes (the prefix cache
        # sees them as spans; token ids, when drawn, agree with them).
        self.shared_prefix_len = shared_prefix_len
        self.num_prefix_groups = num_prefix_groups

    @property
    def num_requests(self) -> int:
        return self._n

    @property
    def max_prompt_len(self) -> int:
        if self.total_len is not None:
            return self._split(self.total_len.max)[0]
        return self.prompt_len.max

    def _split(self, total: int) -> tuple[int, int]:
        out = -(-total // (self.prefill_decode_ratio + 1))
        out = int(min(max(out, 1), total - 1))
        return total - out, out

    def __iter__(self) -> Iterator[Request]:
        # One child stream per quantity: changing one distribution leaves the others' draws
        # (and so the arrival times) unchanged under the same seed.
        ss = np.random.SeedSequence(self.seed)
        g_arr, g_in, g_out, g_pri = (np.random.default_rng(s) for s in ss.spawn(4))
        t = 0.0
        rid = 0
        pri_p = None
        if self.priorities:
            pri_p = np.asarray(self.priorities, dtype=float) / sum(self.priorities)
        # (prompt, output) of each total length: a pure function of one small integer, so
        # split each distinct total once (a dict hit is a tenth of the float arithmetic).
        splits: dict[int, tuple[int, int]] = {}
        tok = self.token_ids
        shared, groups = self.shared_prefix_len, self.num_prefix_groups
        while rid < self._n:
            n = min(_CHUNK, self._n - rid)
            times = t + np.cumsum(self.arrival.gaps(g_arr, n))
            t = float(times[-1])
            if self.total_len is not None:
                split = [splits.get(total) or splits.setdefault(total, self._split(total))
                         for total in self.total_len.sample(g_in, n).tolist()]
                ins = [p for p, _ in split]
                outs = [o for _, o in split]
            else:
                ins = self.prompt_len.sample(g_in, n).tolist()
                outs = self.output_len.sample(g_out, n).tolist()
            pris = (g_pri.choice(len(pri_p), size=n, p=pri_p).tolist() if pri_p is not None
                    else [0] * n)
            if tok is None and not shared:  # lengths only (a cost model): no ids to draw
                for at, i, o, p in zip(times.tolist(), ins, outs, pris):
                    yield Request(rid, at, i, o, priority=p)
                    rid += 1
                continue
            for at, i, o, p in zip(times.tolist(), ins, outs, pris):
                prefix = None
                if shared:
                    prefix = ((prefix_group(self.seed, rid, groups), min(shared, i)),)
                yield Request(rid, at, i, o, priority=p, prefix=prefix,
                              prompt_token_ids=None if tok is None else tok.synthetic(rid, i))
                rid += 1

    def describe(self) -> str:
        a = self.arrival
        lengths = (f"total {self.total_len.dist} split {self.prefill_decode_ratio}:1"
                   if self.total_len is not None
                   else f"prompt {self.prompt_len.dist}, output {self.output_len.dist}")
        return f"synthetic: {self._n} requests, {a.kind} arrivals at {a.qps} req/s, {lengths}"


def _priority_weights(value: Any) -> list[float] | None:
    """Class weights: a list of finite numbers >= 0 with a positive sum (they are normalised
    into the probabilities a class is drawn with). None or [] : every request is class 0."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ConfigError("workload.priorities", f"must be a list of class weights, got {value!r}")
    weights = [as_float(w, f"workload.priorities[{i}]") for i, w in enumerate(value)]
    for i, w in enumerate(weights):
        require(w >= 0, f"workload.priorities[{i}]", f"a class weight must be >= 0, got {w}")
    require(not weights or sum(weights) > 0, "workload.priorities",
            f"the class weights must have a positive sum, got {list(value)}")
    return weights


def token_id_source(cfg: dict[str, Any], seed: int, model: Any, needed: bool,
                    prefixes: bool = True) -> TokenIdSource | None:
    """The workload's token-id source, or None when neither the config (``token_ids``) nor
    the executor (``needed``) asks for ids."""
    # Checked even when no ids are drawn: a bad value is refused, never silently unused.
    wanted, prefix_len, groups = (cfg.get(k) for k in ("token_ids", "shared_prefix_len",
                                                       "num_prefix_groups"))
    wanted = wanted is not None and as_bool(wanted, "workload.token_ids")
    prefix_len = 0 if prefix_len is None else as_int(prefix_len, "workload.shared_prefix_len",
                                                     minimum=0)
    groups = 1 if groups is None else as_int(groups, "workload.num_prefix_groups", minimum=1)
    if not (wanted or needed):
        return None
    if model is None:
        raise ConfigError("workload.token_ids", "token ids need the model's vocabulary size")
    if not prefixes:
        prefix_len, groups = 0, 1
    return TokenIdSource(seed, model.vocab_size, prefix_len, groups)


@WORKLOADS.register("synthetic")
def build_synthetic(cfg: dict[str, Any], seed: int, model: Any = None, token_ids: bool = False,
                    **_: Any) -> SyntheticWorkload:
    """``token_ids=True`` (an executor that samples real tokens) turns prompt ids on."""
    cfg = dict(cfg)
    known = {"num_requests", "qps", "arrival", "cv", "prompt_len", "output_len", "priorities",
             "total_len", "prefill_decode_ratio", "token_ids", "shared_prefix_len",
             "num_prefix_groups"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"workload.{unknown[0]}",
                          f"unknown option for a synthetic workload; known: {', '.join(sorted(known))}")
    total = cfg.get("total_len")
    # Either a total length split by a ratio, or separate prompt and output distributions.
    required = ("num_requests", "qps") if total is not None else (
        "num_requests", "qps", "prompt_len", "output_len")
    for f in required:
        if cfg.get(f) is None:
            raise ConfigError(f"workload.{f}", "required for a synthetic workload")

    def dist(name: str) -> LengthDistribution | None:
        return (None if total is not None
                else LengthDistribution.from_dict(f"workload.{name}", cfg[name]))

    ratio = cfg.get("prefill_decode_ratio")
    return SyntheticWorkload(
        num_requests=as_int(cfg["num_requests"], "workload.num_requests"),
        arrival=ArrivalProcess(cfg.get("arrival", "poisson"), as_float(cfg["qps"], "workload.qps"),
                               as_float(cfg.get("cv", 1.0), "workload.cv")),
        prompt_len=dist("prompt_len"),
        output_len=dist("output_len"),
        seed=seed,
        priorities=cfg.get("priorities"),
        total_len=(None if total is None
                   else LengthDistribution.from_dict("workload.total_len", total)),
        prefill_decode_ratio=(None if ratio is None
                              else as_float(ratio, "workload.prefill_decode_ratio")),
        token_ids=token_id_source(cfg, seed, model, token_ids),
        shared_prefix_len=as_int(cfg.get("shared_prefix_len") or 0, "workload.shared_prefix_len",
                                 minimum=0),
        num_prefix_groups=as_int(cfg.get("num_prefix_groups") or 1, "workload.num_prefix_groups",
                                 minimum=1),
    )
