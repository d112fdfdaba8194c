"""The online server's routes in-process (FastAPI's TestClient, the pacer on its event loop):
a length law's "stop" finishes, a local tokenizer's prompt counts, the real executor's own
tokens, prefix-cache hits for a chat that resends its history, and the server's outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from experiments.serve import server_state
from online.app import build_app
from tests.helpers import compose_named


def client(out: Path | None, *overrides: str) -> TestClient:
    state, _ = server_state(compose_named("serve", "model=tiny", *overrides), out)
    return TestClient(build_app(state))


def rows(out: Path) -> list[dict[str, str]]:
    with (out / "requests.csv").open() as f:
        return list(csv.DictReader(f))


def test_a_length_law_ends_answers_with_stop_unless_ignore_eos(tmp_path):
    with client(tmp_path, "serve.output_len={dist: fixed, value: 3}") as c:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 10}
        r = c.post("/v1/completions", json=body).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (3, "stop")
        r = c.post("/v1/completions", json={**body, "ignore_eos": True}).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (
            10, "length")
        r = c.post("/v1/completions", json={**body, "max_tokens": 2}).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (
            2, "length")
        text = c.get("/metrics").text
    assert 'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 1.0' in text
    assert [r["output_len"] for r in rows(tmp_path)] == ["3", "10", "2"]
    assert json.loads((tmp_path / "summary.json").read_text())["kv_blocks_leaked"] == 0
    assert (tmp_path / "report.html").exists()


def test_a_local_tokenizer_counts_the_prompts(tmp_path):
    pytest.importorskip("transformers")
    from online.local_tokenizer import build

    folder = build(tmp_path / "hf", "local/tok")
    with client(None, f"serve.tokenizer={folder}") as c:
        text = "The system model streams tokens to the server."
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": text,
                                            "max_tokens": 2}).json()
    from transformers import AutoTokenizer

    assert r["usage"]["prompt_tokens"] == len(AutoTokenizer.from_pretrained(
        str(folder)).encode(text))


def test_the_real_executor_streams_its_own_tokens(tmp_path):
    pytest.importorskip("torch")
    with client(tmp_path, "executor=real", "device=cpu") as c:
        with c.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 6,
                "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["text"]]
    ids = rows(tmp_path)[0]["output_token_ids"].split()
    assert len(ids) == 6 and texts == [f" <{i}>" for i in ids]


def test_a_chat_that_resends_its_history_hits_the_prefix_cache(tmp_path):
    with client(tmp_path, "policy=vllm_v1") as c:
        history = [{"role": "system", "content": "You are terse. " * 40},
                   {"role": "user", "content": "First question, please answer it."}]
        c.post("/v1/chat/completions", json={"model": "tiny", "messages": history,
                                             "max_tokens": 4})
        history += [{"role": "assistant", "content": "An answer."},
                    {"role": "user", "content": "And a second one?"}]
        c.post("/v1/chat/completions", json={"model": "tiny", "messages": history,
                                             "max_tokens": 4})
        metrics = c.get("/metrics").text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total"))
    assert hits >= 128  # the system prompt's whole blocks, at least
    assert int(rows(tmp_path)[1]["num_cached_tokens"]) == hits


@pytest.mark.parametrize("speed", [1, 1000])
def test_chat_streams_the_role_then_every_token_in_order(speed):
    """At 1000x the pacer hands a stream several tokens at once (and its end with them)."""
    from online.tokens import FILLER

    with client(None, f"serve.speed={speed}") as c:
        for max_tokens in (1, 3, 40):
            with c.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": max_tokens, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            deltas = [e["choices"][0]["delta"] for e in events]
            assert deltas[0] == {"role": "assistant", "content": ""}
            texts = [d["content"] for d in deltas[1:-1]]
            assert texts == [FILLER[i % len(FILLER)] for i in range(max_tokens)]
            assert deltas[-1] == {} and events[-1]["choices"][0]["finish_reason"] == "length"


def test_metrics_count_tokens_and_preemptions_as_they_happen():
    """Scraped while two requests are in flight on a pool too small for both: the tokens
    sampled so far, both first tokens and the preemption are counted already."""
    import asyncio

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    # 8 blocks of 16 tokens: two 60-token prompts fill them; the first decode to need a new
    # block preempts the later request.
    state, _ = server_state(compose_named(
        "serve", "model=tiny", "serve.speed=1", "kv.block_size=16",
        "kv.num_gpu_blocks_override=8", "policy.max_num_seqs=2", "policy.kv_watermark=0"), None)
    pacer = state.pacer

    def scrape() -> dict[str, float]:
        """Each sample name's value, summed over its labels (``finished_reason``: a request
        the wall clock has run to its end by the time the others are aborted counts under
        ``length``)."""
        text = generate_latest(state.metrics.registry).decode()
        totals: dict[str, float] = {}
        for f in text_string_to_metric_families(text):
            for s in f.samples:
                totals[s.name] = totals.get(s.name, 0.0) + s.value
        return totals

    async def main() -> tuple[dict[str, float], int, int]:
        task = asyncio.create_task(pacer.run())
        await asyncio.sleep(0)
        a, b = pacer.submit(60, 60), pacer.submit(60, 60)
        for _ in range(5000):  # about 2 ms of simulated (and wall) time
            if a.req.num_preemptions + b.req.num_preemptions:
                break
            await asyncio.sleep(0.001)
        pacer.catch_up()
        live = scrape()
        sent = a.sent + b.sent
        assert not (a.req.is_finished or b.req.is_finished)
        task.cancel()
        pacer.abort_all_and_settle()
        return live, sent, a.req.num_preemptions + b.req.num_preemptions

    live, sent, preemptions = asyncio.run(main())
    assert live["vllm:num_preemptions_total"] == preemptions >= 1
    assert live["vllm:generation_tokens_total"] == sent >= 2
    assert live["vllm:time_to_first_token_seconds_count"] == 2
    assert live["vllm:prompt_tokens_total"] == 120
    assert live["vllm:inter_token_latency_seconds_count"] == sent - 2
    assert live["vllm:e2e_request_latency_seconds_count"] == 0
    done = scrape()  # both left (aborted, or finished): what they computed stays counted
    assert done["vllm:num_preemptions_total"] == preemptions
    assert done["vllm:request_success_total"] == 2
