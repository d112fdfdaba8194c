"""A run built from one plain config mapping (what Hydra composes), with the built-in
policies, executors and workloads.

``sim/`` holds the engine and the contracts it drives (``sim.policy.Policy``,
``sim.executor.Executor``, ``sim.workload.Workload``) and imports nothing above it; the
registries that name the implementations live in ``policies/``, ``executors/`` and
``workloads/``. This module hands those registries to the engine's ``Simulation``: every
command and test builds its runs here.

    from experiments.simulation import Simulation, run_simulation
    result = Simulation(cfg, out_dir).run()
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import executors
import policies
import workloads
from sim import simulation as engine
from sim.executor import Executor
from sim.policy import Policy
from sim.result import SimulationResult
from sim.simulation import KVConfig
from sim.specs import HardwareSpec, ModelSpec
from sim.workload import Workload

__all__ = ["BUILT_IN", "KVConfig", "Simulation", "SimulationResult", "run_simulation"]


class BuiltIn:
    """The registries of ``policies/``, ``executors/`` and ``workloads/`` (importing those
    packages registers every built-in entry)."""

    def make_policy(self, section: dict[str, Any], seed: int) -> Policy:
        return policies.make_policy(section, seed=seed)

    def policy_defaults(self, section: dict[str, Any], hardware: HardwareSpec
                        ) -> dict[str, Any]:
        """The engine defaults of the policy ``section`` names, on ``hardware``."""
        try:
            cls = policies.POLICIES.get(str(section.get("name")))
        except KeyError:
            return {}  # make_policy reports the unknown name
        return cls.engine_defaults(hardware)

    def executor_factory(self, name: str) -> Callable[..., Executor]:
        return executors.EXECUTORS.get(name)

    def make_workload(self, section: dict[str, Any], seed: int, *, model: ModelSpec,
                      token_ids: bool) -> Workload:
        return workloads.make_workload(section, seed, model=model, token_ids=token_ids)


BUILT_IN = BuiltIn()


class Simulation(engine.Simulation):
    """``sim.simulation.Simulation`` built from ``cfg`` with the built-in components."""

    def __init__(self, cfg: dict[str, Any], out_dir: Path | None = None,
                 keep_requests: bool = False) -> None:
        super().__init__(cfg, out_dir, keep_requests, components=BUILT_IN)


def run_simulation(cfg: dict[str, Any], out_dir: Path | None = None,
                   keep_requests: bool = False) -> SimulationResult:
    return Simulation(cfg, out_dir, keep_requests).run()
