"""Errors raised for bad input, naming the field (and file/line where there is one)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. The message starts with the dotted field name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message  # without the field, for callers that re-raise it with context
        super().__init__(f"{field}: {message}")


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
    "option for the cost model") and the known names."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}",
                          f"unknown {what}; known: {', '.join(sorted(names))}")
