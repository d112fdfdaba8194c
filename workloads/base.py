"""The workload registry, ``make_workload`` and data paths. The interface itself
(``Workload``) lives in ``sim/workload.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.errors import ConfigError
from sim.registry import Registry
from sim.workload import Workload

__all__ = ["PROJECT_ROOT", "WORKLOADS", "Workload", "make_workload", "resolve_path"]

WORKLOADS: Registry = Registry("workload")

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str, field: str) -> Path:
    """A data path from the config: absolute, or relative to the working directory, or else
    relative to the project root (so ``../shared/...`` works from anywhere in the project)."""
    p = Path(path).expanduser()
    for candidate in ([p] if p.is_absolute() else [Path.cwd() / p, PROJECT_ROOT / p]):
        if candidate.exists():
            return candidate.resolve()
    raise ConfigError(field, f"file not found: {path}")


def make_workload(data: dict[str, Any], seed: int, **context: Any) -> Workload:
    name = data.get("name")
    try:
        factory = WORKLOADS.get(str(name))
    except KeyError as e:
        raise ConfigError("workload.name", str(e.args[0])) from None
    return factory({k: v for k, v in data.items() if k != "name"}, seed=seed, **context)
