"""Hydra's own refusals (an unknown key or option, bad syntax, a group set to null) as one
``config error:`` line and exit code 2, as every command's own checks end. Each Hydra command
runs its ``main`` inside ``hydra_errors_as_config_errors``."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException

from sim.errors import exit_with, renamed


def null_group_override(overrides: list[str]) -> None:
    """A config group set to null (``engine=null``) is refused naming the group (Hydra itself
    fails on it with a traceback): a group takes one of its options (``engine=none``)."""
    conf = Path(__file__).resolve().parent.parent / "conf"
    for item in overrides:
        key, sep, value = item.partition("=")
        group = conf / key.strip("+~")
        if not (sep and key.strip("+~") and group.is_dir()):
            continue
        # A sweep's list (engine=none,null) names each option.
        for choice in value.split(","):
            if choice.strip().lower() in ("null", "~", ""):
                options = sorted(f.stem for f in group.glob("*.yaml"))
                exit_with(2, f"config error: {group.name}: a config group takes one of its "
                             f"options {options}, got {choice.strip() or 'nothing'!r}")


@contextmanager
def hydra_errors_as_config_errors() -> Iterator[None]:
    """An override Hydra refuses (unknown key or group option, bad syntax) or an interpolation
    it cannot resolve ends the command with one ``config error:`` line and exit code 2, as
    the run's own checks do; with ``HYDRA_FULL_ERROR`` set, Hydra reports as it does."""
    if os.environ.get("HYDRA_FULL_ERROR"):
        yield
        return
    from hydra.errors import HydraException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing and exiting 1
    try:
        null_group_override(sys.argv[1:])
        yield
    except (HydraException, OmegaConfBaseException) as e:
        key = re.search(r"Could not override '([^']+)'", str(e))
        error = renamed(key.group(1)) if key else None
        if error is not None:  # a key renamed to vLLM's name: say which
            exit_with(2, f"config error: {error}")
        text = str(e).split("Config search path:")[0]  # not the search path of a missing option
        why = " ".join(line.strip() for line in text.splitlines() if line.strip())
        cause = e.__cause__
        if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
            why += f" ({str(cause).strip().splitlines()[0]})"
        exit_with(2, f"config error: {why}")
    finally:
        del os.environ["HYDRA_FULL_ERROR"]
