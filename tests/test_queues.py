"""ReplicaQueues: the running set stays in arrival order through adds and removals."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.request import Request
from sim.step_builder import ReplicaQueues


@settings(max_examples=200, deadline=None)
@given(arrivals=st.lists(st.sampled_from([0.0, 0.5, 0.5, 1.0, 2.5]), min_size=1, max_size=12),
       data=st.data())
def test_running_stays_in_arrival_order_with_ties(arrivals, data):
    reqs = [Request(i, t, 4, 2) for i, t in enumerate(arrivals)]
    q = ReplicaQueues()
    added = data.draw(st.permutations(reqs))
    for r in added:
        q.add_running(r)
        want = sorted(q.running, key=lambda x: (x.arrival_time, x.request_id))
        assert q.running == want
    for r in data.draw(st.permutations(reqs)):
        q.remove_running(r)
        assert r not in q.running
        with pytest.raises(ValueError, match=f"request {r.request_id} is not running"):
            q.remove_running(r)
        assert q.running == sorted(q.running, key=lambda x: (x.arrival_time, x.request_id))
    assert q.running == []


def test_removing_a_request_that_ties_with_running_ones_but_is_not_running_fails():
    q = ReplicaQueues()
    a, b, c = Request(1, 1.0, 4, 2), Request(2, 1.0, 4, 2), Request(3, 1.0, 4, 2)
    q.add_running(a)
    q.add_running(c)
    with pytest.raises(ValueError, match="request 2 is not running"):
        q.remove_running(b)
    assert q.running == [a, c]


def test_waiting_heap_forgets_a_discarded_request_even_if_it_waits_again_elsewhere():
    from policies.queues import WaitingHeap
    from sim.request import RequestStatus

    a, b = Request(0, 0.0, 8, 4), Request(1, 1.0, 8, 4)
    heap = WaitingHeap(lambda r: r.arrival_time)
    heap.push(a)
    heap.push(b)
    heap.discard(a)  # handed off to another replica...
    a.transition(RequestStatus.RUNNING)
    a.transition(RequestStatus.PREEMPTED)  # ... and recomputed there: waiting, not here
    with heap.ordered() as it:
        assert list(it) == [b]
    assert len(heap) == 1  # a's entry was dropped, b's put back


def test_waiting_heap_first_drops_expired_and_stale_entries_for_good():
    """``WaitingHeap.first`` (SJF's next aging deadline): the first waiting request in key
    order that is not expired; expired and stale entries before it are dropped, a request
    pushed again after it waits anew counts again."""
    from policies.queues import WaitingHeap
    from sim.request import RequestStatus

    reqs = [Request(i, float(t), 4, 2) for i, t in enumerate([0.0, 1.0, 2.0, 3.0])]
    heap = WaitingHeap(lambda r: (r.arrival_time, r.request_id))
    for r in reqs:
        heap.push(r)
    assert heap.first(lambda r: False) is reqs[0]
    assert heap.first(lambda r: 2.5 - r.arrival_time >= 2.0) is reqs[1]  # 0 has aged
    assert len(heap) == 3  # its entry is gone
    reqs[1].transition(RequestStatus.RUNNING)  # admitted: stale
    assert heap.first(lambda r: False) is reqs[2] and len(heap) == 2
    heap.discard(reqs[2])  # left the replica
    assert heap.first(lambda r: False) is reqs[3]
    reqs[1].transition(RequestStatus.PREEMPTED)  # waits again: a fresh entry counts
    heap.push(reqs[1])
    assert heap.first(lambda r: False) is reqs[1]
    assert heap.first(lambda r: True) is None and len(heap) == 0
