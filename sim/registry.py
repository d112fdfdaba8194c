"""Name -> factory registries filled by a decorator (policies, executors, workloads, routers)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, str] = {}  # name -> "module:attr", imported on first use

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries or name in self._lazy:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = factory
            return factory

        return deco

    def register_lazy(self, name: str, target: str) -> None:
        """Register a factory that lives in an optional module (e.g. one that needs torch)."""
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._lazy[name] = target

    def names(self) -> list[str]:
        return sorted({*self._entries, *self._lazy})

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._entries:
            if name not in self._lazy:
                raise KeyError(
                    f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
                )
            module, attr = self._lazy[name].split(":")
            # The module registers itself on import if it uses the decorator.
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:
                missing = (e.name or "").split(".")[0]
                if missing == module.split(".")[0]:
                    raise
                # An optional dependency is not installed: say which, not a traceback.
                raise KeyError(
                    f"{self.kind} {name!r} needs {missing!r}, which is not installed (the "
                    f"optional 'real' extra: pip install -e '.[real]')") from None
            self._entries.setdefault(name, getattr(mod, attr))
        return self._entries[name]
