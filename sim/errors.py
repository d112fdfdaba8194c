"""Errors raised for bad input, naming the field (and file/line where there is one)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. The message starts with the dotted field name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message  # without the field, for callers that re-raise it with context
        super().__init__(f"{field}: {message}")


#: Config keys renamed to vLLM's engine-argument names: the old name is refused with a
#: message naming the new one (``renamed``).
RENAMED_KEYS: dict[str, str] = {
    "kv.num_gpu_blocks": "kv.num_gpu_blocks_override",
    "kv.swap_space_gib": "kv.swap_space",
    "kv.cpu_offload_gib": "kv.kv_offloading_size",
    "model.kv_dtype": "model.kv_cache_dtype",
    "cluster.tensor_parallel": "cluster.tensor_parallel_size",
    "cluster.pipeline_parallel": "cluster.pipeline_parallel_size",
    "cluster.prefill.tensor_parallel": "cluster.prefill.tensor_parallel_size",
    "cluster.prefill.pipeline_parallel": "cluster.prefill.pipeline_parallel_size",
    "cluster.decode.tensor_parallel": "cluster.decode.tensor_parallel_size",
    "cluster.decode.pipeline_parallel": "cluster.decode.pipeline_parallel_size",
    "policy.chunked_prefill": "policy.enable_chunked_prefill",
    "cluster.prefill.policy.chunked_prefill": "cluster.prefill.policy.enable_chunked_prefill",
    "cluster.decode.policy.chunked_prefill": "cluster.decode.policy.enable_chunked_prefill",
}


def renamed(field: str) -> ConfigError | None:
    """The error for a key that was renamed to vLLM's name (``RENAMED_KEYS``), or None."""
    new = RENAMED_KEYS.get(field)
    return None if new is None else ConfigError(field, f"renamed to {new} (vLLM's name)")


@contextmanager
def exit_on_config_error() -> Iterator[None]:
    """A command's body: a ``ConfigError`` inside it ends the process with one
    ``config error: <field>: <why>`` line on stderr and exit code 2, not a traceback."""
    try:
        yield
    except ConfigError as e:
        exit_with(2, f"config error: {e}")


def exit_with(code: int, message: str) -> None:
    """End the command: ``message`` as one line on stderr, exit ``code``. The ``SystemExit``
    carries the line (``.message``) for a caller that goes on (a sweep's other jobs)."""
    print(message, file=sys.stderr)
    exc = SystemExit(code)
    exc.message = message  # type: ignore[attr-defined]
    raise exc from None


class RunInterrupted(Exception):
    """A signal (SIGINT, SIGTERM) asked the run to stop: what it wrote so far is kept, with a
    summary marked ``"status": "interrupted"``."""

    def __init__(self, signum: int) -> None:
        # The number is the only argument: simpy re-raises a process's exception as
        # ``type(e)(*e.args)``.
        self.signum = int(signum)
        super().__init__(self.signum)

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


def require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


def apply_cli_overrides(argv: Sequence[str], cfg: dict[str, str], known: str) -> bool:
    """Apply ``key=value`` command-line arguments to ``cfg`` (its keys only). On any other
    argument print a config error naming it and ``known``, and return False (exit 2)."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in cfg:
            print(f"config error: unknown override {arg!r}; known: {known}", file=sys.stderr)
            return False
        cfg[key] = value
    return True


def require_known_fields(data: Mapping[str, Any], cls: type, section: str, what: str) -> None:
    """Refuse a key of ``data`` that is not a field of the dataclass ``cls`` (nothing is
    silently ignored): the error names ``section.<key>``, the kind of key (``what``, e.g.
    "option for the cost model") and the known names; a key renamed to vLLM's name is
    refused naming that name (``RENAMED_KEYS``)."""
    refuse_unknown(data, {f.name for f in fields(cls)}, section, what)


def refuse_unknown(data: Mapping[str, Any], known: Iterable[str], section: str,
                   what: str = "option") -> None:
    """``require_known_fields`` for a set of known names."""
    names = set(known)
    unknown = sorted(set(data) - names)
    for key in unknown:
        error = renamed(f"{section}.{key}")
        if error is not None:
            raise error
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}",
                          f"unknown {what}; known: {', '.join(sorted(names))}")
