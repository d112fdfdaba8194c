"""Per-request and per-token latency collection and the ``summary.json`` figures.

Keys follow vLLM's ``benchmark_serving`` results. TPOT is (last token - first token) /
(output tokens - 1); ITL is every gap between consecutive tokens of a request.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from sim.request import Request

PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


class MetricsCollector:
    def __init__(self) -> None:
        self.ttft = array("d")
        self.tpot = array("d")
        self.e2el = array("d")
        self.itl = array("d")
        self.completed = 0
        self.rejected = 0
        self.reject_reasons: dict[str, int] = {}
        self.input_tokens = 0
        self.output_tokens = 0
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_recomputes = 0
        self.first_arrival: float | None = None
        self.last_finish = 0.0

    def on_arrival(self, req: Request) -> None:
        if self.first_arrival is None or req.arrival_time < self.first_arrival:
            self.first_arrival = req.arrival_time

    def on_finished(self, req: Request) -> None:
        self.completed += 1
        self.input_tokens += req.prompt_len
        self.output_tokens += req.num_output_tokens
        self.ttft.append(req.first_token_time - req.arrival_time)
        if req.num_output_tokens > 1:
            self.tpot.append((req.last_token_time - req.first_token_time)
                             / (req.num_output_tokens - 1))
        self.e2el.append(req.finish_time - req.arrival_time)
        if len(req.token_times) > 1:
            self.itl.extend(np.diff(np.frombuffer(req.token_times, dtype=np.float64)))
        self.num_preemptions += req.num_preemptions
        self.num_swaps += req.num_swaps
        self.num_recomputes += req.num_recomputes
        if req.finish_time > self.last_finish:
            self.last_finish = req.finish_time

    def on_rejected(self, req: Request) -> None:
        self.rejected += 1
        key = (req.reject_reason or "unknown").split(":")[0]
        self.reject_reasons[key] = self.reject_reasons.get(key, 0) + 1

    @property
    def duration(self) -> float:
        if self.first_arrival is None:
            return 0.0
        return max(0.0, self.last_finish - self.first_arrival)

    def summary(self) -> dict[str, Any]:
        dur = self.duration
        out: dict[str, Any] = {
            "completed": self.completed,
            "rejected": self.rejected,
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "request_throughput": self.completed / dur if dur else 0.0,
            "output_throughput": self.output_tokens / dur if dur else 0.0,
            "total_token_throughput": (self.input_tokens + self.output_tokens) / dur if dur else 0.0,
        }
        for name, values in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl),
                             ("e2el", self.e2el)):
            out.update(latency_stats(name, values))
        out["num_preemptions"] = self.num_preemptions
        out["num_swaps"] = self.num_swaps
        out["num_recomputes"] = self.num_recomputes
        out["reject_reasons"] = dict(sorted(self.reject_reasons.items()))
        return out


def latency_stats(name: str, values: array | np.ndarray) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``p90_<name>_ms``, ``p99_<name>_ms``
    (and ``std``), in milliseconds; zeros for an empty set, as vLLM reports."""
    arr = np.frombuffer(values, dtype=np.float64) if isinstance(values, array) else values
    if len(arr) == 0:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "std", "median", "p90", "p99")}
    ms = arr * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"std_{name}_ms": float(ms.std())}
    for key, q in PERCENTILES:
        out[f"{key}_{name}_ms"] = float(np.percentile(ms, q))
    return out
