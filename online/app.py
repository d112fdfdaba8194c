"""The HTTP surface of the online engine (FastAPI): OpenAI's completions and chat completions,
streamed by server-sent events or answered whole, ``/v1/models``, ``/health`` and
``/metrics``.

A request is submitted to the engine when its body has been read and checked; its tokens go
out as the pacer releases them, one event per token. A client that disconnects aborts its
request (its blocks are freed before the next step). While the server shuts down, new
requests get 503; above ``max_waiting`` requests waiting in the engine, 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from online.metrics import ServerMetrics
from online.pacer import Pacer, Stream
from online.protocol import APIError, Ask, parse_ask, parse_json
from online.tokens import PromptCounter, prefix_spans
from sim.request import RequestStatus
from sim.result import SimulationResult

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    pacer: Pacer
    counter: PromptCounter
    model_name: str
    max_model_len: int
    max_waiting: int | None = None
    engine_needs_ids: bool = False  # the real executor computes on the prompt's token ids
    prefix_caching: bool = False  # prompts carry content spans for the prefix cache
    # Where an answer would end by itself (its end-of-sequence token), drawn per request;
    # None: every request runs to max_tokens.
    output_len: Callable[[], int] | None = None
    on_close: Callable[[SimulationResult], None] | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    result: SimulationResult | None = None

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.pacer, self.model_name, self.max_model_len)
        self.pacer.on_leave = self.metrics.observe
        self.pacer.on_tokens = self.metrics.observe_tokens


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def build_app(state: ServerState) -> FastAPI:
    pacer = state.pacer

    def pacer_stopped(task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # The engine failed: say so, and refuse what comes (streams in flight end at the
        # shutdown, which writes what can be written).
        state.draining = True
        log.error("the engine stopped: %r; new requests get 503, stop the server",
                  task.exception(), exc_info=task.exception())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(pacer.run())
        task.add_done_callback(pacer_stopped)
        try:
            yield
        finally:
            state.draining = True
            task.cancel()
            engine_ok = True
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 (reported by pacer_stopped; no engine, no outputs)
                engine_ok = False
            if engine_ok:
                pacer.abort_all_and_settle()
                state.result = pacer.engine.close()
                if state.on_close is not None:
                    state.on_close(state.result)

    app = FastAPI(title="llmserve-sim online", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.draining else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "llmserve-sim", "root": state.model_name,
            "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        pacer.catch_up()
        return Response(generate_latest(state.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool) -> Response:
        if state.draining:
            raise APIError(503, "the server is shutting down")
        ask = parse_ask(parse_json(await request.body()), chat=chat,
                        served_model=state.model_name, max_model_len=state.max_model_len,
                        counter=state.counter)
        pacer.catch_up()  # the queue as of now
        if state.max_waiting is not None and pacer.engine.num_waiting() >= state.max_waiting:
            raise APIError(429, f"the server is overloaded: {state.max_waiting} requests are "
                                f"waiting (serve.max_waiting); retry later")
        ids = ask.prompt_token_ids
        drawn = None if ask.ignore_eos or state.output_len is None else state.output_len()
        stream = pacer.submit(ask.prompt_len, ask.max_tokens, priority=ask.priority,
                              output_len=None if drawn is None else min(drawn, ask.max_tokens),
                              prompt_token_ids=ids if state.engine_needs_ids else None,
                              prefix=prefix_spans(ids) if state.prefix_caching else None)
        req = stream.req
        if req.status is RequestStatus.REJECTED:
            raise APIError(400, f"the engine cannot serve this request: {req.reject_reason}",
                           "max_tokens" if "too_long" in str(req.reject_reason) else None)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id}"
        if ask.stream:
            return StreamingResponse(_events(stream, ask, rid),
                                     media_type="text/event-stream")
        return await _whole(request, stream, ask, rid)

    def _text(stream: Stream, k: int) -> str:
        ids = stream.req.output_token_ids
        return state.counter.text(k - 1, None if ids is None else ids[k - 1])

    def _usage(stream: Stream) -> dict[str, int]:
        p, c = stream.req.prompt_len, stream.req.num_output_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _choice(ask: Ask, text: str | None, finish: str | None, role: bool = False
                ) -> dict[str, Any]:
        if not ask.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish,
                    "stop_reason": None}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    async def _events(stream: Stream, ask: Ask, rid: str) -> AsyncIterator[str]:
        head = {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion",
                "created": int(time.time()), "model": state.model_name}
        # A token's event is this stream's template with the token's text put in (no
        # encoding of the whole chunk per token).
        mark = json.dumps("\x00")
        before, after = _sse({**head, "choices": [_choice(ask, "\x00", None)]}).split(mark)
        queue = stream.queue
        try:
            item = await queue.get()
            if ask.chat and item is not None:  # the role, just before the first token
                yield _sse({**head, "choices": [_choice(ask, "", None, role=True)]})
            while item is not None:
                # Every token already here goes out in one write.
                events = []
                while item is not None:
                    k, t = item
                    pacer.delivered(t)
                    events.append(before + json.dumps(_text(stream, k)) + after)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                yield "".join(events)
                if item is not None:
                    item = await queue.get()
            yield _sse({**head, "choices": [_choice(ask, None if ask.chat else "",
                                                    stream.finish_reason)]})
            if ask.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(stream)})
            yield _sse("[DONE]")
        finally:  # the client went away (the task is cancelled) or the stream ended
            pacer.abort(stream)

    async def _whole(request: Request, stream: Stream, ask: Ask, rid: str) -> Response:
        async def tokens() -> list[str]:
            out, last = [], None
            while (item := await stream.queue.get()) is not None:
                out.append(_text(stream, item[0]))
                last = item[1]
            if last is not None:  # the answer goes out whole with its last token
                pacer.delivered(last)
            return out

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        collect = asyncio.create_task(tokens())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()
                pacer.abort(stream)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody is listening
        text = "".join(collect.result())
        if ask.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": stream.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": stream.finish_reason, "stop_reason": None}
        return JSONResponse({"id": rid, "object": "chat.completion" if ask.chat
                             else "text_completion", "created": int(time.time()),
                             "model": state.model_name, "choices": [choice],
                             "usage": _usage(stream)})

    return app
