"""The KV-transfer link between the prefill and the decode pool.

Model: every port is a FIFO queue of capacity one (``Port``). A transfer holds its ports
for its serialization time (bytes / bandwidth) and then arrives ``latency`` later (the
latency is propagation and set-up, it does not occupy the port). Concurrent transfers on a
port therefore queue: two transfers of S bytes started together finish at
``S/B + L`` and ``2 S/B + L``. (FIFO, not fair sharing: under fair sharing both would finish at
``2 S/B + L``; FIFO gives the same makespan and a lower mean, as NIC queues do.)

``scope`` says which ports a transfer uses:

* ``replica`` (default): each replica has its own NIC port (one per GPU rank; ranks send their
  KV shards in parallel). A transfer from prefill replica p to decode replica d holds p's port
  and then d's port, so a decode replica fed by three prefill replicas is limited by its own
  port. Ports are always acquired sender first, receiver second, so no cycle can form.
* ``cluster``: one port carries every transfer (a single shared uplink).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

import simpy

from sim.config_types import typed_fields
from sim.errors import ConfigError, require

# Effective per-direction bandwidth of one GPU's link and its one-way latency.
#   nvlink:     A100 NVLink3 send/recv fitted to Vidur's a100_dgx intra-node measurements
#               (conf/network/a100_80gb.yaml: 277 GB/s, 12.9 us).
#   infiniband: one NDR 400 Gb/s NIC per GPU, as fitted to Vidur's h100_dgx cross-node
#               send/recv (35.1 GB/s, 22.3 us).
#   pcie:       PCIe Gen4 x16 through host memory, effective 25 GB/s, 10 us.
#   ethernet:   100 GbE with a TCP stack, effective 11 GB/s, 50 us.
LINK_PRESETS: dict[str, tuple[float, float]] = {  # name -> (bandwidth GB/s, latency us)
    "nvlink": (277.4, 12.9),
    "infiniband": (35.1, 22.3),
    "pcie": (25.0, 10.0),
    "ethernet": (11.0, 50.0),
}
SCOPES = ("replica", "cluster")


@dataclass(frozen=True)
class LinkConfig:
    preset: str = "infiniband"
    bandwidth_gbps: float | None = None  # overrides the preset
    latency_us: float | None = None  # overrides the preset
    scope: str = "replica"

    def __post_init__(self) -> None:
        require(isinstance(self.preset, str) and self.preset in LINK_PRESETS,
                "cluster.link.preset",
                f"unknown link {self.preset!r}; known: {', '.join(LINK_PRESETS)}")
        require(self.bandwidth_gbps is None or self.bandwidth_gbps > 0,
                "cluster.link.bandwidth_gbps", f"must be > 0, got {self.bandwidth_gbps}")
        require(self.latency_us is None or self.latency_us >= 0, "cluster.link.latency_us",
                f"must be >= 0, got {self.latency_us}")
        require(self.scope in SCOPES, "cluster.link.scope",
                f"must be one of {list(SCOPES)}, got {self.scope!r}")

    @classmethod
    def from_value(cls, value: str | dict | None) -> LinkConfig:
        """``link: infiniband`` or ``link: {preset: ..., bandwidth_gbps: ..., ...}``."""
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(preset=value)
        if not isinstance(value, dict):
            raise ConfigError("cluster.link", f"must be a preset name or a mapping, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"cluster.link.{unknown[0]}",
                              f"unknown option; known: {', '.join(sorted(known))}")
        return cls(**typed_fields(cls, value, "cluster.link"))

    @property
    def bandwidth_bytes_per_s(self) -> float:
        gbps = self.bandwidth_gbps
        if gbps is None:
            gbps = LINK_PRESETS[self.preset][0]
        return gbps * 1e9

    @property
    def latency_s(self) -> float:
        us = self.latency_us if self.latency_us is not None else LINK_PRESETS[self.preset][1]
        return us * 1e-6


class Port:
    """One port: a FIFO queue of capacity one that grants in simpy.Resource's order, event
    for event, with fewer events and less bookkeeping (a transfer takes two ports, and a
    disaggregated run of 100,000 requests 100,000 transfers).

    A request is an event that succeeds when it holds the port (at once if the port is free
    and nobody waits). A release frees the port and, like simpy's ``Release`` event, hands
    it to the next in line only when an event scheduled now is processed, or earlier if a
    new request comes first (which then queues behind it). A release with nobody waiting
    schedules nothing here, where simpy schedules a ``Release`` event that hands the port
    over when processed. The two orders are the same (tests/test_routing.py compares them)
    unless, at one instant, a port is released with nobody waiting, granted at once to a new
    request, and released again by an interrupt before that request's process resumed,
    someone waiting meanwhile: simpy then hands it over at the first release's event, and
    this port at the second's. Only an abort interrupts a transfer
    (``Disaggregated.abort``), and it runs between events, when every grant has resumed."""

    __slots__ = ("env", "holder", "waiting")

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.holder: simpy.Event | None = None
        self.waiting: deque[simpy.Event] = deque()

    def request(self) -> simpy.Event:
        ev = simpy.Event(self.env)
        self.waiting.append(ev)
        self._grant(None)
        return ev

    def release(self, ev: simpy.Event) -> None:
        """Give the port up (``ev`` holds it) or leave the queue (``ev`` still waits)."""
        if self.holder is ev:
            self.holder = None
            if self.waiting:
                handover = simpy.Event(self.env)
                handover.callbacks.append(self._grant)
                handover.succeed()
        else:
            self.waiting.remove(ev)

    def _grant(self, _: simpy.Event | None) -> None:
        if self.holder is None and self.waiting:
            self.holder = ev = self.waiting.popleft()
            ev.succeed()


class Link:
    """The ports of one deployment and the transfers over them (see the module docstring)."""

    def __init__(self, env: simpy.Environment, config: LinkConfig, num_replicas: int) -> None:
        self.env = env
        self.config = config
        self.bandwidth = config.bandwidth_bytes_per_s
        self.latency = config.latency_s
        n = 1 if config.scope == "cluster" else num_replicas
        self.ports = [Port(env) for _ in range(n)]
        self.busy_time = [0.0] * n
        self.bytes_sent = 0.0
        self.num_transfers = 0

    def _ports_for(self, src: int, dst: int) -> list[int]:
        return [0] if self.config.scope == "cluster" else [src, dst]

    def serialization_time(self, nbytes: float, lanes: int = 1) -> float:
        """Seconds a transfer of ``nbytes`` holds its ports, spread over ``lanes`` parallel
        rank-to-rank lanes (min of the two sides' TP degrees)."""
        return nbytes / (self.bandwidth * lanes)

    def transfer(self, src: int, dst: int, nbytes: float, lanes: int = 1,
                 on_last: Callable[[float], None] | None = None,
                 on_start: Callable[[], None] | None = None,
                 ) -> Generator[simpy.Event, None, None]:
        """A simpy process: queue for the ports, send, arrive ``latency`` later.
        ``on_last(arrival)``: called as the transfer's last event is scheduled (the latency
        timeout, or without latency the serialization), with the exact arrival time;
        ``on_start()``: when it holds its ports and starts sending. Interrupted while it
        queues, it gives up its places (simpy.Interrupt reaches the caller)."""
        held = []
        try:
            for p in self._ports_for(src, dst):
                req = self.ports[p].request()
                held.append((p, req))
                yield req
            if on_start is not None:
                on_start()
            busy = self.serialization_time(nbytes, lanes)
            if on_last is not None and not self.latency:
                on_last(self.env.now + busy)
            yield self.env.timeout(busy)
            for p, _ in held:
                self.busy_time[p] += busy
        finally:
            for p, req in held:  # the next in the queue gets the port, or leave the queue
                self.ports[p].release(req)
        self.bytes_sent += nbytes
        self.num_transfers += 1
        if self.latency:
            if on_last is not None:
                on_last(self.env.now + self.latency)
            yield self.env.timeout(self.latency)

    def utilization(self, duration: float) -> list[float]:
        """Busy fraction of each port over ``duration`` seconds."""
        if duration <= 0:
            return [0.0] * len(self.ports)
        return [b / duration for b in self.busy_time]
