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
# Token times held before their gaps are taken in one pass (~512 KB).
_ITL_BATCH = 1 << 16


class StreamingQuantiles:
    """Quantiles of a stream of positive values in bounded memory (a log-bucketed histogram,
    as DDSketch): every quantile is within ``relative_accuracy`` of a true sample value;
    count, mean and std are exact. Values are buffered and binned in batches."""

    def __init__(self, relative_accuracy: float = 1e-3, min_value: float = 1e-9,
                 max_value: float = 1e5, flush_every: int = 1 << 16) -> None:
        self._gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._log_gamma = np.log(self._gamma)
        self._min = min_value
        self._bins = int(np.ceil(np.log(max_value / min_value) / self._log_gamma)) + 1
        self._counts = np.zeros(self._bins, dtype=np.int64)
        self._buffer = array("d")
        self._flush_every = flush_every
        self.count = 0
        self._sum = 0.0
        # The variance from sums of the values less a shift near their mean (the first
        # batch's): sum(x^2)/n - mean^2 cancels catastrophically when the spread is tiny
        # against the mean (steady token gaps), and turned last-bit differences of the gaps
        # into 1e-8 relative differences of the std.
        self._shift: float | None = None
        self._dev_sum = 0.0
        self._dev_sumsq = 0.0

    def extend(self, values: np.ndarray) -> None:
        self._buffer.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
        if len(self._buffer) >= self._flush_every:
            self._flush()

    def extend_groups(self, values: np.ndarray, ends: np.ndarray) -> None:
        """``extend`` called once per group ``values[ends[i - 1]:ends[i]]`` (non-empty groups,
        ``ends`` ascending, ending at ``len(values)``), in fewer calls: bins are filled in the
        same batches, so ``count``, mean and std come out bit for bit the same."""
        start, n = 0, len(values)
        while start < n:
            room = self._flush_every - len(self._buffer)
            # The first group after which the buffer holds flush_every values or more.
            i = int(np.searchsorted(ends, start + room))
            if i == len(ends):
                self._buffer.frombytes(values[start:].tobytes())
                return
            end = int(ends[i])
            self._buffer.frombytes(values[start:end].tobytes())
            self._flush()
            start = end

    def _flush(self) -> None:
        # Batches of 64K values (512 KB an array) keep the passes in cache: ~3x faster per
        # value than 1M-value batches. Temporaries are reused in place (less peak memory).
        if not self._buffer:
            return
        v = np.frombuffer(self._buffer, dtype=np.float64)
        self.count += len(v)
        self._sum += float(v.sum())
        if self._shift is None:
            self._shift = float(v.mean())
        d = v - self._shift
        self._dev_sum += float(d.sum())
        self._dev_sumsq += float(np.square(d, out=d).sum())
        # Bin floor(log(max(v, min) / min) / log(gamma)), clipped to the histogram (the
        # quotient is >= 0, where the cast to integers truncates as floor does).
        x = np.maximum(v, self._min, out=d)
        x /= self._min
        np.log(x, out=x)
        x /= self._log_gamma
        idx = x.astype(np.int64)
        np.minimum(idx, self._bins - 1, out=idx)
        np.maximum(idx, 0, out=idx)
        self._counts += np.bincount(idx, minlength=self._bins)
        self._buffer = array("d")

    def __len__(self) -> int:
        return self.count + len(self._buffer)

    def stats(self, name: str) -> dict[str, float]:
        """The same keys as ``latency_stats``, in milliseconds."""
        self._flush()
        if self.count == 0:
            return latency_stats(name, np.empty(0))
        mean = self._sum / self.count
        dev = self._dev_sum / self.count
        var = max(self._dev_sumsq / self.count - dev * dev, 0.0)
        out = {f"mean_{name}_ms": mean * 1000.0, f"std_{name}_ms": np.sqrt(var) * 1000.0}
        cum = np.cumsum(self._counts)
        for key, q in PERCENTILES:
            # The bucket holding the sample of rank q% (numpy's 'lower' rank), at its centre.
            rank = int(np.floor(q / 100.0 * (self.count - 1)))
            i = int(np.searchsorted(cum, rank + 1))
            # Bucket i holds [min g^i, min g^(i+1)); this point is within alpha of both ends.
            value = self._min * 2 * self._gamma ** (i + 1) / (1 + self._gamma)
            out[f"{key}_{name}_ms"] = float(value * 1000.0)
        return out


class MetricsCollector:
    """``itl="exact"`` keeps every inter-token gap (exact percentiles, 8 bytes per token);
    ``itl="streaming"`` keeps a bounded histogram instead (for runs of millions of requests)."""

    def __init__(self, itl: str = "exact", slos: dict[str, float] | None = None) -> None:
        if itl not in ("exact", "streaming"):
            raise ValueError(f"itl_quantiles must be exact or streaming, got {itl!r}")
        # benchmark_serving's --goodput: a finished request is good if its TTFT, TPOT and E2E
        # latency are each within the SLO given for it (milliseconds; a missing one is not
        # checked). None: no goodput.
        self.slos = (None if not slos else
                     tuple(float(slos.get(k, "inf")) / 1000.0
                           for k in ("ttft_ms", "tpot_ms", "e2el_ms")))
        self.good = 0
        self.ttft = array("d")
        self.tpot = array("d")
        self.e2el = array("d")
        self._itl: array | StreamingQuantiles = (array("d") if itl == "exact"
                                                  else StreamingQuantiles())
        # Token times of finished requests with two or more tokens, concatenated, and where
        # each request's end is: their gaps are taken in one ``diff`` per batch (``_flush_itl``)
        # rather than one per request, in the same order and with the same values.
        self._times = array("d")
        self._ends = array("q")
        self.completed = 0
        self.rejected = 0
        self.aborted = 0  # left unfinished: the client gave up (online mode)
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

    @property
    def itl(self) -> array | StreamingQuantiles:
        """Every inter-token gap so far, in finishing order (exact), or their histogram."""
        self._flush_itl()
        return self._itl

    def on_finished(self, req: Request) -> None:
        times = req.token_times  # syncs a decode-run member's times
        # Synced, the first token time is the plain field (no property read).
        self.add_finished(req.prompt_len, req.arrival_time, req._first_token, req.finish_time,
                          times[1:])
        self.num_preemptions += req.num_preemptions
        self.num_swaps += req.num_swaps
        self.num_recomputes += req.num_recomputes

    def add_finished(self, prompt_len: int, arrival: float, first: float, finish: float,
                     later_times: array) -> None:
        """A request that finished at ``finish`` after sampling its first token at ``first``
        and one more at each time of ``later_times`` (the array core, sim/array_core.py,
        calls this directly, and counts its preemptions itself)."""
        self.completed += 1
        self.input_tokens += prompt_len
        n = len(later_times) + 1
        self.output_tokens += n
        self.ttft.append(first - arrival)
        if n > 1:
            self.tpot.append((later_times[-1] - first) / (n - 1))
            buf = self._times
            buf.append(first)
            buf.extend(later_times)
            self._ends.append(len(buf))
            if len(buf) >= _ITL_BATCH:
                self._flush_itl()
        self.e2el.append(finish - arrival)
        if self.slos is not None:
            ttft, tpot, e2el = self.slos
            if (first - arrival <= ttft and finish - arrival <= e2el
                    and (n == 1 or (later_times[-1] - first) / (n - 1) <= tpot)):
                self.good += 1
        if finish > self.last_finish:
            self.last_finish = finish

    def _flush_itl(self) -> None:
        """Move the gaps of the requests finished since the last call into ``_itl``."""
        if not self._ends:
            return
        times = np.frombuffer(self._times, dtype=np.float64)
        ends = np.frombuffer(self._ends, dtype=np.int64)
        # diff over the concatenation: the gaps across two requests' boundary (before each
        # end but the last) are not gaps; the others are each request's own np.diff.
        gaps = np.delete(np.diff(times), ends[:-1] - 1)
        if isinstance(self._itl, array):
            self._itl.frombytes(memoryview(gaps).cast("B"))
        else:
            # Each request had ends[i] - ends[i-1] - 1 gaps.
            self._itl.extend_groups(gaps, ends - np.arange(1, len(ends) + 1))
        self._times = array("d")
        self._ends = array("q")

    def on_rejected(self, req: Request) -> None:
        self.rejected += 1
        key = (req.reject_reason or "unknown").split(":")[0]
        self.reject_reasons[key] = self.reject_reasons.get(key, 0) + 1

    def on_aborted(self, req: Request) -> None:
        self.aborted += 1

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
            "aborted": self.aborted,
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "request_throughput": self.completed / dur if dur else 0.0,
            "output_throughput": self.output_tokens / dur if dur else 0.0,
            "total_token_throughput": (self.input_tokens + self.output_tokens) / dur if dur else 0.0,
            # benchmark_serving's: seconds from the first arrival to the last finish, and
            # good requests per second (null without SLOs, ``goodput`` in the config).
            "duration": dur,
            "request_goodput": (None if self.slos is None
                                else self.good / dur if dur else 0.0),
        }
        self._flush_itl()
        for name, values in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self._itl),
                             ("e2el", self.e2el)):
            if isinstance(values, StreamingQuantiles):
                out.update(values.stats(name))
            else:
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
    # One partition for the three (each percentile is the same arithmetic as alone).
    values = np.percentile(ms, [q for _, q in PERCENTILES]).tolist()
    for (key, _), value in zip(PERCENTILES, values):
        out[f"{key}_{name}_ms"] = value
    return out
