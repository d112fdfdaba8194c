"""What a finished run hands back (``Simulation.run``), whichever loop ran it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sim.memory import MemoryPlan
from sim.metrics import MetricsCollector
from sim.outputs import CsvSink
from sim.request import Request

if TYPE_CHECKING:
    from sim.cluster.colocated import Colocated
    from sim.cluster.disaggregated import Disaggregated
    from sim.replica import Replica


@dataclass
class SimulationResult:
    summary: dict[str, Any]
    metrics: MetricsCollector
    replicas: list[Replica]  # empty when the array core ran (summary["step_engine"])
    memory: MemoryPlan
    requests: list[Request]  # finished/rejected requests, when keep_requests=True
    requests_sink: CsvSink
    steps_sink: CsvSink
    deployment: Colocated | Disaggregated | None = None
