"""Lazy decode (sim/fast_forward.py): disaggregated decode replicas sleep through their jumps
(``ChainEnvironment``) past every other replica's steps; a transfer reserved on one, or a
decode router reading its KV use or cache, takes the blocks of the steps that have started
first, and a transfer arriving ends the jump with the step in progress. step_mode=fast still reproduces
step_mode=exact: the same steps on every replica, the same request rows, the same free block
queues at the end (so the same block ids)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import BUILT_IN, Simulation
from sim.clock import ChainEnvironment, StepChain, advance
from sim.cluster.link import LinkConfig
from sim.replica import Replica
from sim.simulation import Simulation as EngineSimulation
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import (
    POLICIES,
    POLICY_EXTRA,
    _workload,
    assert_fast_equals_exact,
    preemption,
)
from tests.test_lazy_colocated import COUNT_ROUTERS

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

# ---- ChainEnvironment against stepping -----------------------------------------------------


def _play(chained: bool, owners: list[list[tuple[list[int], list[int]]]],
          observers: list[list[tuple[int, int | None]]]) -> list[tuple]:
    """Owners run segments of steps (integer durations, so that step ends tie across
    processes) and resume at the ends of the listed steps and of a segment's last; observers
    sleep integer delays (moving the clock with ``advance`` where nothing comes first) and log
    how many steps of each owner have ended; an observer's entry (delay, owner) also cuts that
    owner's segment to the step in progress. Stepping (every step a timeout) and
    ``ChainEnvironment`` (owners sleep through their segments) must log the same."""
    env = ChainEnvironment() if chained else simpy.Environment()
    log: list[tuple] = []
    ended = [0] * len(owners)  # steps ended before the segment in progress (chained), or all
    chains: list[StepChain | None] = [None] * len(owners)
    active = [True] * len(owners)
    cut_to: list[int | None] = [None] * len(owners)  # a cut's last step (counted over segments)

    def seen(i: int) -> int:
        c = chains[i]
        return ended[i] + (c.passed if c is not None else 0)

    def owner(i: int):
        for durations, wakes in owners[i]:
            n = len(durations)
            stops = sorted({w for w in wakes if 1 <= w < n} | {n})
            if chained:
                ends, t = [], env.now
                for d in durations:
                    t += d
                    ends.append(t)
                chain = chains[i] = StepChain(ends)
                for k in stops:
                    ev = env.wait_chain(chain, k)  # type: ignore[attr-defined]
                    if ev is not None:
                        yield ev
                        chain.resumed()
                    log.append(("owner", i, env.now, chain.passed))
                    if cut_to[i] == ended[i] + chain.passed:
                        break
                ended[i] += chain.passed
                chains[i] = None
            else:
                for j, d in enumerate(durations, start=1):
                    yield env.timeout(d)
                    ended[i] += 1
                    cut = cut_to[i] == ended[i]
                    if j in stops or cut:
                        log.append(("owner", i, env.now, j))
                    if cut:
                        break
            cut_to[i] = None
        active[i] = False

    def observer(m: int):
        for delay, target in observers[m]:
            if not advance(env, env.now + delay):
                yield env.timeout(delay)
            log.append(("observer", m, env.now, tuple(seen(i) for i in range(len(owners)))))
            if target is None or target >= len(owners) or not active[target]:
                continue
            c = chains[target]
            if chained:
                c.cut(c.passed + 1)  # type: ignore[union-attr]
            cut_to[target] = seen(target) + 1

    for i in range(len(owners)):
        env.process(owner(i))
    for m in range(len(observers)):
        env.process(observer(m))
    env.run()
    return log


segment = st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=8),
                    st.lists(st.integers(1, 8), max_size=3))


@settings(max_examples=150, deadline=None)
@given(owners=st.lists(st.lists(segment, min_size=1, max_size=3), min_size=1, max_size=3),
       observers=st.lists(st.lists(st.tuples(st.integers(0, 4), st.none() | st.integers(0, 2)),
                                   min_size=1, max_size=6), max_size=3))
def test_chains_keep_the_order_stepping_gives(owners, observers):
    assert _play(True, owners, observers) == _play(False, owners, observers)


# ---- decode replicas ---------------------------------------------------------------------

def _disaggregated(seed: int, qps: float, n: int, blocks: int, decode: int,
                   decode_router: str) -> list[str]:
    # The replica loop's lazy decode (the array core's own: tests/test_array_disagg.py).
    return [*_workload(seed, qps, n), "policy.max_num_seqs=16", "array_core=false",
            f"kv.num_gpu_blocks_override={blocks}", "cluster=disaggregated",
            "cluster.num_prefill_replicas=1", f"cluster.num_decode_replicas={decode}",
            f"cluster.decode_router={decode_router}"]


@pytest.mark.parametrize(("decode_router", "extra", "lazy"), [
    ("least_outstanding", [], True),
    ("round_robin", [], True),
    ("least_kv", [], True),  # reads KV use: the steps begun take their blocks first
    ("prefix_aware", ["kv.enable_prefix_caching=true"], True),
    ("least_outstanding", ["cluster.decode.pipeline_parallel_size=2"], False),  # repeats
])
def test_lazy_decode_only_where_it_applies(decode_router, extra, lazy):
    res = EngineSimulation(compose_cfg("step_mode=fast", *_disaggregated(
        1, 20.0, 10, 400, 2, decode_router), *extra), components=BUILT_IN).run()
    prefill, *decode = res.replicas
    assert not prefill.lazy_decode
    assert all(r.lazy_decode == lazy for r in decode)


def test_closed_loop_decode_replicas_sleep_through_their_jumps():
    """Multi-turn sessions on a disaggregated deployment: a decode replica's jump ends at its
    first finish (which brings the next turn), and a hand-off meanwhile finds it, and
    ``least_kv`` reads it, as stepping would (it fails if the router reads the KV use
    before the steps begun take their blocks)."""
    setup = ["model=tiny", "seed=739", "workload=multi_turn", "workload.num_sessions=20",
             "workload.qps=5", "workload.think_time_s=0.0", "workload.system_prompt_len=32",
             "workload.max_prompt_len=900", "workload.user_len.max=60",
             "workload.output_len.median=100", "workload.output_len.max=400", "policy=vllm_v1",
             "kv.num_gpu_blocks_override=100", "cluster=disaggregated",
             "cluster.num_decode_replicas=2", "cluster.decode_router=least_kv"]
    assert assert_fast_equals_exact(setup)["num_decode_jumps"] > 0
    res = EngineSimulation(compose_cfg("step_mode=fast", *setup), components=BUILT_IN).run()
    _, *decode = res.replicas
    assert all(r.lazy_decode and r.num_jumps for r in decode)


def test_a_transfer_arriving_in_a_jump_finds_the_cache_the_steps_begun_left():
    """Prefix caching on a decode pool that binds: a transfer arriving in the middle of a
    jump registers its prefix's blocks where their content is not cached, after the steps
    begun have taken their blocks (evicting cached ones) as stepping would have; a
    recomputed request's cache hits later depend on which blocks hold which content."""
    assert_fast_equals_exact([
        "model=llama2_7b", "hardware=a100_40gb", "seed=60568", "workload.qps=10",
        "workload.num_requests=120", "workload.prompt_len.max=300",
        "workload.prompt_len.median=200", "workload.output_len.max=50",
        "workload.shared_prefix_len=256", "policy=vllm_v1", "policy.max_num_batched_tokens=32",
        "policy.max_num_seqs=4", "kv.num_gpu_blocks_override=96", "cluster=disaggregated"])


@pytest.fixture
def outcomes(monkeypatch):
    """What transfers did to lazy jumps: reservations that let the jump go on, that ended it
    early because its later blocks no longer fit, that failed (back-pressure), and arrivals
    that cut it."""
    seen: dict[str, int] = dict.fromkeys(("goes_on", "cut_short", "failed", "arrived"), 0)
    reserve, accept = Replica.reserve_transfer, Replica.accept_transferred

    def spy_reserve(self, req):
        jump = self._jump_ctx[2] if self._chain is not None else None
        steps = jump.num_steps if jump is not None else 0
        ok = reserve(self, req)
        if jump is not None:
            seen["failed" if not ok else "cut_short" if jump.num_steps < steps
                 else "goes_on"] += 1
        return ok

    def spy_accept(self, req):
        seen["arrived"] += self._chain is not None
        accept(self, req)

    monkeypatch.setattr(Replica, "reserve_transfer", spy_reserve)
    monkeypatch.setattr(Replica, "accept_transferred", spy_accept)
    return seen


def test_transfers_reserved_and_arriving_inside_jumps(outcomes):
    """A pool of 60 blocks binds on both sides: reservations made inside decode jumps take
    the blocks of the steps that have started first, and the jump goes on, ends before the
    first step whose blocks no longer fit, or (the reservation failing) ends with the step
    in progress; arrivals end it with the step in progress."""
    s = assert_fast_equals_exact(_disaggregated(3, 60.0, 60, 60, 2, "least_outstanding"))
    assert s["kv_backpressure_count"] > 0
    assert all(outcomes.values()), outcomes


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(10.0, 120.0), blocks=st.integers(40, 300),
       decode=st.integers(1, 3), decode_router=st.sampled_from([*COUNT_ROUTERS, "least_kv"]),
       link=st.sampled_from(["nvlink", "infiniband", "ethernet"]),
       policy=st.sampled_from(POLICIES), swap=st.booleans())
def test_lazy_decode_fast_equals_exact(seed, qps, blocks, decode, decode_router, link, policy,
                                       swap):
    """Random small workloads on pools that bind (transfers wait for decode blocks),
    behind every decode router that reads only counts and one that does not."""
    assert_fast_equals_exact([
        *_disaggregated(seed, qps, 80, blocks, decode, decode_router), f"policy={policy}",
        *POLICY_EXTRA.get(policy, []),
        preemption(policy, swap),
        f"cluster.link.preset={link}"])


# ---- ties: events at the very instant a decode step ends, to the last bit ------------------

# A pool of a few thousand blocks (the end-of-run free queues are compared block by block).
TIE_LAYOUT = ["model=tiny", "workload=trace", "cluster=disaggregated",
              "kv.num_gpu_blocks_override=4000", "array_core=false"]


def _trace(tmp_path: Path, name: str, rows: list[tuple[float, int, int]]) -> Path:
    path = tmp_path / name
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"{t!r},{p},{o}\n" for t, p, o in rows))
    return path


def _exact(tmp_path: Path, layout: list[str], rows: list[tuple[float, int, int]]):
    path = _trace(tmp_path, "exact.csv", rows)
    return Simulation(compose_cfg("step_mode=exact", *layout, f"workload.path={path}")).run()


def _before(end: float, f) -> float | None:
    """The time a with f(a) == end to the last bit, for an increasing f that adds to a (found
    a few ulps from a first guess); None where there is none."""
    a = end - (f(end) - end)
    for _ in range(200):
        got = f(a)
        if got == end:
            return a
        a = math.nextafter(a, math.inf if got < end else -math.inf)
    return None


@pytest.mark.parametrize("decode_router", ["round_robin", "least_outstanding"])
def test_twin_decode_replicas_end_steps_at_the_same_instants(tmp_path, decode_router):
    """Pairs of identical requests arriving together go to two prefill replicas and then to
    two decode replicas, whose steps end at the same instants throughout: their chains tie
    with each other at every step, and with the prefill steps and transfers of the pairs."""
    rows = []
    t = 0.0
    for i in range(10):
        rows += [(t, 40 + 7 * i, 60 + 13 * (i % 5))] * 2
        t += 0.05 * (i % 3)
    layout = [*TIE_LAYOUT, "cluster.num_prefill_replicas=2", "cluster.num_decode_replicas=2",
              "cluster.router=round_robin", f"cluster.decode_router={decode_router}"]
    s = assert_fast_equals_exact([*layout, f"workload.path={_trace(tmp_path, 'twins.csv', rows)}"])
    assert s["num_decode_jumps"] > 0


def _decode_ends(tmp_path: Path, layout: list[str]) -> list[float]:
    """The step ends of the decode replica in an exact run of one long request alone."""
    alone = _exact(tmp_path, layout, [(0.0, 50, 200)])
    return [float(r[2]) + float(r[3]) for r in alone.steps_sink.rows if int(r[1]) == 1]


def _first_step(tmp_path: Path, layout: list[str], prompt: int) -> tuple[float, float]:
    """The prefill step's duration of a request alone, and the bytes of its transfer."""
    run = _exact(tmp_path, layout, [(0.0, prompt, 5)])
    cols = run.requests_sink.columns
    row = run.requests_sink.rows[0]
    step = next(r for r in run.steps_sink.rows if int(r[1]) == 0)
    return float(step[3]), float(row[cols.index("kv_transfer_bytes")])


@pytest.mark.parametrize("prompt", [64, 1024])
def test_a_prefill_step_ending_exactly_at_a_decode_step_end(tmp_path, prompt):
    """A request reaches the idle prefill replica so that its prompt step ends at the very
    instant a decode step ends: the handoff reserves on the decode replica at that instant,
    after that step's end (a prompt step shorter than a decode step began after it) or
    before it (a longer one began first), as stepping orders them."""
    layout = TIE_LAYOUT
    ends = _decode_ends(tmp_path, layout)
    d, _ = _first_step(tmp_path, layout, prompt)
    a = _before(ends[20], lambda a: a + d)
    assert a is not None
    path = _trace(tmp_path, "tie.csv", [(0.0, 50, 200), (a, prompt, 30)])
    for router in ("least_outstanding", "least_kv"):
        assert_fast_equals_exact([*layout, f"workload.path={path}",
                                  f"cluster.decode_router={router}"])


@pytest.mark.parametrize(("preset", "latency_us"), [("infiniband", None), ("pcie", 200_000)])
def test_a_transfer_arriving_exactly_at_a_decode_step_end(tmp_path, preset, latency_us):
    """A transfer lands on the decode replica at the very instant one of its steps ends:
    scheduled after that step began (a short latency) or before (a long one), so that the
    step's end comes first or second."""
    layout = [*TIE_LAYOUT, f"cluster.link.preset={preset}"]
    if latency_us is not None:
        layout.append(f"cluster.link.latency_us={latency_us}")
    link = LinkConfig(preset=preset, latency_us=latency_us)
    ends = _decode_ends(tmp_path, layout)
    d, nbytes = _first_step(tmp_path, layout, 64)
    send = nbytes / link.bandwidth_bytes_per_s
    for index in (30, 70):
        # Arrival, handoff at the end of its prompt step, sent, landed: the same additions.
        a = _before(ends[index], lambda a: ((a + d) + send) + link.latency_s)
        assert a is not None
        path = _trace(tmp_path, "tie.csv", [(0.0, 50, 200), (a, 64, 30)])
        assert_fast_equals_exact([*layout, f"workload.path={path}"])
