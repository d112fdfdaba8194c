"""Online mode as a user runs it: ``python -m experiments.serve`` on 127.0.0.1, real clients
(the ``openai`` package, httpx), stopped by SIGINT; then what it wrote.

The clients' latencies agree with requests.csv: counted from the moment the server's answer
starts (the server submits a request before it answers), a client's TTFT is the simulated TTFT
/ speed plus the pacer's release delay and the delivery (a few milliseconds); counted from the
moment the client sent it, never less than the simulated TTFT; the gaps between its tokens are
the simulated ones / speed."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families

from online.launch import serving

pytestmark = pytest.mark.slow
MODEL = "llama3_8b"  # the default config's model: decode steps of about 10 ms on an A100


def _stream_completions(url: str, n: int, gap_s: float, max_tokens: int
                        ) -> dict[int, tuple[float, float, list[float]]]:
    """``n`` streamed completions, one started every ``gap_s`` s, each in its own thread:
    request id -> (wall time its request went out, wall time its response's headers came,
    wall time of each token). The times come from httpx's hooks, which run in the thread that
    sends: the client's own work before sending (building the request, which a busy test
    process stretches) is left out."""
    mine = threading.local()  # each thread's [sent, answered]
    stamp = lambda _: mine.stamps.append(time.perf_counter())
    http = httpx.Client(event_hooks={"request": [stamp], "response": [stamp]})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                           http_client=http)
    out: dict[int, tuple[float, float, list[float]]] = {}

    def one(i: int) -> None:
        times, rid, mine.stamps = [], None, []
        for chunk in client.completions.create(model=MODEL, prompt="hello " * (40 + 25 * i),
                                               max_tokens=max_tokens, stream=True):
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
                rid = chunk.id
        sent, answered = mine.stamps
        out[int(rid.split("-")[1])] = (sent, answered, times)

    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join()
    http.close()
    return out


def _latency_gaps(seen: dict[int, tuple[float, float, list[float]]], rows: dict, speed: float
                  ) -> tuple[list[float], list[float], list[float]]:
    """Per request, in wall milliseconds: client TTFT counted from the send - simulated TTFT
    / speed, the same counted from the response's headers, and client TPOT - simulated TPOT /
    speed."""
    from_sent, from_answer, tpot = [], [], []
    for rid, (sent, answered, times) in seen.items():
        row = rows[rid]
        assert row["status"] == "finished" and int(row["output_len"]) == len(times)
        simulated_ttft = float(row["ttft"]) / speed
        from_sent.append(((times[0] - sent) - simulated_ttft) * 1e3)
        from_answer.append(((times[0] - answered) - simulated_ttft) * 1e3)
        client_tpot = (times[-1] - times[0]) / (len(times) - 1)
        tpot.append((client_tpot - float(row["tpot"]) / speed) * 1e3)
    return from_sent, from_answer, tpot


def _assert_clients_saw_the_simulated_latencies(seen: dict, rows: dict, summary: dict,
                                                speed: float) -> None:
    """Wall ms. No client sees its first token sooner after sending than the simulated TTFT /
    speed. Counted from the response's headers (the request is in the engine by then, so the
    client's own sending and the server's parsing are left out, which a busy machine
    stretches), the TTFT is at most the simulated one plus the pacing lag and the delivery (a
    few ms): less, by as much as the headers were delayed. The gaps between tokens are the
    simulated ones / speed, give or take the lag (a busy machine delays some releases)."""
    from_sent, from_answer, tpot = _latency_gaps(seen, rows, speed)
    lag50, lag99 = summary["pacing_lag_p50_ms"], summary["pacing_lag_p99_ms"]
    # Most tokens reach their connections within a few ms of their simulated times (a token
    # released a step late, 10 ms here, would not).
    assert lag50 < 5, summary
    assert min(from_sent) > 0, (sorted(from_sent), lag50)
    assert statistics.median(from_answer) < 8 + lag50, (sorted(from_answer), lag50)
    # Most within the bound; a client thread the machine starves for a while (a busy test
    # run) may read its tokens late.
    near = sum(gap < 8 + lag99 for gap in from_answer)
    assert near >= 0.75 * len(from_answer), (sorted(from_answer), lag99)
    assert abs(statistics.median(tpot)) < 1 + lag50, (sorted(tpot), lag50)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_openai_clients_metrics_errors_and_disconnects(tmp_path):
    with serving(tmp_path / "run") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
        whole = client.completions.create(model=MODEL, prompt="The capital of France is",
                                          max_tokens=7)
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 7 and whole.usage.prompt_tokens == 6
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
            stream=True, stream_options={"include_usage": True})
        chunks = list(chat)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices

        seen = _stream_completions(s.url, n=16, gap_s=0.05, max_tokens=24)

        # Bad requests: OpenAI-style bodies with the right status codes.
        post = lambda body, path="completions": httpx.post(
            f"{s.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
        for body, status, param in (
                (b"{not json", 400, None),
                (b'{"model": "gpt-4", "prompt": "hi"}', 404, "model"),
                (b'{"model": "llama3_8b", "prompt": "hi", "n": 2}', 400, "n"),
                (b'{"model": "llama3_8b", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
                (b'{"model": "llama3_8b"}', 400, "prompt"),
                (b'{"model": "llama3_8b", "prompt": "hi", "max_tokens": 9000}', 400,
                 "max_tokens")):
            r = post(body)
            assert r.status_code == status, body
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == status and err["message"]
        r = post(b'{"model": "llama3_8b", "messages": "hi"}', "chat/completions")
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0) as c2, \
                pytest.raises(openai.NotFoundError):
            c2.completions.create(model="nope", prompt="hi")

        # A client that disconnects mid-stream aborts its request.
        with httpx.stream("POST", f"{s.url}/v1/completions", json={
                "model": MODEL, "prompt": "go on", "max_tokens": 2000, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
        aborted_id = int(next(line for line in got if line.startswith("data: "))
                         .split('"id": "cmpl-')[1].split('"')[0])
        time.sleep(0.3)  # the abort lands at the next step boundary
        metrics = _metrics(s.url)
    assert s.returncode == 0, s.output
    rows = s.requests()
    summary = s.summary()
    assert rows[aborted_id]["status"] == "aborted"
    assert 0 < int(rows[aborted_id]["output_len"]) < 2000
    assert summary["aborted"] == 1 and summary["completed"] == 18
    assert summary["kv_blocks_leaked"] == 0
    assert (tmp_path / "run" / "report.html").exists()

    _assert_clients_saw_the_simulated_latencies(seen, rows, summary, speed=1.0)

    # /metrics, scraped once every request had left, agrees with requests.csv: what every
    # request computed (finished or aborted), the end-to-end latency of the finished.
    finished = [r for r in rows.values() if r["status"] == "finished"]
    sampled = [r for r in rows.values() if int(r["output_len"]) > 0]
    label = (("model_name", MODEL),)
    assert metrics[("vllm:request_success_total",
                    (("finished_reason", "length"), ("model_name", MODEL)))] == len(finished)
    assert metrics[("vllm:request_success_total",
                    (("finished_reason", "abort"), ("model_name", MODEL)))] == 1
    assert metrics[("vllm:prompt_tokens_total", label)] == sum(
        int(r["prompt_len"]) for r in sampled)
    assert metrics[("vllm:generation_tokens_total", label)] == sum(
        int(r["output_len"]) for r in rows.values())
    assert metrics[("vllm:time_to_first_token_seconds_count", label)] == len(sampled)
    assert metrics[("vllm:time_to_first_token_seconds_sum", label)] == pytest.approx(
        sum(float(r["ttft"]) for r in sampled), rel=1e-9)
    assert metrics[("vllm:e2e_request_latency_seconds_count", label)] == len(finished)
    assert metrics[("vllm:e2e_request_latency_seconds_sum", label)] == pytest.approx(
        sum(float(r["e2e_latency"]) for r in finished), rel=1e-9)
    assert metrics[("vllm:inter_token_latency_seconds_count", label)] == sum(
        int(r["output_len"]) - 1 for r in sampled)
    assert metrics[("vllm:num_requests_running", label)] == 0
    assert metrics[("vllm:num_requests_waiting", label)] == 0
    assert metrics[("vllm:kv_cache_usage_perc", label)] == 0
    assert not any(name.endswith("_created") for name, _ in metrics)


def test_a_disaggregated_deployment_serves_and_takes_disconnects(tmp_path):
    """One prefill and two decode replicas: streams get every token at the simulated times,
    a disconnect aborts wherever the request is, and the KV books balance at the end."""
    with serving(tmp_path / "run", "cluster=disaggregated", "cluster.num_decode_replicas=2") as s:
        seen = _stream_completions(s.url, n=8, gap_s=0.05, max_tokens=24)
        with httpx.stream("POST", f"{s.url}/v1/completions", json={
                "model": MODEL, "prompt": "go on", "max_tokens": 2000, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        aborted_id = int(next(line for line in got if line.startswith("data: "))
                         .split('"id": "cmpl-')[1].split('"')[0])
        time.sleep(0.3)  # the abort lands at the decode replica's next step boundary
    assert s.returncode == 0, s.output
    rows, summary = s.requests(), s.summary()
    assert (summary["completed"], summary["aborted"]) == (8, 1)
    assert summary["kv_blocks_leaked"] == 0 and summary["num_kv_transfers"] == 9
    aborted = rows[aborted_id]
    assert aborted["status"] == "aborted" and 0 < int(aborted["output_len"]) < 2000
    assert aborted["prefill_replica_id"] == "0" and aborted["decode_replica_id"] in ("1", "2")
    assert int(aborted["kv_transfer_bytes"]) > 0
    # Both decode replicas served (least_outstanding), and the streams saw the simulated
    # latencies: the first token on the prefill replica, the rest on a decode replica.
    assert {rows[rid]["decode_replica_id"] for rid in seen} == {"1", "2"}
    _assert_clients_saw_the_simulated_latencies(seen, rows, summary, speed=1.0)
