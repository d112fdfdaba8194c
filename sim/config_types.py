"""Strict scalar types for config values, with errors that name the field.

Hydra hands over whatever YAML or the command line spelled: ``policy.chunked_prefill=no``
arrives as the string ``"no"`` (YAML 1.1's false is not recognised by Hydra's override
grammar), ``policy.max_num_seqs=2.5`` as a float, ``workload.qps=abc`` as a string. Python's
``bool()``, ``int()`` and ``float()`` would turn these into a truthy flag, a silently
truncated count or a bare ``ValueError`` mid-run; these helpers refuse them up front:

* an int field takes an integer (a float only when it is integral, e.g. ``1e5`` on the
  command line); never a bool, a string, ``2.5`` or a non-finite value;
* a float field takes any finite int or float; never a bool or a string;
* a bool field takes only ``true`` / ``false``.

``typed_fields(cls, data, section)`` applies them to a mapping by the dataclass ``cls``'s
annotations (``int``, ``float``, ``bool``, each optionally ``| None``); fields of other types
pass through unchanged, for the dataclass's own checks.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields, is_dataclass
from functools import cache
from numbers import Integral, Real
from typing import Any

from sim.errors import ConfigError

_SCALARS = (bool, int, float)


def _shown(value: Any) -> str:
    kind = "a string" if isinstance(value, str) else type(value).__name__
    return f"{value!r} ({kind})"


def as_int(value: Any, field: str, minimum: int | None = None) -> int:
    """``value`` as an int: an integer, or an integral finite float. ``minimum``: inclusive."""
    if isinstance(value, Integral) and not isinstance(value, bool):
        out = int(value)
    elif (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
          and float(value).is_integer()):
        out = int(value)
    else:
        raise ConfigError(field, f"must be an integer, got {_shown(value)}")
    if minimum is not None and out < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {out}")
    return out


def as_float(value: Any, field: str) -> float:
    """``value`` as a finite float (ints are accepted)."""
    if isinstance(value, Real) and not isinstance(value, bool):
        out = float(value)
        if math.isfinite(out):
            return out
        raise ConfigError(field, f"must be a finite number, got {out}")
    raise ConfigError(field, f"must be a number, got {_shown(value)}")


def as_bool(value: Any, field: str) -> bool:
    """``value`` as a bool: only ``True`` or ``False`` (no strings, no 0/1)."""
    if isinstance(value, bool):
        return value
    raise ConfigError(field, f"must be true or false, got {_shown(value)}")


_COERCE = {int: as_int, float: as_float, bool: as_bool}


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
    return out
