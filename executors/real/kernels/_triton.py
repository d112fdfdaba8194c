"""Triton, or a stand-in when it is not installed (e.g. macOS), so that the torch reference
kernels beside each Triton kernel still import. Launching a kernel without Triton raises."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Unlaunchable:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"kernel {self.fn.__name__} needs triton, which is not installed; "
                               f"use executor.kernels=torch")

    def _jit(fn: Any = None, **_options: Any) -> Any:  # @triton.jit and @triton.jit(...)
        return _Unlaunchable(fn) if fn is not None else _Unlaunchable

    triton = SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b),
                             next_power_of_2=lambda n: 1 << max(0, (n - 1).bit_length()))
    tl = SimpleNamespace(constexpr=Any)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


__all__ = ["HAS_TRITON", "interpreting", "next_pow2", "tl", "triton"]
