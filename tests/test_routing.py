"""Routers' decisions on tiny cases, and co-located replicas behind them."""

import random
from dataclasses import dataclass

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.cluster.link import Link, LinkConfig
from sim.cluster.router import ROUTERS, make_router
from sim.errors import ConfigError
from sim.request import Request
from tests.cluster_harness import run_colocated


@dataclass
class Load:
    num_outstanding: int
    kv_usage: float = 0.0
    cached: int = 0  # prompt tokens its prefix cache holds

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.cached


def _req(i=0):
    return Request(i, 0.0, 8, 2)


def test_registry_has_the_seven_routers():
    assert ROUTERS.names() == ["least_kv", "least_outstanding", "power_of_two",
                               "prefix_aware", "prefix_aware_approx", "random", "round_robin"]


def test_prefix_aware_approx_follows_what_it_routed_not_the_caches():
    """It remembers the shared prefix of each prompt it routed (16-token pieces) per replica:
    the second request of a group follows the first although no cache reports a hit; a
    request of another group goes by free KV; a replica's memory is trimmed oldest first."""
    r = make_router("prefix_aware_approx", 0)
    a = Request(0, 0.0, 200, 2, prefix=((7, 160),))
    b = Request(1, 0.0, 180, 2, prefix=((7, 160),))
    c = Request(2, 0.0, 200, 2, prefix=((8, 160),))
    targets = [Load(0, 0.5, 0), Load(0, 0.1, 0), Load(0, 0.3, 0)]
    assert r.choose(a, targets) == 1  # nothing known: the most free KV
    targets = [Load(0, 0.1, 0), Load(1, 0.5, 0), Load(0, 0.3, 0)]
    assert r.matched(b, targets) == [0, 160, 0]
    assert r.choose(b, targets) == 1  # 160 of 180 tokens believed cached there
    assert r.choose(c, targets) == 0
    r.MAX_TOKENS = 160  # replica 1 keeps the last 10 pieces only: still group 7's
    r.routed(c, 1)  # group 8's 10 pieces push group 7's out
    assert r.matched(b, targets)[1] == 0


def test_prefix_aware_follows_the_cache_while_the_load_is_balanced():
    r = make_router("prefix_aware", 0)
    req = Request(0, 0.0, 100, 2)
    # More than half of the prompt cached on replica 2: it gets the request.
    assert r.choose(req, [Load(3, 0.1, 0), Load(2, 0.2, 48), Load(5, 0.9, 64)]) == 2
    # Equal hits: fewer outstanding.
    assert r.choose(req, [Load(3, 0.1, 64), Load(2, 0.2, 64)]) == 1
    # Half or less cached anywhere: the most free KV, then fewer outstanding.
    assert r.choose(req, [Load(3, 0.4, 50), Load(2, 0.2, 0), Load(1, 0.2, 0)]) == 2
    # Out of balance (40 more outstanding, and more than 1.0001x): the idlest, cache or not.
    assert r.choose(req, [Load(45, 0.1, 96), Load(5, 0.9, 0)]) == 1
    # 32 more is still balanced.
    assert r.choose(req, [Load(37, 0.1, 96), Load(5, 0.9, 0)]) == 0


def test_round_robin_cycles():
    r = make_router("round_robin", 0)
    loads = [Load(9), Load(0), Load(5)]
    assert [r.choose(_req(), loads) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_outstanding_takes_the_fewest_and_breaks_ties_by_index():
    r = make_router("least_outstanding", 0)
    assert r.choose(_req(), [Load(3), Load(1), Load(2)]) == 1
    assert r.choose(_req(), [Load(2), Load(1), Load(1)]) == 1


def test_least_kv_takes_the_lowest_usage_then_fewest_outstanding():
    r = make_router("least_kv", 0)
    assert r.choose(_req(), [Load(0, 0.5), Load(9, 0.1), Load(0, 0.3)]) == 1
    assert r.choose(_req(), [Load(4, 0.0), Load(2, 0.0), Load(3, 0.0)]) == 1


def test_power_of_two_picks_the_less_loaded_of_two_distinct_draws():
    r = make_router("power_of_two", 0)
    # With two replicas both are always drawn: the less loaded one always wins.
    assert {r.choose(_req(), [Load(5), Load(1)]) for _ in range(20)} == {1}
    # With four, the most loaded replica can never win (it always loses to its partner),
    # and the least loaded wins whenever it is drawn (half of the time in expectation).
    loads = [Load(1), Load(4), Load(3), Load(2)]
    picks = [r.choose(_req(), loads) for _ in range(400)]
    assert 1 not in picks
    assert 0.4 < picks.count(0) / 400 < 0.6


def test_seeded_routers_are_deterministic_and_seed_dependent():
    loads = [Load(0)] * 4
    r1, r2, r3 = (make_router("random", s) for s in (7, 7, 8))
    s1 = [r1.choose(_req(), loads) for _ in range(30)]
    assert s1 == [r2.choose(_req(), loads) for _ in range(30)]
    assert s1 != [r3.choose(_req(), loads) for _ in range(30)]
    assert set(s1) == {0, 1, 2, 3}


def test_unknown_router_names_the_field():
    with pytest.raises(ConfigError) as e:
        make_router("shortest_job", 0)
    assert e.value.field == "cluster.router" and "round_robin" in str(e.value)


def test_colocated_round_robin_spreads_requests_in_turn():
    reqs = [Request(i, float(i) * 0.1, 8, 2) for i in range(6)]
    run = run_colocated(reqs, num_replicas=3)
    assert [r.replica_id for r in reqs] == [0, 1, 2, 0, 1, 2]
    assert run.deployment.routed == [2, 2, 2]
    assert all(row["prefill_replica_id"] == row["decode_replica_id"] == row["replica_id"]
               for row in run.rows)


def test_least_outstanding_avoids_the_replica_busy_with_a_long_request():
    # r0 has 20 tokens to generate; r1 and r2 arrive while it runs and finish fast.
    reqs = [Request(0, 0.0, 8, 20), Request(1, 0.5, 8, 2), Request(2, 3.5, 8, 2),
            Request(3, 3.6, 8, 2)]
    rr = run_colocated([Request(r.request_id, r.arrival_time, 8, r.max_output_len)
                        for r in reqs], num_replicas=2, router="round_robin")
    lo = run_colocated(reqs, num_replicas=2, router="least_outstanding")
    assert lo.deployment.routed == [2, 2]
    # Round robin sends r2 to replica 0, busy with r0. least_outstanding sends it to
    # replica 1, idle again since r1 finished at 2.5; at 3.6 both replicas hold one request
    # (r0, r2), a tie broken by index, so r3 goes to 0.
    rows = sorted(rr.rows, key=lambda x: x["request_id"])
    assert [row["replica_id"] for row in rows] == [0, 1, 0, 1]
    assert [r.replica_id for r in reqs] == [0, 1, 1, 0]


def test_link_two_concurrent_transfers_share_a_port_fifo():
    import simpy
    env = simpy.Environment()
    link = Link(env, LinkConfig(bandwidth_gbps=1e-6, latency_us=2e5, scope="cluster"), 4)
    done = {}

    def xfer(name, src, dst):
        yield from link.transfer(src, dst, 1000.0)  # 1 s on the wire at 1000 B/s
        done[name] = env.now

    env.process(xfer("a", 0, 2))
    env.process(xfer("b", 1, 3))
    env.run()
    assert done == {"a": pytest.approx(1.2), "b": pytest.approx(2.2)}
    assert link.utilization(env.now) == [pytest.approx(2.0 / 2.2)]


def test_link_per_replica_ports_let_disjoint_transfers_overlap():
    import simpy
    env = simpy.Environment()
    link = Link(env, LinkConfig(bandwidth_gbps=1e-6, latency_us=2e5, scope="replica"), 4)
    done = {}

    def xfer(name, src, dst):
        yield from link.transfer(src, dst, 1000.0)
        done[name] = env.now

    env.process(xfer("a", 0, 2))
    env.process(xfer("b", 1, 3))  # disjoint ports: in parallel
    env.process(xfer("c", 1, 2))  # needs 1 (busy until 1) then 2 (busy until 1)
    env.run()
    assert done == {"a": pytest.approx(1.2), "b": pytest.approx(1.2), "c": pytest.approx(2.2)}
    assert link.bytes_sent == 3000 and link.num_transfers == 3


class _ResourcePort(simpy.Resource):
    """simpy's own FIFO resource of capacity one, released as ``Port`` is: the reference."""

    def __init__(self, env: simpy.Environment) -> None:
        super().__init__(env, capacity=1)

    def release(self, req):  # type: ignore[override]
        if req.triggered:
            return super().release(req)
        req.cancel()


def _link_events(seed: int, scope: str, reference: bool) -> list[tuple]:
    """Random transfers over a link, with other processes' events at the same instants and
    transfers interrupted on the way: what happened, when, in order."""
    rnd = random.Random(seed)
    env = simpy.Environment()
    link = Link(env, LinkConfig(bandwidth_gbps=1e-9, latency_us=rnd.choice([0, 5e5, 1e6]),
                                scope=scope), 4)
    if reference:
        link.ports = [_ResourcePort(env) for _ in link.ports]
    log: list[tuple] = []

    def xfer(k, src, dst, nbytes):
        try:
            yield from link.transfer(src, dst, nbytes,
                                     on_last=lambda t: log.append(("last", k, t)),
                                     on_start=lambda: log.append(("start", k, env.now)))
        except simpy.Interrupt:
            log.append(("interrupted", k, env.now))
            return
        log.append(("arrived", k, env.now))

    def other(k, delay):
        yield env.timeout(delay)
        log.append(("other", k, env.now))

    def interrupt(proc, delay):
        yield env.timeout(delay)
        if proc.is_alive:
            proc.interrupt()

    def source():
        for k in range(60):  # gaps and sizes on a grid of halves: many exact ties
            yield env.timeout(rnd.choice([0, 0, 0.5, 1, 2]))
            proc = env.process(xfer(k, rnd.randrange(2), 2 + rnd.randrange(2),
                                    rnd.choice([0, 0.5, 1, 2]) * 1.0))
            if rnd.random() < 0.3:
                env.process(other(k, rnd.choice([0, 0.5, 1])))
            if rnd.random() < 0.15:
                env.process(interrupt(proc, rnd.choice([0, 0.5, 1, 1.5])))

    env.process(source())
    env.run()
    return [*log, ("busy", *link.busy_time), ("sent", link.bytes_sent, link.num_transfers)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), scope=st.sampled_from(["replica", "cluster"]))
def test_link_ports_grant_in_simpys_resource_order(seed, scope):
    """A port grants, queues and hands over in the very order simpy.Resource does: the same
    events at the same instants in the same order, ties and interrupted transfers included."""
    assert _link_events(seed, scope, False) == _link_events(seed, scope, True)


@pytest.mark.parametrize("value,field", [
    ({"preset": "carrier_pigeon"}, "cluster.link.preset"),
    ({"bandwidth_gbps": 0}, "cluster.link.bandwidth_gbps"),
    ({"scope": "rack"}, "cluster.link.scope"),
    ({"mtu": 9000}, "cluster.link.mtu"),
])
def test_bad_link_config_names_the_field(value, field):
    with pytest.raises(ConfigError) as e:
        LinkConfig.from_value(value)
    assert e.value.field == field
