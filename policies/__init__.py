"""Scheduling policies. Importing this package registers every built-in policy."""

from policies import fcfs  # noqa: F401  (registers)
from policies.base import POLICIES, Policy, PolicyConfig, make_policy

__all__ = ["POLICIES", "Policy", "PolicyConfig", "make_policy"]
