"""Online mode: the simulated engine behind an OpenAI-compatible endpoint, in real time.

    python -m experiments.serve                              # port 8000, simulated time = wall time
    python -m experiments.serve serve.port=8080 serve.speed=10 policy=vllm_v1

Serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed or whole), ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text, vLLM's metric names) on ``serve.host``:
``serve.port``. Each request becomes a ``Request`` in the configured deployment, its tokens
released at their simulated times on the wall clock (``online/pacer.py``). Ctrl-C or SIGTERM
drains the requests in flight (``serve.drain_timeout_s``), aborts the rest and writes
requests.csv, steps.csv, summary.json and report.html into the run's folder. Needs the
``serve`` extra (FastAPI, uvicorn, prometheus-client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.hydra_errors import hydra_errors_as_config_errors
from experiments.run import LOCK, claim_output_dir, resolved
from experiments.simulation import Simulation
from sim.config_types import as_int
from sim.errors import ConfigError, exit_on_config_error, require, require_known_fields
from sim.online import OnlineEngine
from sim.report import format_summary, write_report
from workloads.distributions import LengthDistribution

if TYPE_CHECKING:
    from online.app import ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    speed: float = 1.0
    model_name: str | None = None
    max_waiting: int | None = 1024
    drain_timeout_s: float = 30.0
    tokenizer: str | None = None
    output_len: dict | None = None
    log_requests: bool = False

    @classmethod
    def from_dict(cls, data: Any) -> ServeConfig:
        if not isinstance(data, dict):
            raise ConfigError("serve", f"must be a mapping, got {data!r}")
        require_known_fields(data, cls, "serve", "option")
        c = cls(**data)
        require(isinstance(c.host, str) and bool(c.host), "serve.host",
                f"must be a host name or address, got {c.host!r}")
        require(isinstance(c.port, int) and not isinstance(c.port, bool)
                and 0 <= c.port <= 65535, "serve.port", f"must be 0..65535, got {c.port!r}")
        require(isinstance(c.speed, (int, float)) and not isinstance(c.speed, bool)
                and math.isfinite(c.speed) and c.speed > 0, "serve.speed",
                f"must be a positive number of simulated seconds per second, got {c.speed!r}")
        require(c.max_waiting is None or (isinstance(c.max_waiting, int)
                                          and c.max_waiting >= 1), "serve.max_waiting",
                f"must be >= 1 or null, got {c.max_waiting!r}")
        require(isinstance(c.drain_timeout_s, (int, float)) and c.drain_timeout_s >= 0,
                "serve.drain_timeout_s", f"must be >= 0 seconds, got {c.drain_timeout_s!r}")
        require(c.model_name is None or (isinstance(c.model_name, str) and c.model_name),
                "serve.model_name", f"must be a non-empty string or null, got {c.model_name!r}")
        return c


def server_state(container: dict[str, Any], out_dir: Path | None,
                 ) -> tuple[ServerState, ServeConfig]:
    """The online server a composed ``serve`` config describes, ready for
    ``online.app.build_app``: the engine, its pacer, the prompt counter and the length law.
    When it stops, its summary (with the pacing lag) and report.html go to ``out_dir``."""
    from online.app import ServerState
    from online.pacer import Pacer
    from online.tokens import PromptCounter

    container = dict(container)
    sc = ServeConfig.from_dict(container.pop("serve", None))
    output_len = None
    if sc.output_len is not None:
        law = LengthDistribution.from_dict("serve.output_len", sc.output_len)
        rng = np.random.default_rng(as_int(container.get("seed", 0), "seed", minimum=0))
        output_len = lambda: int(law.sample(rng, 1)[0])
    sim = Simulation(container, out_dir)
    pacer = Pacer(OnlineEngine(sim), sc.speed)

    def on_close(result: Any) -> None:
        result.summary.update(pacer.lag_summary())
        sim.write_summary(result.summary)
        if out_dir is not None:
            write_report(out_dir, result.summary, sim.report)

    counter = PromptCounter(sc.tokenizer, vocab_size=sim.model.vocab_size,
                            model_tokenizer=sim.model.hf_name)
    state = ServerState(pacer, counter,
                        sc.model_name or sim.model.name, sim.model.max_model_len,
                        sc.max_waiting, engine_needs_ids=sim.executor.produces_tokens,
                        prefix_caching=sim.prefix_caching, output_len=output_len,
                        on_close=on_close)
    return state, sc


def serve(cfg: DictConfig) -> dict:
    try:
        import uvicorn

        from online.app import build_app
    except ImportError as e:
        raise ConfigError("serve", f"online mode needs the serve extra ({e.name} is "
                          f"missing): pip install -e '.[serve]'") from None
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    container = resolved(cfg)
    ServeConfig.from_dict(container.get("serve"))  # its errors before the folder is claimed
    claim_output_dir(out_dir, bool(container.get("overwrite", False)))
    try:
        state, sc = server_state(container, out_dir)
        pacer = state.pacer
        app = build_app(state)

        loop_holder: list[asyncio.AbstractEventLoop] = []

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if not state.draining and loop_holder:
                    # New requests get 503; those in flight get drain_timeout_s, then are
                    # aborted, so each stream still ends whole (finish_reason "abort").
                    state.draining = True
                    loop_holder[0].call_soon_threadsafe(
                        lambda: loop_holder[0].create_task(drain(sc.drain_timeout_s)))
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # SIGINT / SIGTERM stop the server (handle_exit); once it has drained and
                # written its outputs the command ends normally, not by the signal again.
                before = {s: signal.signal(s, self.handle_exit)
                          for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, handler in before.items():
                        signal.signal(s, handler)

        # uvicorn waits for the connections a little longer than the drain: the aborted
        # streams' last events go out before it closes them.
        server = Server(uvicorn.Config(
            app, host=sc.host, port=sc.port, log_level="warning",
            access_log=sc.log_requests, timeout_graceful_shutdown=sc.drain_timeout_s + 10))

        async def drain(timeout: float) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while pacer.streams and loop.time() < deadline:
                await asyncio.sleep(0.02)
            for stream in list(pacer.streams.values()):
                pacer.abort(stream)

        async def main() -> None:
            loop_holder.append(asyncio.get_running_loop())
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            if server.started:
                host, port = server.servers[0].sockets[0].getsockname()[:2]
                print(f"serving {state.model_name} on http://{host}:{port} "
                      f"(speed {sc.speed:g}; prompt lengths: {state.counter.source}); "
                      f"outputs: {out_dir}", flush=True)
            await task

        asyncio.run(main())
    finally:
        (out_dir / LOCK).unlink(missing_ok=True)
    if state.result is None:  # the server never started (its error is printed)
        sys.exit(1)
    summary = state.result.summary
    log.info(format_summary(summary))
    log.info(f"outputs: {out_dir}")
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error():
        serve(cfg)


if __name__ == "__main__":
    with hydra_errors_as_config_errors():
        main()
