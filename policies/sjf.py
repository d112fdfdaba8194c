"""Shortest job first by predicted remaining work, with aging and optional preemption.

Remaining work is the predicted number of output tokens still to generate (prediction minus
tokens generated, at least 1): decode steps, one per token, are what a request's latency is
made of, while its prompt is one prefill. The prediction is drawn once, at arrival, and
stored in ``req.extra["predicted_output_len"]`` (see ``policies/predictors.py``); a
disaggregated decode replica draws its own when the request arrives there with its first
token (tokens generated + the predicted remainder).

Admission order: first every request that has waited at least ``aging_s`` seconds, oldest
first (aging bounds starvation: under overload a long request eventually heads the queue);
then the rest by predicted remaining work. With ``preemptive`` the head of that order may
preempt running requests whose predicted remaining work is at least ``preemption_ratio``
times its own (longest first), when that makes it fit. The memory-pressure victim is the
running request with the longest predicted remaining work. Steps otherwise as ``fcfs``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from policies.base import POLICIES, PolicyConfig
from policies.ordered import OrderedPolicy
from policies.predictors import PREDICTORS, make_predictor
from policies.queues import WaitingHeap
from sim.config_types import as_int
from sim.errors import require
from sim.request import Request


@dataclass(frozen=True)
class SJFConfig(PolicyConfig):
    name: str = "sjf"
    predictor: str = "oracle"  # oracle | noisy | bucket
    noise_sigma: float = 0.5  # noisy: sigma of the lognormal error
    bucket_edges: tuple[int, int] = (128, 512)  # bucket: short <= e0 < medium <= e1 < long
    bucket_accuracy: float = 0.8  # bucket: probability the class is right
    aging_s: float | None = 30.0  # waited this long: served in arrival order; null: never
    preemptive: bool = False
    preemption_ratio: float = 4.0  # victim's remaining work >= ratio x the newcomer's

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.predictor in PREDICTORS, "policy.predictor",
                f"must be one of {list(PREDICTORS)}, got {self.predictor!r}")
        require(self.noise_sigma >= 0, "policy.noise_sigma",
                f"must be >= 0, got {self.noise_sigma}")
        edges = self.bucket_edges
        require(isinstance(edges, (list, tuple)) and len(edges) == 2, "policy.bucket_edges",
                f"must be two increasing positive lengths [short, medium], got {edges!r}")
        edges = tuple(as_int(e, f"policy.bucket_edges[{i}]") for i, e in enumerate(edges))
        require(1 <= edges[0] < edges[1], "policy.bucket_edges",
                f"must be two increasing positive lengths [short, medium], got {list(edges)}")
        object.__setattr__(self, "bucket_edges", (int(edges[0]), int(edges[1])))
        require(0 <= self.bucket_accuracy <= 1, "policy.bucket_accuracy",
                f"must be in [0, 1], got {self.bucket_accuracy}")
        require(self.aging_s is None or self.aging_s >= 0, "policy.aging_s",
                f"must be >= 0 or null, got {self.aging_s}")
        require(self.preemption_ratio > 1, "policy.preemption_ratio",
                f"must be > 1 (else two requests could preempt each other), got "
                f"{self.preemption_ratio}")


def predicted_remaining(req: Request) -> float:
    return max(1.0, req.extra["predicted_output_len"] - req.num_output_tokens)


@POLICIES.register("sjf")
class SJFPolicy(OrderedPolicy):
    config_class = SJFConfig
    # Decode jumps, also past finishes: checked against exact mode in tests/test_fast_forward.py;
    # the array core: tests/test_array_core.py.
    supports_decode_jumps = True
    array_core = True
    config: SJFConfig

    def __init__(self, config: SJFConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        c = config
        self.predict = make_predictor(c.predictor, seed, c.noise_sigma, c.bucket_edges,
                                      c.bucket_accuracy)
        self.by_arrival = WaitingHeap(lambda r: (r.arrival_time, r.request_id))
        # The same requests, less those found aged (they stay aged while they wait): the
        # oldest one not yet aged is the next aging deadline, found without walking past
        # every aged request at each step (an overloaded replica can hold thousands).
        self.not_aged = WaitingHeap(lambda r: (r.arrival_time, r.request_id))

    def on_arrival(self, req: Request) -> None:
        self._predict(req)
        super().on_arrival(req)

    def _predict(self, req: Request) -> None:
        """Store the predicted total output length: tokens generated so far plus the
        predicted remainder."""
        total = req.num_output_tokens + self.predict(req)
        req.extra = {**(req.extra or {}), "predicted_output_len": total}

    def waiting_key(self, req: Request) -> tuple[float, float, int]:
        return (predicted_remaining(req), req.arrival_time, req.request_id)

    running_key = waiting_key

    def may_preempt(self, candidate: Request, victim: Request) -> bool:
        return predicted_remaining(victim) >= (self.config.preemption_ratio
                                               * predicted_remaining(candidate))

    def on_transferred(self, req: Request) -> None:
        # A decode replica's own prediction, made as the request arrives here with its first
        # token(s): the predictor sees what remains to generate (policies/predictors.py).
        self._predict(req)

    def index(self, req: Request) -> None:
        super().index(req)
        if self.config.aging_s is not None:  # the two heaps serve aging only
            self.by_arrival.push(req)
            self.not_aged.push(req)

    def unindex(self, req: Request) -> None:
        super().unindex(req)
        self.by_arrival.discard(req)
        self.not_aged.discard(req)

    def order_fixed_while_decoding(self) -> bool:
        # The oracle predicts the true remaining length (also after a recompute, and on a
        # decode replica, which predicts the same total again): a running request's key is
        # its true remaining work, at least 1, so every key falls by one per decode step and
        # none is clamped before its last step: two requests are clamped together only in a
        # last step they share, having had equal keys (hence arrival order) all along. So
        # decoding never reorders them (see ``decode_order_steps``).
        return self.config.predictor == "oracle"

    def decode_order_steps(self, running: Sequence[Request], limit: int,
                           last_steps: Sequence[int] | np.ndarray | None = None) -> int:
        """Decode step j (1: the one planned now) orders by max(1, p - (n + j - 1)), p the
        predicted total and n the tokens generated now: every key falls by one per step
        until it is clamped at 1 (the prediction is used up), and clamped requests go by
        arrival. So two requests can change places only in the first step in which both are
        clamped (and both still running), and only if they were not in arrival order: the
        order holds until the first such step. Pairwise over the running requests clamped
        while they run: O(n^2) numpy work (about 1 ms per jump at 256 of them)."""
        n = len(running)
        if limit <= 1 or n < 2 or self.order_fixed_while_decoding():
            return limit
        p = np.fromiter((r.extra["predicted_output_len"] for r in running), np.float64, n)
        out = np.fromiter((r.num_output_tokens for r in running), np.int64, n)
        # The first step t >= 1 whose key is clamped, by the key's own float test (the two
        # loops only guard the ceiling against rounding; they do not run in practice).
        t = np.maximum(1, np.ceil(p - out)).astype(np.int64)
        while True:
            early = (t > 1) & (p - (out + t - 2) <= 1)
            if not early.any():
                break
            t -= early
        while True:
            late = p - (out + t - 1) > 1
            if not late.any():
                break
            t += late
        last = np.full(n, limit, dtype=np.int64) if last_steps is None else np.minimum(
            np.asarray(last_steps, dtype=np.int64), limit)
        # Only requests clamped while they still run can change places.
        idx = (t <= last).nonzero()[0]
        if len(idx) < 2:
            return limit
        t, last = t[idx], last[idx]
        keys = [(running[i].arrival_time, running[i].request_id) for i in idx.tolist()]
        rank = np.empty(len(keys), dtype=np.int64)
        rank[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys))
        # Each pair's first step clamped together, if both still run then; pairs out of
        # arrival order (in this step's order: ascending idx) change places there.
        both = np.maximum.outer(t, t)
        swap = (rank[:, None] > rank) & (both <= np.minimum.outer(last, last))
        swap &= idx[:, None] < idx
        if not swap.any():
            return limit
        return int(both[swap].min()) - 1

    def _aged(self, req: Request, now: float) -> bool:
        """Whether waiting ``req`` has waited ``aging_s`` by ``now``: it then heads the
        admission order. ``now`` only grows, so an aged request stays aged."""
        return now - req.arrival_time >= self.config.aging_s

    def _oldest_not_aged(self, now: float) -> Request | None:
        """The oldest waiting request not yet aged (entries before it dropped for good)."""
        return self.not_aged.first(lambda r: self._aged(r, now))

    def next_decision_time(self, now: float) -> float:
        """When the oldest waiting request not yet aged will be: from then on it heads the
        admission order (``candidates``), which may admit it, so decode jumps stop there."""
        if self.config.aging_s is None:
            return math.inf
        req = self._oldest_not_aged(now)
        if req is None:
            return math.inf
        due = req.arrival_time + self.config.aging_s
        # A hair early: a step ending just before ``due`` may already pass ``_aged`` by
        # rounding; stopping a step early only plans once more.
        return due - 1e-9 * max(1.0, abs(due))

    def candidates(self, now: float, in_order: Iterator[Request]) -> Iterator[Request]:
        if self.config.aging_s is not None:
            # Drop the entries of requests aged or admitted since (also where no decode jump
            # asks for the next deadline, as in step_mode=exact), so the heap stays bounded.
            self._oldest_not_aged(now)
            with self.by_arrival.ordered() as oldest_first:
                for req in oldest_first:
                    if not self._aged(req, now):
                        break
                    yield req
        yield from in_order
