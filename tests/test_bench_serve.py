"""bench_serve's client counts a stream's events in raw bytes: however the bytes are split
into chunks, it counts every event once and reads the request id."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from experiments.bench_serve import EventCounter


def _stream(rid: int, tokens: int) -> bytes:
    events = [{"id": f"cmpl-{rid}", "object": "text_completion",
               "choices": [{"index": 0, "text": " the", "finish_reason": None}]}
              for _ in range(tokens)]
    events.append({"id": f"cmpl-{rid}", "object": "text_completion",
                   "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@given(rid=st.integers(0, 10**9), tokens=st.integers(0, 30), data=st.data())
def test_every_split_of_a_stream_counts_the_same(rid, tokens, data):
    raw = _stream(rid, tokens)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=40), label="cuts"))
    counter = EventCounter()
    total = 0
    for a, b in zip([0, *cuts], [*cuts, len(raw)]):
        total += counter.feed(raw[a:b])
    assert total == counter.events == tokens + 1
    assert counter.request_id == rid


def test_byte_by_byte():
    raw = _stream(42, 5)
    counter = EventCounter()
    assert sum(counter.feed(raw[i:i + 1]) for i in range(len(raw))) == 6
    assert counter.request_id == 42
