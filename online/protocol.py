"""The OpenAI API as the server reads it: the body of a completion or chat completion request
turned into what the engine needs (prompt length, output length, streaming options), and the
errors, each an OpenAI-style body with its HTTP status.

Field rules follow vLLM's OpenAI-compatible server: ``max_tokens`` defaults to 16 for
completions (the rest of the model's context when null) and to the rest of the context for
chat (where ``max_completion_tokens`` wins over ``max_tokens``); ``n`` must be 1; sampling
fields (``temperature``, ``top_p``, ``seed``, ...) are accepted and have no effect on a
simulated engine; ``ignore_eos`` makes the output run to ``max_tokens`` even where the
server's length law (``serve.output_len``) would end it earlier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from online.tokens import PromptCounter


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type",
    "param", "code"}}`` and the HTTP status ``status``."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError",
        503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Ask:
    """One request as the engine takes it."""

    chat: bool
    model: str
    prompt_len: int
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}")
    return body


def _int_field(body: dict[str, Any], name: str, default: int | None, minimum: int
               ) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise APIError(400, f"{name} must be an integer >= {minimum}, got {value!r}", name)
    return value


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {value!r}", name)
    return value


def parse_ask(body: dict[str, Any], *, chat: bool, served_model: str, max_model_len: int,
              counter: PromptCounter) -> Ask:
    """``body`` of ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` checked and
    measured. Raises ``APIError`` naming the field at fault."""
    model = body.get("model")
    if model is None:  # vLLM serves its one model
        model = served_model
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {model!r}", "model")
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist.", "model")
    n = _int_field(body, "n", 1, 1)
    if n is not None and n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {n}", "n")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list of {role, content}",
                           "messages")
        for i, m in enumerate(messages):
            ok = isinstance(m, dict) and isinstance(m.get("role"), str)
            content = m.get("content") if isinstance(m, dict) else None
            ok = ok and (isinstance(content, str) or content is None or (
                isinstance(content, list) and all(isinstance(p, dict) for p in content)))
            if not ok:
                raise APIError(400, f"messages[{i}] must be an object with a string role "
                                    f"and content", f"messages[{i}]")
        prompt_len, ids = counter.count_chat(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_len, ids = counter.count_text(prompt)
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                      for t in prompt)):
            prompt_len, ids = counter.count_ids(prompt)
        else:
            raise APIError(400, "prompt must be a string, a list of token ids, or a list "
                                "of one of either (one prompt per request)", "prompt")
    if prompt_len < 1:
        raise APIError(400, "the prompt is empty", "messages" if chat else "prompt")
    room = max_model_len - prompt_len
    if chat:
        max_tokens = _int_field(body, "max_completion_tokens", None, 1)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", None, 1)
        if max_tokens is None:
            max_tokens = room
    else:  # vLLM: 16 when left out, the rest of the context when null
        max_tokens = _int_field(body, "max_tokens", 16, 1)
        if max_tokens is None:
            max_tokens = room
    if max_tokens < 1 or prompt_len + max_tokens > max_model_len:
        raise APIError(400, (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the "
            f"{'messages' if chat else 'prompt'}, {max(max_tokens, 1)} in the completion). "
            f"Please reduce the length of the {'messages' if chat else 'prompt'} or "
            f"completion."), "max_tokens")
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options can only be set when stream is true",
                       "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise APIError(400, f"stream_options.include_usage must be true or false, got "
                            f"{include_usage!r}", "stream_options.include_usage")
    priority = _int_field(body, "priority", 0, -(2**31))
    return Ask(chat=chat, model=model, prompt_len=prompt_len, prompt_token_ids=ids,
               max_tokens=max_tokens, ignore_eos=_bool_field(body, "ignore_eos"),
               stream=stream, include_usage=include_usage,
               priority=int(priority or 0))
