"""``/metrics``: the online engine in Prometheus text, under vLLM's metric names and buckets.

Gauges are read from the engine when scraped: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:num_requests_swapped``, ``vllm:kv_cache_usage_perc``
(0 to 1), the prefix cache's counters ``vllm:prefix_cache_queries`` / ``_hits`` (prompt
tokens looked up / found), and ``vllm:num_preemptions`` (every preemption so far, of requests
in flight and of those that left). As vLLM counts per step, the tokens are counted as the
engine samples them (when the pacer hands them to their streams, with their simulated times):
``vllm:generation_tokens``, ``vllm:inter_token_latency_seconds``, and at a request's first
token ``vllm:time_to_first_token_seconds`` and its ``vllm:prompt_tokens``. As each request
leaves: ``vllm:request_success`` by ``finished_reason`` (``length``, ``stop``, ``abort``),
``vllm:request_queue_time_seconds`` (if it was scheduled), and for the finished ones
``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens`` and
``vllm:request_generation_tokens``. Every series carries the label ``model_name``; the
``_created`` series are off, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from online.pacer import Pacer, Stream
from sim.request import RequestStatus

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineGauges(Collector):
    """The engine's state at scrape time."""

    def __init__(self, pacer: Pacer, model_name: str) -> None:
        self.pacer = pacer
        self.model_name = model_name
        self.preemptions_of_those_left = 0

    def collect(self) -> Iterator[Metric]:
        engine, label = self.pacer.engine, [self.model_name]
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in model execution batches.",
                 engine.num_running()),
                ("vllm:num_requests_waiting", "Requests waiting to be processed.",
                 engine.num_waiting()),
                ("vllm:num_requests_swapped", "Requests swapped out to CPU.",
                 engine.num_swapped()),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 engine.kv_usage())):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        queries, hits = engine.prefix_cache_counts()
        # A request's count only grows, and moves to the total of those left when it leaves.
        preemptions = self.preemptions_of_those_left + sum(
            s.req.num_preemptions for s in self.pacer.streams.values())
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.",
                 queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", hits),
                ("vllm:num_preemptions", "Cumulative number of preemptions.", preemptions)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c


class ServerMetrics:
    """The registry ``/metrics`` exposes; ``observe`` each request as it leaves."""

    def __init__(self, pacer: Pacer, model_name: str, max_model_len: int) -> None:
        disable_created_metrics()  # vLLM exposes no ``_created`` series
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._gauges = _EngineGauges(pacer, model_name)
        reg.register(self._gauges)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=reg).labels(model_name)

        self.success = Counter("vllm:request_success", "Requests that left, by reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time spent waiting before first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_hist = histogram("vllm:request_prompt_tokens",
                                     "Prompt tokens per request.", token_buckets)
        self.generation_hist = histogram("vllm:request_generation_tokens",
                                         "Generation tokens per request.", token_buckets)

    def observe_tokens(self, stream: Stream, start: int, end: int) -> None:
        """``stream``'s request sampled its tokens ``start`` to ``end - 1`` (0-based): its
        prompt and TTFT at its first, the gaps before each later one."""
        req = stream.req
        self.generation_tokens.inc(end - start)
        if start == 0:
            self.prompt_tokens.inc(req.prompt_len)
            self.ttft.observe(req.ttft)
            start = 1
        if end > start:
            times = req.token_times
            for a, b in pairwise(times[start - 1:end]):
                self.itl.observe(b - a)

    def observe(self, stream: Stream) -> None:
        """``stream``'s request left (its tokens were observed as they came): finished or
        aborted, and the figures vLLM takes when a request finishes."""
        req = stream.req
        if req.status is RequestStatus.REJECTED:
            return  # answered with an error, never served
        self.success.labels(self.model_name, stream.finish_reason).inc()
        self._gauges.preemptions_of_those_left += req.num_preemptions
        if req.first_scheduled_time is not None:
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
        if req.status is not RequestStatus.FINISHED:
            return
        self.prompt_hist.observe(req.prompt_len)
        self.generation_hist.observe(req.num_output_tokens)
        self.e2e.observe(req.e2e_latency)
