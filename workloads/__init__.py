"""Workloads. Importing this package registers the built-in generators."""

from workloads import multi_turn, synthetic, trace  # noqa: F401  (registers)
from workloads.base import WORKLOADS, Workload, make_workload

__all__ = ["WORKLOADS", "Workload", "make_workload"]
