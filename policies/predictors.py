"""Output-length predictors for SJF: what the scheduler believes a request will still generate.

A predictor sees a request as it arrives at a replica and predicts its remaining output: the
whole output for a new request, the tokens after those already sampled for one that arrives
with them (a disaggregated decode replica receives requests after their first token).
``oracle``: the true length. ``noisy``: the true length times a lognormal error of median 1
and the given sigma. ``bucket``: a classifier that only knows short / medium / long (edges
``bucket_edges``: short <= e0 < medium <= e1 < long), right with probability
``bucket_accuracy`` and otherwise one of the two wrong classes at random; it predicts the
class's representative length (e0 / 2, (e0 + e1) / 2, 2 x e1), so within a class requests
keep arrival order.

Every draw comes from one generator seeded from the run's seed (a stream of its own, so the
workload's draws are unaffected), in arrival order: a run is reproducible.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

from sim.request import Request

PREDICTORS = ("oracle", "noisy", "bucket")
_STREAM = 0x5F1  # spawn key of the predictor's stream, distinct from the workload's

Predictor = Callable[[Request], float]


def _remaining(req: Request) -> int:
    """The true number of output tokens still to generate."""
    return req.max_output_len - req.num_output_tokens


def make_predictor(kind: str, seed: int, noise_sigma: float = 0.5,
                   bucket_edges: tuple[int, int] = (128, 512),
                   bucket_accuracy: float = 0.8) -> Predictor:
    """A function from a request to its predicted remaining output length (> 0): the whole
    output for a request that has generated nothing yet."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STREAM,)))
    if kind == "oracle":
        return lambda req: float(_remaining(req))
    if kind == "noisy":
        return lambda req: max(1.0, _remaining(req) * float(rng.lognormal(0.0, noise_sigma)))
    if kind == "bucket":
        e0, e1 = bucket_edges
        reps = (e0 / 2, (e0 + e1) / 2, 2.0 * e1)

        def bucket(req: Request) -> float:
            true = bisect.bisect_left(bucket_edges, _remaining(req))
            if rng.random() < bucket_accuracy:
                return reps[true]
            wrong = [b for b in range(3) if b != true]
            return reps[wrong[int(rng.integers(2))]]

        return bucket
    raise ValueError(f"unknown predictor {kind!r}; known: {', '.join(PREDICTORS)}")
