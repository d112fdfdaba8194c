"""Events that coincide to the last bit: fast equals exact where an arrival, a transfer or a
jump's end lands exactly on a step boundary. Each trace below is a minimal case where the two
modes once ordered such events differently; the times are step ends of an exact run, written
with every digit."""

from __future__ import annotations

import pytest
import simpy

from sim.clock import exact_delay, timeout_at
from tests.test_cluster_fast_exact import assert_fast_equals_exact

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

TIE_CASES = {
    # A transfer whose link latency is longer than a decode step arrives exactly as a decode
    # step ends: the decode replica must not plan a jump through that instant before the
    # transfer's arrival event exists.
    "transfer_at_decode_step_end": (
        ["cluster=disaggregated", "kv.num_gpu_blocks_override=2000", "cluster.link.latency_us=2000",
         "cluster.link.bandwidth_gbps=0.3"],
        [(0.0, 50, 200), (0.020165410778646704, 279, 35)]),
    # A jump's end that no float delay reaches from the clock it starts at.
    "jump_end_one_ulp_away": (
        ["array_core=false"],
        [(0.0, 50, 400), (0.0005, 1, 1), (0.0030146794466407545, 1, 1)]),
    # Arrivals whose time no float delay reaches from the previous event's clock: the
    # step-by-step loop must see them at their trace time, as the array core does.
    "arrival_one_ulp_away": (
        [],
        [(0.0, 1, 1), (0.0011548628676820527, 1, 1), (0.003654324962050868, 1, 1),
         (0.003654324962050868, 1, 1)]),
    # On the array core: a request arriving exactly at a step's start, after the step was
    # planned, and its successor arriving exactly at that step's end.
    "arrivals_at_a_step_start_and_end": (
        [],
        [(0.0, 50, 400), (0.006892717462041118, 1, 2), (0.007061074642644995, 1, 2),
         (0.007390613651265776, 1, 2)]),
}


@pytest.mark.parametrize("case", sorted(TIE_CASES))
def test_fast_equals_exact_at_exact_ties(case, tmp_path):
    overrides, rows = TIE_CASES[case]
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"{t!r},{p},{o}\n" for t, p, o in rows))
    assert_fast_equals_exact(["model=tiny", "workload=trace", f"workload.path={trace}",
                              *overrides])


@pytest.mark.parametrize("now,target", [
    (0.0, 0.003654324962050868),
    (0.0011548628676820527, 0.003654324962050868),
    (0.9999999999999999, 3.0000000000000004),
    (1e-300, 1e300),
])
def test_timeout_at_fires_at_exactly_the_target(now, target):
    env = simpy.Environment(initial_time=now)
    fired = []

    def proc():
        yield timeout_at(env, target)
        fired.append(env.now)

    env.process(proc())
    env.run()
    assert fired == [target]


@pytest.mark.parametrize("now", [0.0, 0.0011548628676820527])
def test_timeout_at_keeps_scheduling_order_among_equal_times(now):
    """Events for one instant fire in the order they were scheduled, whether they went
    through ``env.timeout`` (a delay reaches the target) or into the queue at the target
    (none does: the second clock)."""
    env = simpy.Environment(initial_time=now)
    t = 0.003654324962050868
    reachable = env.now + exact_delay(env.now, t) == t
    assert reachable == (now == 0.0)
    order = []

    def proc(name, make):
        yield make()
        order.append((name, env.now))

    env.process(proc("a", lambda: timeout_at(env, t)))
    env.process(proc("b", lambda: timeout_at(env, t)))
    env.process(proc("early", lambda: env.timeout(0.001)))
    env.process(proc("c", lambda: timeout_at(env, t)))
    env.run()
    assert order == [("early", now + 0.001), ("a", t), ("b", t), ("c", t)]


def test_timeout_at_refuses_the_past():
    env = simpy.Environment(initial_time=1.0)
    with pytest.raises(ValueError, match="before the clock"):
        timeout_at(env, 0.5)
