"""The online engine (sim/online.py) is the offline engine driven from outside: requests
submitted at their arrival times give the offline exact run's requests.csv and steps.csv,
row for row; an abort takes a request out at the next step boundary from any state, with
its blocks back in the free queue."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.online import OnlineEngine
from sim.request import RequestStatus
from tests.helpers import compose_cfg

POLICY_EXTRA = {"fcfs": [], "sjf": ["policy.predictor=noisy"],
                "priority": ["workload.priorities=[1,1,2]"],
                "chunked_prefill": ["policy.max_num_batched_tokens=256"],
                "vllm_v1": ["policy.max_num_batched_tokens=256",
                            "kv.enable_prefix_caching=false"]}


def _offline_then_online(tmp_path: Path, overrides: list[str]) -> tuple[str, str, str, str]:
    """requests.csv and steps.csv of the offline exact run, and of the online engine fed
    the same requests at their arrival times."""
    cfg = compose_cfg(*overrides, "step_mode=exact")
    offline = Simulation(cfg, tmp_path / "offline", keep_requests=True).run()
    online = OnlineEngine(Simulation(cfg, tmp_path / "online"))
    for req in sorted(offline.requests, key=lambda r: r.request_id):
        online.run_until(req.arrival_time)
        got = online.submit(req.prompt_len, req.max_output_len, priority=req.priority)
        assert got.request_id == req.request_id
    while online.num_unfinished():
        online.run_until(online.next_event_time())
    online.close()
    read = lambda d, f: (tmp_path / d / f).read_text()
    return (read("offline", "requests.csv"), read("online", "requests.csv"),
            read("offline", "steps.csv"), read("online", "steps.csv"))


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 100.0), blocks=st.integers(40, 300),
       policy=st.sampled_from(sorted(POLICY_EXTRA)), swap=st.booleans(),
       replicas=st.sampled_from([1, 2]))
def test_online_engine_replays_the_offline_exact_run(tmp_path, seed, qps, blocks, policy, swap,
                                                     replicas):
    run = tmp_path / f"{seed}-{policy}-{blocks}-{swap}-{replicas}"
    req_off, req_on, steps_off, steps_on = _offline_then_online(run, [
        "model=tiny", f"seed={seed}", f"workload.qps={qps}", "workload.num_requests=30",
        "workload.prompt_len.max=300", "workload.output_len.max=100",
        f"kv.num_gpu_blocks_override={blocks}", f"policy={policy}", *POLICY_EXTRA[policy],
        "policy.max_num_seqs=8",
        f"policy.preemption_mode={'swap' if swap and policy != 'vllm_v1' else 'recompute'}",
        f"cluster.num_replicas={replicas}", "cluster.router=least_outstanding"])
    assert req_on == req_off
    assert steps_on == steps_off


def _engine(tmp_path: Path, *overrides: str) -> OnlineEngine:
    # 16-token blocks, 8 of them, room for 2 sequences: a pool small enough to follow.
    cfg = compose_cfg("model=tiny", "step_mode=exact", "kv.block_size=16",
                      "kv.num_gpu_blocks_override=8", "kv.num_cpu_blocks=8",
                      "policy.max_num_seqs=2", "policy.kv_watermark=0", *overrides)
    return OnlineEngine(Simulation(cfg, tmp_path))


def _step(engine: OnlineEngine, n: int = 1) -> None:
    for _ in range(n):
        engine.run_until(engine.next_event_time())


def _rows(tmp_path: Path) -> dict[int, dict[str, str]]:
    import csv
    with (tmp_path / "requests.csv").open() as f:
        return {int(r["request_id"]): r for r in csv.DictReader(f)}


def test_abort_of_a_running_request_frees_its_blocks_at_the_next_step(tmp_path):
    e = _engine(tmp_path)
    kv = e.replicas[0].kv
    a = e.submit(40, 50)  # 3 blocks for its prompt
    b = e.submit(20, 50)  # 2 blocks
    _step(e)  # the replica wakes and plans the prefill of both
    assert kv.block_tables[a.request_id] == [0, 1, 2]
    assert kv.block_tables[b.request_id] == [3, 4]
    _step(e)  # the prefill ends (a first token each); the first decode step is planned
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 1)
    e.abort(a)  # a is in the decode step running now: it leaves when that step ends
    _step(e)
    assert a.status is RequestStatus.ABORTED and a.num_output_tokens == 2
    assert a.finish_time == a.token_times[-1] > a.first_token_time
    assert a.request_id not in kv.block_tables
    assert kv.num_used_blocks == 2
    assert [r.request_id for r in e.replicas[0].queues.running] == [b.request_id]
    # a's blocks went to the back of the free queue: the next request gets 5, 6, 7 first.
    c = e.submit(40, 5)
    _step(e)  # b's decode step ends; c's prefill is planned
    assert kv.block_tables[c.request_id] == [5, 6, 7]
    while e.num_unfinished():
        _step(e)
    result = e.close()
    assert (result.summary["completed"], result.summary["aborted"]) == (2, 1)
    assert result.summary["kv_blocks_leaked"] == 0
    row = _rows(tmp_path)[a.request_id]
    assert (row["status"], row["output_len"]) == ("aborted", "2")
    assert float(row["finish_time"]) == a.finish_time


def test_abort_before_the_step_that_would_run_it(tmp_path):
    e = _engine(tmp_path)
    a = e.submit(40, 50)
    e.abort(a)  # before the replica has woken up to plan: a never runs
    _step(e)
    assert a.status is RequestStatus.ABORTED and a.first_scheduled_time is None
    assert e.replicas[0].kv.num_used_blocks == 0
    assert e.next_event_time() == float("inf")


def test_abort_of_a_waiting_request_never_schedules_it(tmp_path):
    e = _engine(tmp_path)
    a, b, c = e.submit(20, 50), e.submit(20, 50), e.submit(20, 50)  # c waits: 2 seats
    e.abort(c)
    _step(e, 3)
    assert c.status is RequestStatus.ABORTED and c.first_scheduled_time is None
    assert c not in e.replicas[0].queues.waiting
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING)
    assert e.replicas[0].kv.num_used_blocks == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_of_a_preempted_request_frees_what_it_holds(tmp_path, mode):
    e = _engine(tmp_path, f"policy.preemption_mode={mode}")
    kv = e.replicas[0].kv
    a = e.submit(60, 60)  # 4 blocks, growing to 8
    b = e.submit(60, 60)  # 4 blocks: the pool is full after the prefill
    _step(e)  # both admitted
    assert kv.num_free_blocks == 0
    while b.status is RequestStatus.RUNNING:
        _step(e)  # the first decode that needs a block preempts b (the latest arrival)
    want = RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED
    assert b.status is want
    assert (b.request_id in kv.cpu_tables) == (mode == "swap")
    e.abort(b)
    _step(e)
    assert b.status is RequestStatus.ABORTED
    assert not kv.has_blocks(b.request_id)
    assert kv.num_free_cpu_blocks == kv.num_cpu_blocks
    while e.num_unfinished():
        _step(e)
    assert a.status is RequestStatus.FINISHED and a.num_output_tokens == 60
    assert e.close().summary["kv_blocks_leaked"] == 0


def test_abort_of_a_finished_request_changes_nothing(tmp_path):
    e = _engine(tmp_path)
    a = e.submit(20, 1)
    _step(e, 2)
    assert a.status is RequestStatus.FINISHED
    e.abort(a)
    assert e.next_event_time() == float("inf")
    assert e.close().summary["aborted"] == 0


def test_abort_on_a_pipelined_replica_waits_for_its_micro_batch(tmp_path):
    e = _engine(tmp_path, "cluster.pipeline_parallel_size=2", "kv.num_gpu_blocks_override=16")
    a, b = e.submit(20, 30), e.submit(20, 30)
    _step(e, 3)
    e.abort(a)
    while a.status is not RequestStatus.ABORTED:
        _step(e)
    assert not e.replicas[0].kv.has_blocks(a.request_id)
    while e.num_unfinished():
        _step(e)
    assert b.num_output_tokens == 30
    assert e.close().summary["kv_blocks_leaked"] == 0


def test_a_request_the_engine_cannot_serve_comes_back_rejected(tmp_path):
    e = _engine(tmp_path)
    r = e.submit(4000, 200)  # beyond tiny's 4096-token context
    assert r.status is RequestStatus.REJECTED and r.reject_reason.startswith("too_long")
    assert e.num_unfinished() == 0
    assert e.close().summary["rejected"] == 1


def test_online_engine_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(ConfigError, match="step_mode"):
        OnlineEngine(Simulation(compose_cfg("model=tiny"), tmp_path))


def test_offline_fast_replicas_refuse_aborts(tmp_path):
    sim = Simulation(compose_cfg("model=tiny", "workload.num_requests=5", "array_core=false"),
                     tmp_path)
    replica = sim.run().replicas[0]
    with pytest.raises(ValueError, match="step_mode=exact"):
        replica.abort(None)  # type: ignore[arg-type]


# ---- disaggregated deployments ---------------------------------------------------------------
def _disaggregated(tmp_path: Path) -> OnlineEngine:
    # One prefill and one decode replica of 12 blocks each: a 100-token prompt holds 7, so
    # the second one waits for the first's transfer to free them on the prefill replica, and
    # then for the decode replica's blocks (back-pressure).
    return _engine(tmp_path, "cluster=disaggregated", "kv.num_gpu_blocks_override=12")


def _step_until(engine: OnlineEngine, done) -> None:
    for _ in range(1000):
        if done():
            return
        _step(engine)
    raise AssertionError("the state never came")


@pytest.mark.parametrize("policy", ["fcfs", "chunked_prefill"])
def test_online_disaggregated_engine_replays_the_offline_exact_run(tmp_path, policy):
    req_off, req_on, steps_off, steps_on = _offline_then_online(tmp_path, [
        "model=tiny", "seed=3", "workload.qps=40", "workload.num_requests=30",
        "workload.prompt_len.max=300", "workload.output_len.max=100",
        "kv.num_gpu_blocks_override=60", f"policy={policy}", *POLICY_EXTRA[policy],
        "policy.max_num_seqs=8", "cluster=disaggregated", "cluster.num_decode_replicas=2"])
    assert "aborted" not in req_on
    assert req_on == req_off
    assert steps_on == steps_off


def test_disaggregated_aborts_on_the_decode_replica_and_on_the_link(tmp_path):
    e = _disaggregated(tmp_path)
    prefill, decode = e.replicas
    d = e.deployment
    a, b = e.submit(100, 40), e.submit(100, 40)
    _step_until(e, lambda: d._pending[0])  # b waits for the decode replica's blocks
    assert decode.kv.block_tables == {a.request_id: [0, 1, 2, 3, 4, 5, 6]}
    assert prefill.kv.block_tables == {b.request_id: [7, 8, 9, 10, 11, 6, 5]}
    e.abort(a)  # decoding: it leaves at the decode replica's next step boundary
    _step_until(e, lambda: a.is_finished)
    assert a.status is RequestStatus.ABORTED and 1 < a.num_output_tokens < 40
    # Its blocks went back (in reverse) and b's transfer took them at once.
    assert decode.kv.block_tables == {b.request_id: [7, 8, 9, 10, 11, 6, 5]}
    reserved = d.records[b.request_id].reserved_time
    assert reserved == e.now
    e.abort(b)  # its KV is on the link: the copy ends, then both sides free it
    assert b.status is RequestStatus.RUNNING
    _step_until(e, lambda: b.is_finished)
    assert b.status is RequestStatus.ABORTED and b.num_output_tokens == 1
    assert b.finish_time == e.now > reserved
    assert prefill.kv.block_tables == decode.kv.block_tables == {}
    assert e.num_unfinished() == 0 and d.num_in_transit == 0
    result = e.close()
    assert (result.summary["aborted"], result.summary["kv_blocks_leaked"]) == (2, 0)
    rows = _rows(tmp_path)
    assert [rows[r.request_id]["status"] for r in (a, b)] == ["aborted", "aborted"]
    assert (rows[a.request_id]["prefill_replica_id"], rows[a.request_id]["decode_replica_id"]) \
        == ("0", "1")
    assert int(rows[b.request_id]["kv_transfer_bytes"]) > 0
    assert float(rows[b.request_id]["kv_transfer_time"]) > 0


def test_disaggregated_aborts_while_waiting_for_blocks_and_at_the_handoff(tmp_path):
    e = _disaggregated(tmp_path)
    prefill, decode = e.replicas
    d = e.deployment
    a, b = e.submit(100, 40), e.submit(100, 40)
    _step_until(e, lambda: d._pending[0])
    e.abort(b)  # waiting for the decode replica's blocks: it leaves now, freeing its own
    assert b.status is RequestStatus.ABORTED and b.finish_time == e.now
    assert not d._pending[0] and prefill.kv.block_tables == {}
    assert e.num_unfinished() == 1
    c = e.submit(100, 40)
    _step_until(e, lambda: c.status is RequestStatus.RUNNING)  # its prefill step runs
    # b's blocks went to the back of the free queue in reverse: c gets 4..0 first.
    assert prefill.kv.block_tables == {c.request_id: [4, 3, 2, 1, 0, 5, 6]}
    e.abort(c)  # the step samples its first token, and it leaves at the handoff
    _step_until(e, lambda: c.is_finished)
    assert c.status is RequestStatus.ABORTED and c.num_output_tokens == 1
    assert c.request_id not in d.records and prefill.kv.block_tables == {}
    assert list(decode.kv.block_tables) == [a.request_id]
    _step_until(e, lambda: a.is_finished)
    assert a.status is RequestStatus.FINISHED and a.num_output_tokens == 40
    result = e.close()
    assert (result.summary["completed"], result.summary["aborted"]) == (1, 2)
    assert result.summary["kv_blocks_leaked"] == 0
    rows = _rows(tmp_path)
    assert [rows[b.request_id][k] for k in ("status", "prefill_replica_id", "decode_replica_id",
                                             "kv_transfer_bytes", "kv_transfer_time")] \
        == ["aborted", "0", "1", "", ""]
    assert [rows[c.request_id][k] for k in ("status", "output_len", "decode_replica_id")] \
        == ["aborted", "1", ""]


# A slow link keeps transfers on it long enough for aborts to find them there.
_SLOW_LINK = "cluster.link.bandwidth_gbps=0.02"
LAYOUTS = {"one": [], "two": ["cluster.num_replicas=2"],
           "1p1d": ["cluster=disaggregated", _SLOW_LINK],
           "1p2d": ["cluster=disaggregated", "cluster.num_decode_replicas=2", _SLOW_LINK]}


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)),
       policy=st.sampled_from(["fcfs", "sjf", "chunked_prefill"]), swap=st.booleans(),
       blocks=st.integers(8, 30))
def test_random_aborts_leave_every_book_balanced(tmp_path, data, layout, policy, swap, blocks):
    """Requests arrive and are aborted at random moments, in any layout: every one leaves,
    finished or aborted, and the KV books (checked after every step) balance at the end."""
    n = data.draw(st.integers(1, 12), label="requests")
    arrivals = sorted(data.draw(st.lists(st.floats(0, 0.02), min_size=n, max_size=n),
                                label="arrivals"))
    lengths = data.draw(st.lists(st.tuples(st.integers(1, 100), st.integers(1, 200)),
                                 min_size=n, max_size=n), label="lengths")
    # Each abort comes some time after its request arrived (a request's steps take 0.3 ms
    # or so on this model).
    aborts = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.floats(0, 0.01)),
                                max_size=n), label="aborts")
    run = tmp_path / f"{layout}-{policy}-{swap}-{blocks}-{len(list(tmp_path.iterdir()))}"
    e = OnlineEngine(Simulation(compose_cfg(
        "model=tiny", "step_mode=exact", "kv.block_size=16", f"kv.num_gpu_blocks_override={blocks}",
        "kv.num_cpu_blocks=64", "policy.max_num_seqs=4", "policy.kv_watermark=0",
        f"policy={policy}", *(["policy.max_num_batched_tokens=64"] if policy == "chunked_prefill"
                              else []),
        f"policy.preemption_mode={'swap' if swap else 'recompute'}", "check_integrity=true",
        *LAYOUTS[layout]), run))
    events = sorted([(t, 0, i) for i, t in enumerate(arrivals)]
                    + [(arrivals[i] + delay, 1, i) for i, delay in aborts])
    reqs: dict[int, object] = {}
    for t, kind, i in events:
        while e.next_event_time() <= t:
            e.run_until(e.next_event_time())
        e.run_until(t)
        if kind == 0:
            reqs[i] = e.submit(*lengths[i])
        elif i in reqs:
            e.abort(reqs[i])
    while e.num_unfinished():
        e.run_until(e.next_event_time())
    result = e.close()
    s = result.summary
    assert s["kv_blocks_leaked"] == 0
    assert s["completed"] + s["aborted"] + s["rejected"] == n
    rows = _rows(run)
    assert len(rows) == n
    for req in reqs.values():
        assert req.is_finished  # type: ignore[attr-defined]
        assert rows[req.request_id]["status"] == req.status.name.lower()  # type: ignore


def test_disaggregated_abort_cancels_a_transfer_queued_for_the_link(tmp_path):
    # A link slow enough that three handoffs of one prefill step queue for its ports.
    e = _engine(tmp_path, "cluster=disaggregated", "kv.num_gpu_blocks_override=12",
                "policy.max_num_seqs=4", "cluster.link.bandwidth_gbps=0.001")
    prefill, decode = e.replicas
    d = e.deployment
    a, b, c = (e.submit(20, 5) for _ in range(3))
    _step_until(e, lambda: len(d.records) == 3)  # all three handed off and reserved
    recs = [d.records[r.request_id] for r in (a, b, c)]
    assert all(r.reserved_time == e.now for r in recs)
    assert recs[0].start_time == e.now and recs[1].start_time is recs[2].start_time is None
    assert e.num_waiting() == 3  # waiting for their KV, as vLLM's decode side counts them
    send = e.deployment.link.serialization_time(recs[0].nbytes)
    e.abort(b)  # queued behind a: it leaves now, freeing both sides
    assert b.status is RequestStatus.ABORTED and b.finish_time == e.now
    assert set(prefill.kv.block_tables) == set(decode.kv.block_tables) == {a.request_id,
                                                                           c.request_id}
    assert e.num_waiting() == 2
    _step_until(e, lambda: recs[2].start_time is not None)
    assert recs[2].start_time == pytest.approx(recs[0].start_time + send, rel=1e-12)
    _step_until(e, lambda: a.is_finished and c.is_finished)
    result = e.close()
    assert (result.summary["completed"], result.summary["aborted"]) == (2, 1)
    assert result.summary["kv_blocks_leaked"] == 0 and result.summary["num_kv_transfers"] == 2
    row = _rows(tmp_path)[b.request_id]
    assert [row[k] for k in ("status", "decode_replica_id", "kv_transfer_bytes",
                             "kv_backpressure_wait", "kv_transfer_time")] \
        == ["aborted", "1", "", "0.0", ""]
