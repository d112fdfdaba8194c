"""How many concurrent streams the online server sustains on one core at ``serve.speed=1``.

    python -m experiments.bench_serve                       # 32, 64, 128, 256, 512 streams
    python -m experiments.bench_serve streams=[64,128] duration_s=20

For each count, the server (``python -m experiments.serve``, every override but this
command's own goes to it) runs pinned to one core while this process, on the other cores,
keeps that many streamed completions open (each asks ``max_tokens`` tokens; a new one starts
as one ends) for ``duration_s`` seconds. Printed per count: the tokens the clients received
per second, the server's pacing lag (how late, in wall ms, it handed tokens to their
connections after their simulated time: p50 / p99 / max over its tokens, from
summary.json), and the clients' TPOT against the simulator's (median of the per-request
ratio). The server keeps up while the lag stays near the event loop's granularity (about
1 ms). A benchmark, not a test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.common import markdown_table
from experiments.hydra_errors import hydra_errors_as_config_errors
from experiments.run import resolved
from online.launch import serving
from sim.errors import exit_on_config_error, require

log = logging.getLogger(__name__)
OWN = ("streams", "duration_s", "max_tokens", "prompt_words", "server_cpu")


class EventCounter:
    """Counts a streamed completion's events in its raw bytes as they come, without parsing
    them line by line (the client spends as little as it can per token, so that the server
    is what is measured): an event may be split across chunks anywhere, its marker too.
    ``request_id``: the id of the first event (``cmpl-<id>``), once its bytes are in."""

    MARK = b"data: {"
    ID = b'"id": "cmpl-'

    def __init__(self) -> None:
        self.events = 0
        self.request_id: int | None = None
        self._tail = b""  # the last bytes, shorter than a marker: one may go on in the next
        self._head = b""  # the bytes until the first event's id is whole

    def feed(self, chunk: bytes) -> int:
        """The events whose marker this chunk completes."""
        data = self._tail + chunk
        self._tail = data[1 - len(self.MARK):]
        k = data.count(self.MARK)
        self.events += k
        if self.request_id is None:
            self._head += chunk
            at = self._head.find(self.ID)
            if at >= 0:
                start = at + len(self.ID)
                end = self._head.find(b'"', start)
                if end >= 0:
                    self.request_id = int(self._head[start:end])
                    self._head = b""
        return k


async def drive(url: str, model: str, streams: int, duration_s: float, max_tokens: int,
                prompt_words: int) -> tuple[dict[int, tuple[float, float, int]], int]:
    """``streams`` streams kept open for ``duration_s``: request id -> (first token wall
    time, last token wall time, tokens) of each stream that finished, and the tokens
    received before ``duration_s`` was up."""
    done: dict[int, tuple[float, float, int]] = {}
    received = [0]
    body = {"model": model, "prompt": "hello " * prompt_words, "max_tokens": max_tokens,
            "stream": True}
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        stop = time.perf_counter() + duration_s

        async def one_stream() -> None:
            while time.perf_counter() < stop:
                first = last = None
                counter = EventCounter()
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for chunk in r.aiter_raw():
                        k = counter.feed(chunk)
                        if not k:
                            continue
                        last = time.perf_counter()
                        if first is None:
                            first = last
                        received[0] += k if last < stop else 0
                tokens = counter.events - 1  # the last event carries the finish reason
                received[0] -= 1 if last is not None and last < stop else 0
                if tokens == max_tokens and counter.request_id is not None:
                    done[counter.request_id] = (first, last, tokens)

        await asyncio.gather(*(one_stream() for _ in range(streams)))
    return done, received[0]


def run(cfg: dict[str, Any], overrides: list[str], out: Path) -> list[dict[str, Any]]:
    counts = cfg["streams"]
    require(isinstance(counts, list) and counts and all(
        isinstance(n, int) and n >= 1 for n in counts), "streams",
        f"must be a list of stream counts >= 1, got {counts!r}")
    server_cpu = int(cfg["server_cpu"])
    cores = os.sched_getaffinity(0)
    require(server_cpu in cores and len(cores) >= 2, "server_cpu",
            f"must be one of this process's cores {sorted(cores)} (and another left for the "
            f"clients), got {server_cpu}")
    os.sched_setaffinity(0, cores - {server_cpu})  # the clients stay off the server's core
    rows = []
    for n in counts:
        with serving(out / f"streams_{n}", *overrides, "overwrite=true",
                     cpus={server_cpu}) as s:
            model = httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"]
            seen, received = asyncio.run(drive(s.url, model, n, float(cfg["duration_s"]),
                                     int(cfg["max_tokens"]), int(cfg["prompt_words"])))
        summary = s.summary()
        req = s.requests()
        ratios = [((last - first) / (k - 1)) / float(req[rid]["tpot"])
                  for rid, (first, last, k) in seen.items()
                  if req.get(rid, {}).get("status") == "finished"]
        rows.append({
            "streams": n, "tokens_per_s": round(received / float(cfg["duration_s"])),
            "pacing_lag_p50_ms": round(summary["pacing_lag_p50_ms"], 2),
            "pacing_lag_p99_ms": round(summary["pacing_lag_p99_ms"], 2),
            "pacing_lag_max_ms": round(summary["pacing_lag_max_ms"], 2),
            "client_tpot_over_sim": round(statistics.median(ratios), 3) if ratios else None,
            "requests_finished": len(ratios)})
        log.info(markdown_table(rows[-1:]))
    pd.DataFrame(rows).to_csv(out / "bench_serve.csv", index=False)
    return rows


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_serve")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    overrides = [o for o in HydraConfig.get().overrides.task
                 if not o.lstrip("+~").startswith(("hydra.", *OWN))]
    with exit_on_config_error():
        rows = run(resolved(cfg), overrides, out)
    log.info(markdown_table(rows))
    log.info(f"outputs: {out}")


if __name__ == "__main__":
    with hydra_errors_as_config_errors():
        main()
