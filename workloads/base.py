"""The workload interface: a lazy, arrival-ordered stream of Requests."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sim.errors import ConfigError
from sim.registry import Registry
from sim.request import Request

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


class Workload(ABC):
    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in non-decreasing arrival time, created lazily."""

    @property
    @abstractmethod
    def max_prompt_len(self) -> int:
        """An upper bound on any prompt's length (validated against the batch budget)."""

    @property
    def num_requests(self) -> int | None:
        return None

    def describe(self) -> str:
        return type(self).__name__


def make_workload(data: dict[str, Any], seed: int, **context: Any) -> Workload:
    name = data.get("name")
    try:
        factory = WORKLOADS.get(str(name))
    except KeyError as e:
        raise ConfigError("workload.name", str(e.args[0])) from None
    return factory({k: v for k, v in data.items() if k != "name"}, seed=seed, **context)
