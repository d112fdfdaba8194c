"""Scheduling policies. Importing this package registers every built-in policy."""

from policies import (  # noqa: F401  (registers)
    chunked_prefill,
    fcfs,
    priority,
    sglang,
    sjf,
    static,
    trtllm,
    vllm_v1,
)
from policies.base import POLICIES, Policy, PolicyConfig, make_policy

__all__ = ["POLICIES", "Policy", "PolicyConfig", "make_policy"]
