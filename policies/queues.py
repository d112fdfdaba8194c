"""An index of the waiting queue in a policy's order, updated on arrival (no per-step sort).

The replica's ``step.waiting`` stays the single truth about who waits; a policy keeps one or
more ``WaitingHeap``s beside it. Entries are invalidated lazily: an entry counts only while its
request is still WAITING/PREEMPTED and it is the request's latest push (a request preempted
twice is pushed twice; only the newest entry is live). Each step pops entries in order as the
admission loop asks for them and pushes back the ones it did not admit, so a step costs
O((admitted + 1) log W), not O(W log W).

A request that leaves the replica for good while an entry of it is live (a disaggregated
prefill replica hands it off; another replica may preempt it, making it PREEMPTED again, but
not waiting here) must be ``discard``ed: its status alone would make that entry live again.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from sim.request import Request, RequestStatus

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class WaitingHeap:
    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._heap: list[tuple[Any, int, Request]] = []
        self._seq = 0  # push counter: tie-break and version of an entry
        self._live: dict[int, int] = {}  # request id -> seq of its live entry

    def push(self, req: Request) -> None:
        """Index a request that (again) waits, under its key as of now."""
        self._seq += 1
        self._live[req.request_id] = self._seq
        heapq.heappush(self._heap, (self._key(req), self._seq, req))

    def discard(self, req: Request) -> None:
        """``req`` left this replica: none of its entries is live any more (O(1); they are
        dropped when reached)."""
        self._live.pop(req.request_id, None)

    def _is_live(self, entry: tuple[Any, int, Request]) -> bool:
        _, seq, req = entry
        return req.status in _WAITING and self._live.get(req.request_id) == seq

    def _walk(self, taken: list[tuple[Any, int, Request]]) -> Iterator[Request]:
        """Pop entries in key order, dropping stale ones; each live one goes to ``taken``."""
        heap, live = self._heap, self._live
        pop = heapq.heappop
        while heap:
            entry = pop(heap)
            _, seq, req = entry
            if req.status in _WAITING and live.get(req.request_id) == seq:
                taken.append(entry)
                yield req
            elif live.get(req.request_id) == seq:  # stale: its request left the queue
                del live[req.request_id]

    def _drop(self, entry: tuple[Any, int, Request]) -> None:
        _, seq, req = entry
        if self._live.get(req.request_id) == seq:
            del self._live[req.request_id]

    def ordered(self) -> _Ordered:
        """Iterate the waiting requests in key order, lazily (``with heap.ordered() as
        in_order``). On exit every request taken but still waiting (not admitted) is put back
        under its old key."""
        return _Ordered(self)

    def first(self, expired: Callable[[Request], bool]) -> Request | None:
        """The first waiting request in key order that is not ``expired``, or None. Entries
        before it, stale or expired, are dropped for good, so ``expired`` must stay true of a
        request while it waits (e.g. it has waited some time; pushing it again after it
        waits anew makes a fresh entry). Amortized O(log W) per call."""
        heap = self._heap
        while heap:
            entry = heap[0]
            if self._is_live(entry) and not expired(entry[2]):
                return entry[2]
            heapq.heappop(heap)
            self._drop(entry)
        return None

    def __len__(self) -> int:
        """Entries held, live or not yet found stale (an upper bound on those waiting)."""
        return len(self._heap)


class _Ordered:
    """``WaitingHeap.ordered``'s context: the lazy walk on enter, the put-back on exit (a
    plain class: entered once per admission, where a generator-based context costs more
    than the walk)."""

    __slots__ = ("_heap", "_taken")

    def __init__(self, heap: WaitingHeap) -> None:
        self._heap = heap
        self._taken: list[tuple[Any, int, Request]] = []

    def __enter__(self) -> Iterator[Request]:
        return self._heap._walk(self._taken)

    def __exit__(self, *exc: object) -> None:
        heap = self._heap
        for entry in self._taken:
            if heap._is_live(entry):
                heapq.heappush(heap._heap, entry)
            else:
                heap._drop(entry)
