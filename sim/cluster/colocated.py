"""Co-located replicas behind a router (``cluster=single``, ``cluster.num_replicas=N``)."""

from __future__ import annotations

from typing import Any

from sim.cluster.router import Router
from sim.replica import Replica
from sim.request import Request


class Colocated:
    """Each request goes to one replica, chosen at arrival, which prefills and decodes it."""

    kind = "colocated"

    def __init__(self, replicas: list[Replica], router: Router) -> None:
        self.replicas = replicas
        self.router = router
        self.routed = [0] * len(replicas)

    def add_request(self, req: Request) -> None:
        # One replica: no routing decision at all (the plain single-replica run).
        i = 0 if len(self.replicas) == 1 else self.router.choose(req, self.replicas)
        self.routed[i] += 1
        self.replicas[i].add_request(req)

    def abort(self, req: Request) -> None:
        """``req``'s client gave up: it leaves its replica at the next step boundary."""
        if not req.is_finished:
            self.replicas[req.replica_id].abort(req)

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    def stall_message(self) -> str:
        return "; ".join(r._stall_message() for r in self.replicas if r.num_unfinished)

    def extra_columns(self, row: tuple) -> tuple:
        """requests.csv cluster columns: prefill and decode replica are the serving one."""
        return (row[1], row[1], "", "", "")

    def summary(self, sim_end: float) -> dict[str, Any]:
        return {}
