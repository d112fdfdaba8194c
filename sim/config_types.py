"""Strict scalar types for config values, with errors that name the field.

Hydra hands over whatever YAML or the command line spelled:
``policy.enable_chunked_prefill=no`` arrives as the string ``"no"`` (YAML 1.1's false is not
recognised by Hydra's override grammar), ``policy.max_num_seqs=2.5`` as a float,
``workload.qps=abc`` as a string. Python's ``bool()``, ``int()`` and ``float()`` would turn
these into a truthy flag, a silently truncated count or a bare ``ValueError`` mid-run; these
helpers refuse them up front:

* an int field takes an integer (a float only when it is integral, e.g. ``1e5`` on the
  command line) in the signed 64-bit range numpy and the C code below compute in; never a
  bool, a string, ``2.5`` or a non-finite value;
* a float field takes any finite int or float; never a bool, a string or a subnormal float
  (below 2.2e-308 in magnitude, but not 0: its reciprocal, a time or a size derived from
  it, is infinite);
* a bool field takes only ``true`` / ``false``;
* a number field named for a duration (``..._s``, ``..._ms``, ``..._us``) is at most
  ``MAX_TIME_S`` in magnitude: a step or a wait that long leaves the simulated clock where
  float times cannot carry microseconds (and sums of a few overflow); one named for a memory
  size (``..._gib``) is at most ``MAX_MEMORY_GIB``.

``typed_fields(cls, data, section)`` applies them to a mapping by the dataclass ``cls``'s
annotations (``int``, ``float``, ``bool``, each optionally ``| None``); fields of other types
pass through unchanged, for the dataclass's own checks.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from dataclasses import fields, is_dataclass
from functools import cache
from numbers import Integral, Real
from typing import Any

from sim.errors import ConfigError

_SCALARS = (bool, int, float)
INT64_MAX = 2**63 - 1
# Simulated times beyond this (about 31.7 years) have a float spacing above 0.1 us: latencies
# of microseconds added to them would be rounded away. Workloads whose arrivals, think times
# or scaled trace times would reach it are refused.
MAX_TIME_S = 1e9
# Memory sizes (GiB) beyond 64 TiB: no device or host pool of one GPU is that large, and KV
# block counts derived from them reach sizes nothing below handles.
MAX_MEMORY_GIB = 2**16


def _shown(value: Any) -> str:
    kind = "a string" if isinstance(value, str) else type(value).__name__
    return f"{value!r} ({kind})"


def _digits(n: Any) -> str:
    """An integer for a message: as it is, or its sign and number of digits when long."""
    text = str(n)
    if len(text) <= 24:
        return text
    return f"a {'negative ' if n < 0 else ''}{len(text.lstrip('-'))}-digit integer"


def as_int(value: Any, field: str, minimum: int | None = None) -> int:
    """``value`` as an int: an integer, or an integral finite float. ``minimum``: inclusive."""
    number = isinstance(value, Real) and not isinstance(value, bool)
    if not (isinstance(value, Integral) and number
            or number and math.isfinite(value) and float(value).is_integer()):
        raise ConfigError(field, f"must be an integer, got {_shown(value)}")
    out = int(value)
    if not -INT64_MAX <= out <= INT64_MAX:
        raise ConfigError(field, f"must be an integer of magnitude below 2**63, got "
                                 f"{value if isinstance(value, float) else _digits(out)}")
    if minimum is not None and out < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {out}")
    return out


def as_float(value: Any, field: str) -> float:
    """``value`` as a finite float (ints are accepted)."""
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            out = float(value)
        except OverflowError:  # an int beyond float's range
            raise ConfigError(field, f"must be a finite number, got {_digits(value)}") from None
        if not math.isfinite(out):
            raise ConfigError(field, f"must be a finite number, got {out}")
        if out != 0 and abs(out) < sys.float_info.min:
            raise ConfigError(field, f"must be 0 or at least {sys.float_info.min:.3g} in "
                                     f"magnitude (a subnormal float), got {out}")
        return out + 0.0  # -0.0 as 0.0 (numpy refuses a scale whose sign bit is set)
    raise ConfigError(field, f"must be a number, got {_shown(value)}")


def as_bool(value: Any, field: str) -> bool:
    """``value`` as a bool: only ``True`` or ``False`` (no strings, no 0/1)."""
    if isinstance(value, bool):
        return value
    raise ConfigError(field, f"must be true or false, got {_shown(value)}")


_COERCE = {int: as_int, float: as_float, bool: as_bool}
#: Sizes in GiB whose names (vLLM's) carry no ``_gib`` suffix.
GIB_FIELDS = frozenset({"kv.swap_space", "kv.kv_offloading_size"})
# Seconds per unit of a duration field, by the suffix of its name.
_DURATION_UNITS = {"_s": 1.0, "_ms": 1e-3, "_us": 1e-6}


def check_magnitude(value: float, field: str) -> None:
    """Refuse a duration (``field`` in the unit its suffix names) beyond ``MAX_TIME_S``, or a
    memory size (``..._gib``) beyond ``MAX_MEMORY_GIB``; other fields pass."""
    unit = next((u for suffix, u in _DURATION_UNITS.items() if field.endswith(suffix)), None)
    if unit is not None and abs(value) * unit > MAX_TIME_S:
        raise ConfigError(field, f"must be at most {MAX_TIME_S / unit:g} in magnitude (a "
                                 f"longer time leaves the simulated clock where floats cannot "
                                 f"carry microseconds), got {value}")
    if (field.endswith("_gib") or field in GIB_FIELDS) and abs(value) > MAX_MEMORY_GIB:
        raise ConfigError(field, f"must be at most {MAX_MEMORY_GIB} GiB in magnitude, got "
                                 f"{value}")


@cache
def _scalar_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """Field name -> (scalar type, None allowed) for the int/float/bool fields of ``cls``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, bool]] = {}
    for f in fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (hint,)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALARS:
            out[f.name] = (rest[0], optional)
    return out


def typed_fields(cls: type, data: dict[str, Any], section: str) -> dict[str, Any]:
    """A copy of ``data`` whose int/float/bool fields (by ``cls``'s annotations) are strictly
    coerced; errors name ``section.<field>``. Keys ``cls`` lacks are left for its caller's
    unknown-key check."""
    assert is_dataclass(cls), cls
    scalars = _scalar_fields(cls)
    out = dict(data)
    for name, value in data.items():
        if name not in scalars:
            continue
        kind, optional = scalars[name]
        if value is None:
            if not optional:
                raise ConfigError(f"{section}.{name}", f"must be set (a {kind.__name__}), "
                                                       f"got null")
            continue
        out[name] = _COERCE[kind](value, f"{section}.{name}")
        if kind is not bool:
            check_magnitude(out[name], f"{section}.{name}")
    return out
