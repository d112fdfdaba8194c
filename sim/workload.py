"""The workload interface the engine reads: a lazy, arrival-ordered stream of Requests. It
lives in ``sim/`` because a run consumes it; the generators and trace readers live in
``workloads/`` and register there (``workloads.base.WORKLOADS``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from sim.request import Request


class Workload(ABC):
    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in non-decreasing arrival time, created lazily."""

    @property
    @abstractmethod
    def max_prompt_len(self) -> int:
        """An upper bound on any prompt's length (validated against the batch budget)."""

    @property
    def num_requests(self) -> int | None:
        return None

    def describe(self) -> str:
        return type(self).__name__

    #: Whether finished requests bring new ones (``follow_up``): a closed loop, such as
    #: a conversation whose next turn is sent after the answer to the previous one.
    closed_loop: bool = False

    def follow_up(self, req: Request) -> Request | None:
        """The request a finished (or rejected) ``req`` brings, arriving at its own
        ``arrival_time`` (>= ``req.finish_time``); None if none. Open-loop workloads bring
        none."""
        return None
