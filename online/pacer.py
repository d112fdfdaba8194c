"""The online engine on the wall clock: simulated time = (wall time since start) x ``speed``.

One asyncio task (``run``) sleeps until the wall time of the engine's next event, processes
every event due by the wall clock's simulated time (``OnlineEngine.run_until``) and hands each
request's new tokens to its stream, stamped with their simulated times. A request submitted
now arrives at the simulated time the wall clock reads now; the engine is first brought up to
that time, so nothing it does can depend on a request still to come.

Pacing error: a token reaches its connection when the task wakes after the wall time of the
step that sampled it and the connection's handler runs: the event loop's timer granularity
(about 1 ms) plus the time to process the events due and the other connections' work, more
when the server is busier than one core allows (the simulated clock keeps following the wall
clock; tokens then come late, never early). ``delivered`` records it per token.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from sim.online import OnlineEngine
from sim.request import Request, RequestStatus

LAG_SAMPLES = 200_000  # pacing lags kept for the summary's percentiles (1.6 MB)


@dataclass(eq=False)
class Stream:
    """What a client's connection reads: tokens as (count so far, simulated time) in
    ``queue``, then ``None`` once the request has left (finished, aborted or rejected)."""

    req: Request
    max_tokens: int  # what the client asked for (the request may stop before: a length law)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0

    @property
    def finish_reason(self) -> str:
        """OpenAI's: ``length`` (ran to max_tokens), ``stop`` (ended before it, as its length
        law drew), ``abort`` (its client gave up or the server stopped) or ``error``
        (rejected at arrival)."""
        req = self.req
        if req.status is RequestStatus.FINISHED:
            return "length" if req.num_output_tokens >= self.max_tokens else "stop"
        return "abort" if req.status is RequestStatus.ABORTED else "error"


class Pacer:
    def __init__(self, engine: OnlineEngine, speed: float = 1.0,
                 on_leave: Callable[[Stream], None] | None = None,
                 on_tokens: Callable[[Stream, int, int], None] | None = None) -> None:
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive number, got {speed!r}")
        self.engine = engine
        self.speed = speed
        self.on_leave = on_leave  # each request as it leaves, once its last token is queued
        # Each stream's new tokens as they are queued: (stream, first index, end index).
        self.on_tokens = on_tokens
        self.streams: dict[int, Stream] = {}
        self._wake = asyncio.Event()
        self._t0: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Per token handed to its connection: how long after the wall time of its simulated
        # time (s), the pacing error a client sees on top of the HTTP (``delivered``); a
        # uniform sample of at most LAG_SAMPLES of them (a long-running server stays bounded) and
        # the largest.
        self.lags = array("d")
        self.num_lags = 0
        self.max_lag = 0.0
        self._sample = random.Random(0)
        self.stopped = False

    # ---- the clock ------------------------------------------------------------------------
    def sim_now(self) -> float:
        """The simulated time the wall clock reads now."""
        assert self._loop is not None and self._t0 is not None, "the pacer is not running"
        return (self._loop.time() - self._t0) * self.speed

    def wall_of(self, t: float) -> float:
        assert self._t0 is not None
        return self._t0 + t / self.speed

    def catch_up(self) -> None:
        """Process every event due by now and release the tokens they sampled."""
        if self.stopped:
            return
        self.engine.run_until(max(self.sim_now(), self.engine.now))
        self._release()

    async def run(self) -> None:
        """The pacing task: runs until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time() - self.engine.now / self.speed
        self.engine.wall0 = time.perf_counter()  # the server's wall time counts from here
        while True:
            self.catch_up()
            due = self.engine.next_event_time()
            self._wake.clear()
            delay = None if math.isinf(due) else max(0.0, self.wall_of(due) - self._loop.time())
            if delay == 0.0:
                await asyncio.sleep(0)  # let the connections run between busy stretches
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:  # (not the builtin TimeoutError before 3.11)
                pass

    def delivered(self, token_time: float) -> None:
        """A token sampled at simulated ``token_time`` goes to its connection now."""
        assert self._loop is not None
        lag = self._loop.time() - self.wall_of(token_time)
        self.num_lags += 1
        self.max_lag = max(self.max_lag, lag)
        if len(self.lags) < LAG_SAMPLES:
            self.lags.append(lag)
        else:  # reservoir sampling: each lag so far is kept with the same chance
            j = self._sample.randrange(self.num_lags)
            if j < LAG_SAMPLES:
                self.lags[j] = lag

    def lag_summary(self) -> dict[str, float | None]:
        """``pacing_lag_{p50,p99,max}_ms``: how late, in wall ms, tokens were handed to their
        connections after their simulated time (null before any was)."""
        lags = sorted(self.lags)
        if not lags:
            return {f"pacing_lag_{k}_ms": None for k in ("p50", "p99", "max")}
        at = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))] * 1e3
        return {"pacing_lag_p50_ms": at(0.5), "pacing_lag_p99_ms": at(0.99),
                "pacing_lag_max_ms": self.max_lag * 1e3}

    # ---- requests -------------------------------------------------------------------------
    def submit(self, prompt_len: int, max_tokens: int, *, output_len: int | None = None,
               priority: int = 0, prompt_token_ids: list[int] | None = None,
               prefix: tuple[tuple[int, int], ...] | None = None) -> Stream:
        """A request arriving now that generates ``output_len`` tokens (default
        ``max_tokens``). Its stream ends at once if it was rejected at arrival
        (``stream.req.reject_reason``)."""
        self.catch_up()
        req = self.engine.submit(prompt_len, output_len or max_tokens, priority=priority,
                                 prompt_token_ids=prompt_token_ids, prefix=prefix)
        stream = Stream(req, max_tokens)
        if req.is_finished:
            stream.queue.put_nowait(None)
        else:
            self.streams[req.request_id] = stream
            self._wake.set()
        return stream

    def abort(self, stream: Stream) -> None:
        """The client left: its request leaves at its replica's next step boundary."""
        if not stream.req.is_finished:
            self.catch_up()
            self.engine.abort(stream.req)
            self._wake.set()

    def _release(self) -> None:
        done = []
        for rid, s in self.streams.items():
            req = s.req
            n = req.num_output_tokens
            if n > s.sent:
                times = req.token_times
                for i in range(s.sent, n):
                    s.queue.put_nowait((i + 1, times[i]))
                if self.on_tokens is not None:
                    self.on_tokens(s, s.sent, n)
                s.sent = n
            if req.is_finished:
                s.queue.put_nowait(None)
                done.append(rid)
        for rid in done:
            s = self.streams.pop(rid)
            if self.on_leave is not None:
                self.on_leave(s)

    # ---- the end --------------------------------------------------------------------------
    def abort_all_and_settle(self) -> None:
        """Stop pacing: bring the clock to now, abort every request still in the engine and
        run the clock (no longer paced) until they have left."""
        self.catch_up()
        for s in list(self.streams.values()):
            self.engine.abort(s.req)
        while self.engine.num_unfinished():
            due = self.engine.next_event_time()
            if math.isinf(due):
                raise RuntimeError(f"{self.engine.num_unfinished()} requests are left and "
                                   f"nothing is scheduled to take them out")
            self.engine.run_until(due)
        self._release()
        self.stopped = True
