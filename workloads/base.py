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


def resolve_path(path: str, field: str, *, file: bool = False) -> Path:
    """A data path from the config: absolute, or relative to the working directory, or else
    relative to the project root (so ``../shared/...`` works from anywhere in the project).
    ``file``: it must be a file (a folder there is refused)."""
    if not path.strip():
        raise ConfigError(field, f"must name a {'file' if file else 'path'}, got {path!r}")
    if "\0" in path:
        raise ConfigError(field, f"a path cannot hold a NUL character, got {path!r}")
    p = Path(path)
    try:
        p = p.expanduser()
    except RuntimeError:  # ~user of no known user: the name as written
        pass
    for candidate in ([p] if p.is_absolute() else [Path.cwd() / p, PROJECT_ROOT / p]):
        try:
            if not candidate.exists():
                continue
            found = candidate.resolve()
        except OSError as e:  # a name too long, a loop of links
            raise ConfigError(field, f"{path}: {e.strerror or e}") from None
        if file and found.is_dir():
            raise ConfigError(field, f"{found} is a folder, not a file")
        return found
    raise ConfigError(field, f"file not found: {path}")


def make_workload(data: dict[str, Any], seed: int, **context: Any) -> Workload:
    name = data.get("name")
    try:
        factory = WORKLOADS.get(str(name))
    except KeyError as e:
        raise ConfigError("workload.name", str(e.args[0])) from None
    return factory({k: v for k, v in data.items() if k != "name"}, seed=seed, **context)
