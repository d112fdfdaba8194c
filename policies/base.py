"""The policy registry and ``make_policy``. The interface itself (``Policy``,
``PolicyConfig``) is the engine's contract and lives in ``sim/policy.py``."""

from __future__ import annotations

from typing import Any

from sim.errors import ConfigError
from sim.policy import Policy, PolicyConfig
from sim.registry import Registry

POLICIES: Registry[type[Policy]] = Registry("policy")

__all__ = ["POLICIES", "Policy", "PolicyConfig", "make_policy"]


def make_policy(data: dict[str, Any], seed: int = 0) -> Policy:
    """Build the policy named by ``data["name"]`` from its config section and the run's seed."""
    name = data.get("name")
    try:
        cls = POLICIES.get(str(name))
    except KeyError as e:
        raise ConfigError("policy.name", str(e.args[0])) from None
    return cls(cls.config_class.from_dict(data), seed=seed)
