"""The OpenAI request bodies the online server reads (online/protocol.py, online/tokens.py):
every body gets either a request the engine can take or an OpenAI-style error naming the
field; prompt lengths from a tokenizer or the documented estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from online.protocol import APIError, parse_ask, parse_json
from online.tokens import PromptCounter, estimate_tokens, prefix_spans

MODEL, CONTEXT = "m", 4096
COUNTER = PromptCounter(vocab_size=32000)


def ask(body: dict, chat: bool = False):
    return parse_ask(body, chat=chat, served_model=MODEL, max_model_len=CONTEXT,
                     counter=COUNTER)


def error(body: dict, chat: bool = False) -> APIError:
    with pytest.raises(APIError) as e:
        ask(body, chat)
    return e.value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "other", 3, None]),
    "prompt": json_values | st.lists(st.integers(0, 70000), min_size=1, max_size=50),
    "messages": json_values | st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=60)}),
        min_size=1, max_size=3),
    "max_tokens": json_values, "max_completion_tokens": json_values, "n": json_values,
    "stream": json_values, "stream_options": json_values, "ignore_eos": json_values,
    "priority": json_values})


@settings(max_examples=300, deadline=None)
@given(body=fields, chat=st.booleans())
def test_every_body_is_taken_or_refused_with_an_openai_error(body, chat):
    try:
        a = ask(body, chat)
    except APIError as e:
        assert e.status in (400, 404) and e.message
        out = e.body()["error"]
        assert out["code"] == e.status and out["type"] in ("BadRequestError", "NotFoundError")
        return
    assert a.model == MODEL and a.chat == chat
    assert a.prompt_len >= 1 and a.max_tokens >= 1
    assert a.prompt_len + a.max_tokens <= CONTEXT
    assert len(a.prompt_token_ids) == a.prompt_len
    assert all(0 <= t < 32000 for t in a.prompt_token_ids)


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=60))
def test_any_bytes_are_json_or_a_400(raw):
    try:
        body = parse_json(raw)
    except APIError as e:
        assert e.status == 400
        return
    assert isinstance(body, dict) and json.loads(raw) == body


def test_vllm_defaults_and_fields():
    a = ask({"model": MODEL, "prompt": "abcd" * 10})
    assert (a.prompt_len, a.max_tokens, a.stream, a.include_usage) == (10, 16, False, False)
    a = ask({"model": MODEL, "messages": [{"role": "user", "content": "abcd" * 10}]},
            chat=True)
    assert a.prompt_len == 10 + 4 + 3  # content, the message's 4, the reply's 3
    assert a.max_tokens == CONTEXT - a.prompt_len  # chat: the rest of the context
    a = ask({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 9, "max_completion_tokens": 5, "stream": True,
             "stream_options": {"include_usage": True}}, chat=True)
    assert (a.max_tokens, a.stream, a.include_usage) == (5, True, True)
    a = ask({"model": MODEL, "prompt": [[5, 6, 7]], "max_tokens": 3, "ignore_eos": True})
    assert (a.prompt_len, a.prompt_token_ids, a.ignore_eos) == (3, [5, 6, 7], True)
    # vLLM's leniencies: no model (its one model), n null, max_tokens null (the rest).
    a = ask({"prompt": "abcd", "n": None, "max_tokens": None})
    assert (a.model, a.max_tokens) == (MODEL, CONTEXT - 1)


@pytest.mark.parametrize(("body", "chat", "status", "param"), [
    ({"model": "gpt-4", "prompt": "hi"}, False, 404, "model"),
    ({"model": 3, "prompt": "hi"}, False, 400, "model"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, False, 400,
     "stream_options"),
    ({"model": MODEL, "prompt": "hi", "stream": True,
      "stream_options": {"include_usage": "false"}}, False, 400,
     "stream_options.include_usage"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, False, 400, "n"),
    ({"model": MODEL, "prompt": ["a", "b"]}, False, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, False, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 4096}, False, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "9"}, False, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, False, 400, "stream"),
    ({"model": MODEL, "prompt": "hi", "stream_options": 1}, False, 400, "stream_options"),
    ({"model": MODEL, "messages": []}, True, 400, "messages"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, True, 400, "messages[0]"),
])
def test_refusals_name_the_field(body, chat, status, param):
    e = error(body, chat)
    assert (e.status, e.param) == (status, param)


def test_context_error_is_vllms_message():
    e = error({"model": MODEL, "prompt": "abcd" * 100, "max_tokens": 4000})
    assert e.message.startswith("This model's maximum context length is 4096 tokens. "
                                "However, you requested 4100 tokens (100 in the prompt, "
                                "4000 in the completion).")


def test_the_estimate_and_its_stand_in_ids():
    assert estimate_tokens("") == 0 and estimate_tokens("abcde") == 2
    assert estimate_tokens("é" * 4) == 2  # bytes, not characters
    n, ids = COUNTER.count_text("The same start, then more")
    _, other = COUNTER.count_text("The same start, and else")
    assert (n, len(ids)) == (7, 7) and ids[:3] == other[:3] and ids != other


def test_prompts_that_start_alike_share_prefix_keys():
    a = prefix_spans(list(range(40)))
    b = prefix_spans([*range(32), 99, 98])
    assert [n for _, n in a] == [16, 16, 8]
    assert a[:2] == b[:2] and a[2] != b[2]


def test_a_local_tokenizer_counts_the_prompt(tmp_path: Path):
    pytest.importorskip("transformers")
    from online.local_tokenizer import build

    folder = build(tmp_path / "hf", "local/tok")
    counter = PromptCounter(str(folder), vocab_size=32000)
    text = "The system model streams tokens to the server."
    n, ids = counter.count_text(text)
    assert n == len(counter.tokenizer.encode(text)) and ids == counter.tokenizer.encode(text)
    assert counter.text(0, ids[1]) == counter.tokenizer.decode([ids[1]])
    from sim.errors import ConfigError
    with pytest.raises(ConfigError, match="serve.tokenizer"):
        PromptCounter(str(tmp_path / "nowhere"))
