"""The executor registry. The interface itself (``Executor``) is the engine's contract and
lives in ``sim/executor.py``."""

from __future__ import annotations

from sim.executor import Executor
from sim.registry import Registry

EXECUTORS: Registry[Executor] = Registry("executor")

__all__ = ["EXECUTORS", "Executor"]
