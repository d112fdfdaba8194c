"""Executors. Importing this package registers the torch-free ones; the real executor is
registered lazily and imports torch only when it is selected."""

from executors import cost_model  # noqa: F401  (registers)
from executors.base import EXECUTORS, Executor

EXECUTORS.register_lazy("real", "executors.real:build_real_executor")

__all__ = ["EXECUTORS", "Executor"]
