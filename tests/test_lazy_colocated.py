"""Co-located replicas on the replica loop sleep through their decode jumps (lazy decode,
sim/fast_forward.py) past arrivals routed elsewhere, and the replica that receives one cuts its
jump at the step in progress. step_mode=fast still reproduces step_mode=exact: the same steps
on every replica, the same request rows (replica ids included), the same free block queues at
the end."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import BUILT_IN, Simulation
from sim.cluster.router import ROUTERS, LeastOutstanding, Router
from sim.fast_forward import Jump, UpcomingArrivals
from sim.request import Request
from sim.simulation import Simulation as EngineSimulation
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import (
    POLICIES,
    POLICY_EXTRA,
    _workload,
    assert_fast_equals_exact,
    preemption,
)

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

COUNT_ROUTERS = ["round_robin", "random", "least_outstanding", "power_of_two"]


def test_routers_state_whether_they_read_only_counts():
    assert {name for name in ROUTERS.names() if ROUTERS.get(name).reads_only_counts} == set(
        COUNT_ROUTERS)

    class Reader(LeastOutstanding):  # a subclass states it itself
        def choose(self, req, targets):
            return min(range(len(targets)), key=lambda i: targets[i].kv_usage)

    assert not Reader.reads_only_counts
    assert not Router.reads_only_counts


def _replicas(overrides: list[str]):
    # The replica loop's (co-located replicas behind these routers run on the array core
    # by default: sim/array_cluster.py).
    return EngineSimulation(compose_cfg("step_mode=fast", "array_core=false", *overrides),
                            components=BUILT_IN).run().replicas


@pytest.mark.parametrize(("router", "replicas", "extra", "lazy"), [
    ("least_outstanding", 3, [], True),
    ("least_kv", 3, [], True),  # reads KV use: the steps begun take their blocks first
    ("prefix_aware", 2, ["kv.enable_prefix_caching=true"], True),
    ("round_robin", 1, [], False),  # nothing to route: the next arrival is its own
    ("round_robin", 2, ["cluster.pipeline_parallel_size=2"], False),  # repeats instead
])
def test_colocated_replicas_sleep_through_their_jumps(router, replicas, extra, lazy):
    reps = _replicas([*_workload(1, 20.0, 10), f"cluster.num_replicas={replicas}",
                      f"cluster.router={router}", *extra])
    assert all(r.lazy_decode == lazy for r in reps)


def test_upcoming_arrivals_read_ahead_without_changing_the_stream():
    reqs = [Request(i, t, 10, 5) for i, t in enumerate([0.5, 1.0, 1.0, 2.5])]
    up = UpcomingArrivals(reqs)
    assert up.next_time == float("inf")
    assert up.pop() is reqs[0] and up.next_time == 0.5
    assert [up.time(i) for i in range(5)] == [0.5, 1.0, 1.0, 2.5, float("inf")]
    assert [up.pop() for _ in range(4)] == [*reqs[1:], None]
    assert up.next_time == float("inf")


def _stopping_jump() -> Jump:
    """Six steps; member 2 finishes at step 2, members 0 and 3 at step 4, member 1 at 6; new
    blocks in steps 2, 3, 3, 5, 6."""
    durations = np.array([1.0, 1.0, 2.0, 1.0, 1.0, 3.0])
    steps = np.array([2, 3, 3, 5, 6])
    return Jump(6, durations, np.cumsum(durations), steps, np.array([0, 1, 3, 1, 1]),
                stops=[2, 4], batch_sizes=[4, 4, 3, 3, 1, 1], block_steps=steps.tolist(),
                finishing=[0, 1, 2, 3], last_members=[1], groups=[(2, [2]), (4, [0, 3])])


def test_a_jump_cut_at_a_stop_ends_there_with_that_stops_members():
    jump = _stopping_jump()
    jump.truncate(4)
    assert jump.num_steps == 4 and jump.ends.tolist() == [1.0, 2.0, 4.0, 5.0]
    assert jump.stops == [2] and jump.groups == [(2, [2])]
    assert jump.last_members == [0, 3] and jump.finishing == [0, 2, 3]
    assert jump.batch_sizes == [4, 4, 3, 3]
    assert jump.block_step_array.tolist() == [2, 3, 3] == jump.block_steps
    assert jump.block_members.tolist() == [0, 1, 3]
    assert jump.new_blocks().tolist() == [0, 1, 2, 0]


def test_a_jump_cut_between_stops_finishes_nobody_at_its_end():
    jump = _stopping_jump()
    jump.block_owners = [10, 11, 13, 11, 11]  # known once its first stretch has run
    jump.truncate(3)
    assert jump.stops == [2] and jump.last_members == [] and jump.finishing == [2]
    assert jump.block_owners == [10, 11, 13]
    jump.truncate(1)
    assert jump.num_steps == 1 and jump.stops == [] and jump.finishing == []
    assert len(jump.block_step_array) == 0 and jump.block_owners == []
    jump.truncate(5)  # longer than it is: nothing changes
    assert jump.num_steps == 1


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 120.0), blocks=st.integers(60, 400),
       replicas=st.integers(2, 4), router=st.sampled_from([*COUNT_ROUTERS, "least_kv"]),
       policy=st.sampled_from(POLICIES), swap=st.booleans())
def test_lazy_replicas_fast_equals_exact(seed, qps, blocks, replicas, router, policy, swap):
    s = assert_fast_equals_exact([
        *_workload(seed, qps, 80), f"policy={policy}", *POLICY_EXTRA.get(policy, []),
        "policy.max_num_seqs=16", f"kv.num_gpu_blocks_override={blocks}",
        preemption(policy, swap),
        f"cluster.num_replicas={replicas}", f"cluster.router={router}", "array_core=false"])
    assert s["num_decode_jumps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("router", COUNT_ROUTERS)
def test_lazy_replicas_fast_equals_exact_on_a_long_run(router):
    """Many arrivals across three replicas: jumps run past arrivals and are cut by them."""
    assert_fast_equals_exact([*_workload(7, 60.0, 300), "policy.max_num_seqs=32",
                              "cluster.num_replicas=3", f"cluster.router={router}",
                              "array_core=false"])


@pytest.mark.slow
@pytest.mark.parametrize("router", ["round_robin", "least_outstanding", "least_kv"])
def test_requests_arriving_exactly_at_decode_step_ends(tmp_path, router):
    """Requests arrive at the very instants decode steps of replica 0 end, to the last bit:
    one goes elsewhere while replica 0 jumps, the next comes to replica 0 (the step times are
    those of an exact run of the first request alone, which the later ones do not change
    before they arrive)."""
    base = tmp_path / "one.csv"
    base.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,50,200\n")
    layout = ["model=tiny", "workload=trace", "cluster.num_replicas=2",
              f"cluster.router={router}"]
    alone = Simulation(compose_cfg("step_mode=exact", *layout, f"workload.path={base}")).run()
    ends = [float(row[2]) + float(row[3]) for row in alone.steps_sink.rows
            if int(row[1]) == 0]
    tie = tmp_path / "tie.csv"
    tie.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,50,200\n"
                   f"{ends[30]!r},40,120\n{ends[60]!r},60,80\n{ends[61]!r},30,50\n"
                   f"{ends[90]!r},30,50\n")
    s = assert_fast_equals_exact([*layout, f"workload.path={tie}"])
    assert s["num_decode_jumps"] > 0
