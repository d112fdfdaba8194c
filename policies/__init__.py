"""Scheduling policies. Importing this package registers every built-in policy."""

from policies import chunked_prefill, fcfs, priority, sjf, static, vllm_v1  # noqa: F401  (registers)
from policies.base import POLICIES, Policy, PolicyConfig, make_policy

__all__ = ["POLICIES", "Policy", "PolicyConfig", "make_policy"]
