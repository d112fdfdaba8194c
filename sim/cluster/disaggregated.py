"""Prefill/decode disaggregation: a prefill pool and a decode pool joined by a KV link.

Life of a request (``cluster=disaggregated``)::

    arrival --router--> prefill replica p: queue, prefill (whole or chunked, as p's policy
        decides), sample the first token      (TTFT ends here)
      --handoff--> decode_router picks decode replica d; the request joins d's FIFO of
        pending transfers, still holding its blocks on p
      --reserve--> d allocates blocks for the prompt's KV (above its watermark); while it
        cannot, the request waits on p holding p's blocks: back-pressure
      --link--> the KV moves p -> d (``sim/cluster/link.py``), then p frees its blocks
      --accept--> d's running set; d's policy decodes it to the end (TPOT, ITL, finish)

A request whose first token is its last finishes on the prefill replica (nothing to move).
Both sides run the same ``Replica`` loop and ``StepPlan`` contract; the request stays RUNNING
from its first prefill step to its finish (see ``StepBuilder``'s handoff methods).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from sim.cluster.link import Link
from sim.cluster.router import Router
from sim.fast_forward import UpcomingArrivals
from sim.kv_manager import blocks_for
from sim.metrics import MetricsCollector
from sim.outputs import CsvSink, request_row
from sim.replica import Replica
from sim.request import Request, RequestStatus, full_length


@dataclass
class TransferRecord:
    prefill_id: int
    ready_time: float = 0.0  # first token sampled, handed off
    decode_id: int | None = None
    nbytes: float = 0.0
    reserved_time: float | None = None  # decode blocks allocated, transfer may start
    start_time: float | None = None  # it holds the link's ports: the copy has started
    arrive_time: float | None = None  # KV in place on the decode replica


def decode_refusal(prompt_len: int, full_len: int, block_size: int, num_blocks: int,
                   watermark: int) -> str | None:
    """Why a decode replica of ``num_blocks`` blocks (``watermark`` of them kept free at
    admission) could never hold a request: its whole length (``full_len`` tokens), or its
    prompt above the watermark; None if it could."""
    need = blocks_for(full_len, block_size)
    if need > num_blocks:
        return (f"exceeds_kv_pool: needs {need} blocks on a decode replica, which has "
                f"{num_blocks}")
    if blocks_for(prompt_len, block_size) > num_blocks - watermark:
        return "exceeds_kv_pool: prompt does not fit above a decode replica's KV watermark"
    return None


class _DecodeTarget:
    """A decode replica as its router sees it: requests it runs plus those assigned to it
    (waiting for blocks or in transit), and the KV usage it reports."""

    __slots__ = ("replica", "assigned")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.assigned = 0

    @property
    def num_outstanding(self) -> int:
        return self.replica.num_outstanding + self.assigned

    @property
    def kv_usage(self) -> float:
        return self.replica.kv_usage

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.replica.cached_prefix_tokens(req)


class Disaggregated:
    kind = "disaggregated"

    def __init__(self, env: simpy.Environment, prefill: list[Replica], decode: list[Replica],
                 router: Router, decode_router: Router, link: Link, *,
                 kv_bytes_per_token: float, lanes: int, metrics: MetricsCollector,
                 requests_sink: CsvSink) -> None:
        """``kv_bytes_per_token``: K and V of one token over all layers (the whole model);
        ``lanes``: parallel rank-to-rank links per transfer (min of the two sides' GPUs per
        replica). Prefill replicas must be built with ``handoff=self.handoff``, decode
        replicas with ``on_finished`` calling ``self.on_decode_finished``."""
        self.env = env
        self.prefill = prefill
        self.decode = decode
        self.replicas = prefill + decode
        self.router = router
        self.decode_router = decode_router
        self.link = link
        self.kv_bytes_per_token = kv_bytes_per_token
        self.lanes = lanes
        self.metrics = metrics
        self.requests_sink = requests_sink
        self._first_decode_id = decode[0].replica_id
        self._targets = [_DecodeTarget(d) for d in decode]
        self._pending: list[deque[Request]] = [deque() for _ in decode]
        self.records: dict[int, TransferRecord] = {}
        self.routed = [0] * len(self.replicas)
        self.num_backpressured = 0
        self.backpressure_wait = array("d")
        self.transfer_time = array("d")
        self.num_in_transit = 0
        # Transfers reserved and not yet arrived, per decode replica: request id -> earliest
        # arrival time.
        self._in_flight: list[dict[int, float]] = [{} for _ in decode]
        self._next_arrival = lambda: float("inf")
        # Lazy decode (``enable_lazy_decode``): the upcoming arrivals and how many of them a
        # decode jump is priced past.
        self._upcoming: UpcomingArrivals | None = None
        self._lazy_span = 0
        # Requests aborted (online mode) before their KV reached a decode replica: they leave
        # at their handoff or when their transfer ends.
        self._aborting: set[int] = set()
        self._transfers: dict[int, simpy.Process] = {}  # the transfers reserved, by request

    def enable_decode_jumps(self, next_arrival) -> None:
        """Give every decode replica a horizon (``decode_horizon``) so that it can take
        decode jumps; ``next_arrival()``: the next arrival's time in the cluster."""
        self._next_arrival = next_arrival
        for j, rep in enumerate(self.decode):
            rep.horizon = (lambda j=j: self.decode_horizon(j))

    def enable_lazy_decode(self, upcoming: UpcomingArrivals, span: int) -> None:
        """Let decode replicas sleep through their jumps past every other replica's steps
        (``Replica.enable_lazy_decode``, ``lazy_decode_horizon``): a replica's count changes
        only at its own finishes (each at its exact time; in a closed loop a jump ends at the
        first) and at the transfers that reach it, which cut into its jump, and the decode
        router reads its KV use and cache as stepping shows them (the steps begun take their
        blocks first). ``upcoming``, ``span``: the upcoming arrivals, and how many of them a
        jump is priced past (a closed loop's turns are not among them: a jump may end
        anywhere)."""
        self._upcoming = upcoming
        self._lazy_span = max(1, span)
        for j, rep in enumerate(self.decode):
            if rep.enable_lazy_decode():
                rep.horizon = (lambda j=j: self.lazy_decode_horizon(j))

    def lazy_decode_horizon(self, j: int) -> float:
        """How far lazy decode replica ``j`` prices a jump (a jump may end anywhere: what
        reaches the replica meanwhile cuts it): the earliest arrival of a transfer to it, or
        the arrival ``span`` places after the next one (``UpcomingArrivals.time``) if that is
        sooner. While transfers wait for its blocks (back-pressure), a finish reserves for
        them: no jumps then."""
        if self._pending[j]:
            return -float("inf")
        h = self._upcoming.time(self._lazy_span)  # type: ignore[union-attr]
        for t in self._in_flight[j].values():
            if t < h:
                h = t
        return h

    def decode_horizon(self, j: int) -> float:
        """A lower bound on the time of the next event from outside that can touch decode
        replica ``j``: a handoff (KV reserved on it) happens only at the end of a prefill
        step, and a prefill replica starts a step only at an arrival, at the end of its last
        step, or when a transfer frees its blocks; a transfer arrives no earlier than its
        reservation plus its serialization and latency; a prefill replica woken at this
        instant starts a step now. While transfers wait for its blocks
        (back-pressure), a finish reserves for them: no jumps then. While transfers wait for
        another decode replica's blocks, a finish there may start one at any moment, and its
        arrival frees prefill blocks: no later than now plus the quickest of those transfers.

        A jump up to this bound stops at every prefill step end, whichever decode replica that
        step hands off to. Plain decode replicas sleep through their jumps instead, cut only by
        what reaches them (``enable_lazy_decode``); this bound serves pipelined ones, whose
        repeats stop there."""
        if self._pending[j]:
            return -float("inf")
        now = self.env.now
        h = self._next_arrival()
        for p in self.prefill:
            # A prefill replica woken at this instant (an arrival, a transfer freeing its
            # blocks) starts a step now whose end is not known yet.
            end = now if p.waking else p.busy_until
            if end < h:
                h = end
        for flights in self._in_flight:
            for t in flights.values():
                if t < h:
                    h = t
        quickest = min((self.records[r.request_id].nbytes for pending in self._pending
                        for r in pending), default=None)
        if quickest is not None:
            soonest = now + self.link.serialization_time(quickest, self.lanes) + self.link.latency
            if soonest < h:
                h = soonest
        return h

    # ---- arrival ------------------------------------------------------------------------
    def decode_rejection(self, req: Request) -> str | None:
        """Why the decode pool could never hold ``req`` (all decode replicas are alike)."""
        d = self.decode[0]
        return decode_refusal(req.prompt_len, full_length(req), d.kv.block_size,
                              d.kv.num_gpu_blocks, d.builder.watermark_blocks)

    def add_request(self, req: Request) -> None:
        reason = self.decode_rejection(req) if req.max_output_len > 1 else None
        if reason is not None:
            self.metrics.on_arrival(req)
            req.reject(reason)
            self.metrics.on_rejected(req)
            self.requests_sink.write(request_row(req))
            return
        i = self.router.choose(req, self.prefill)
        self.routed[i] += 1
        self.prefill[i].add_request(req)

    # ---- abort (online mode) --------------------------------------------------------------
    def abort(self, req: Request) -> None:
        """``req``'s client gave up. It leaves where it is at the next moment that can let it
        go, its blocks freed: on its prefill replica at the next step boundary (a step
        running it finishes first, and if that step sampled its first token it leaves at the
        handoff); waiting for a decode replica's blocks, or with its transfer queued for the
        link's ports, at once (the transfer is cancelled); while its KV is being sent, when
        the transfer ends (the copy is not cut short; the decode replica frees what it
        reserved); on its decode replica, at that replica's next step boundary."""
        if req.is_finished:
            return
        rec = self.records.get(req.request_id)
        if rec is None:  # not handed off yet
            self._aborting.add(req.request_id)
            self.prefill[req.replica_id - self.prefill[0].replica_id].abort(req)
            return
        j = rec.decode_id - self._first_decode_id  # type: ignore[operator]
        if rec.arrive_time is not None:
            self.decode[j].abort(req)
        elif rec.reserved_time is None:  # back-pressured: it still holds its prefill blocks
            self._pending[j].remove(req)
            self._targets[j].assigned -= 1
            self._prefill_of(rec).release_handoff(req)
            self._leave_aborted(req)
            self._reserve(j)  # the transfers behind it may fit
        elif rec.start_time is None:  # queued for the link's ports: nothing sent yet
            self._transfers[req.request_id].interrupt()
            self._off_link(req, rec, j)
            self._drop_aborted(req, j)
        else:  # sending: the copy is not cut short
            self._aborting.add(req.request_id)

    def _drop_aborted(self, req: Request, j: int) -> None:
        """``req``, aborted with blocks reserved on decode replica ``j``, frees them and
        leaves; the transfers waiting there may take them."""
        self.decode[j].drop_transfer(req)
        self._leave_aborted(req)
        self._reserve(j)

    def _leave_aborted(self, req: Request) -> None:
        """``req`` leaves between replicas: written with status ``aborted``."""
        self._aborting.discard(req.request_id)
        req.transition(RequestStatus.ABORTED)
        req.finish_time = self.env.now
        self.metrics.on_aborted(req)
        self.requests_sink.write(request_row(req))

    def _prefill_of(self, rec: TransferRecord) -> Replica:
        return self.prefill[rec.prefill_id - self.prefill[0].replica_id]

    # ---- prefill -> decode --------------------------------------------------------------
    def handoff(self, req: Request, replica: Replica) -> None:
        """Called by a prefill replica right after ``req`` sampled its first token."""
        if req.request_id in self._aborting:  # aborted while its last prefill step ran
            replica.release_handoff(req)
            self._leave_aborted(req)
            return
        now = self.env.now
        j = self.decode_router.choose(req, self._targets)
        tokens = blocks_for(req.num_computed_tokens, replica.kv.block_size) * replica.kv.block_size
        rec = TransferRecord(replica.replica_id, now, self.decode[j].replica_id,
                             tokens * self.kv_bytes_per_token)
        self.records[req.request_id] = rec
        self._targets[j].assigned += 1
        self.routed[len(self.prefill) + j] += 1
        self._pending[j].append(req)
        self._reserve(j)

    def _reserve(self, j: int) -> None:
        """Start the transfers of decode replica ``j``'s pending requests, in FIFO order,
        while it can allocate their blocks."""
        pending, replica, now = self._pending[j], self.decode[j], self.env.now
        while pending and replica.reserve_transfer(pending[0]):
            req = pending.popleft()
            rec = self.records[req.request_id]
            rec.reserved_time = now
            wait = now - rec.ready_time
            if wait > 0:
                self.num_backpressured += 1
            self.backpressure_wait.append(wait)
            self.num_in_transit += 1
            # Until its last event is scheduled, a transfer bounds the decode jumps at the
            # earliest moment that can happen (the end of its serialization, or now without
            # latency); then at its arrival (Link.transfer's on_last). A jump whose last step
            # ends exactly at the arrival must have been planned after that event was
            # scheduled, as the step-by-step loop's last step is, or the two take the
            # transfer and the step end in different orders.
            self._in_flight[j][req.request_id] = (
                now + self.link.serialization_time(rec.nbytes, self.lanes)
                if self.link.latency else now)
            self._transfers[req.request_id] = self.env.process(self._transfer(req, rec, j))

    def _transfer(self, req: Request, rec: TransferRecord, j: int):
        def on_last(arrival: float) -> None:
            self._in_flight[j][req.request_id] = arrival

        def on_start() -> None:
            rec.start_time = self.env.now

        try:
            yield from self.link.transfer(rec.prefill_id, rec.decode_id, rec.nbytes,
                                          self.lanes, on_last, on_start)
        except simpy.Interrupt:  # aborted while queued for the link (``abort`` freed it)
            return
        rec.arrive_time = self.env.now
        self.transfer_time.append(rec.arrive_time - rec.reserved_time)
        self._off_link(req, rec, j)
        if req.request_id in self._aborting:  # aborted on the way
            self._drop_aborted(req, j)
        else:
            self.decode[j].accept_transferred(req)

    def _off_link(self, req: Request, rec: TransferRecord, j: int) -> None:
        """``req``'s transfer to decode replica ``j`` is over (arrived, or cancelled while
        it queued): the prefill side frees its blocks."""
        del self._transfers[req.request_id]
        self.num_in_transit -= 1
        del self._in_flight[j][req.request_id]
        self._prefill_of(rec).release_handoff(req)
        self._targets[j].assigned -= 1

    def on_decode_finished(self, req: Request) -> None:
        """A decode replica freed blocks: retry its pending transfers."""
        self._reserve(req.replica_id - self._first_decode_id)

    # ---- bookkeeping --------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return (sum(r.num_unfinished for r in self.replicas) + self.num_in_transit
                + sum(len(p) for p in self._pending))

    def stall_message(self) -> str:
        parts = [r._stall_message() for r in self.replicas if r.num_unfinished]
        waiting = [len(p) for p in self._pending]
        return "; ".join(parts + [f"pending transfers per decode replica {waiting}, "
                                  f"{self.num_in_transit} in transit"])

    def extra_columns(self, row: tuple) -> tuple:
        rec = self.records.pop(row[0], None)
        if rec is None:  # rejected, finished or aborted on the prefill replica
            self._aborting.discard(row[0])
            return (row[1], "", "", "", "")
        if rec.reserved_time is None:  # aborted while waiting for the decode replica's blocks
            return (rec.prefill_id, rec.decode_id, "", "", "")
        wait = rec.reserved_time - rec.ready_time
        if rec.arrive_time is None:  # aborted while its transfer queued for the link
            return (rec.prefill_id, rec.decode_id, "", repr(wait), "")
        return (rec.prefill_id, rec.decode_id, int(rec.nbytes), repr(wait),
                repr(rec.arrive_time - rec.reserved_time))

    def summary(self, sim_end: float) -> dict[str, Any]:
        return transfer_summary(self.link, self.transfer_time, self.backpressure_wait,
                                self.num_backpressured, sim_end)


def transfer_summary(link: Link, transfer_time: array, backpressure_wait: array,
                     num_backpressured: int, sim_end: float) -> dict[str, Any]:
    """summary.json's figures of a deployment's KV transfers: their times (reservation to
    arrival) and back-pressure waits (first token to reservation), in seconds, one per
    transfer reserved, and the link's ports."""
    t = np.frombuffer(transfer_time, dtype=np.float64) * 1e3
    w = np.frombuffer(backpressure_wait, dtype=np.float64) * 1e3
    util = link.utilization(sim_end)
    return {
        "num_kv_transfers": link.num_transfers,
        "kv_transfer_bytes": link.bytes_sent,
        "mean_kv_transfer_time_ms": float(t.mean()) if len(t) else 0.0,
        "p99_kv_transfer_time_ms": float(np.percentile(t, 99)) if len(t) else 0.0,
        "kv_backpressure_count": num_backpressured,
        "mean_kv_backpressure_wait_ms": float(w.mean()) if len(w) else 0.0,
        "p99_kv_backpressure_wait_ms": float(np.percentile(w, 99)) if len(w) else 0.0,
        "link_utilization": max(util) if util else 0.0,
        "link_utilization_per_port": util,
    }
