"""Shared test helpers: compose the real Hydra config, build tiny replicas by hand."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

CONF = Path(__file__).resolve().parent.parent / "conf"
ROOT = CONF.parent
SHARED = ROOT.parent / "shared"
_PARSER = OverridesParser.create()


def compose_named(config_name: str, *overrides: str) -> dict[str, Any]:
    """The config an experiment whose Hydra config is ``conf/<config_name>.yaml`` would see
    for these command-line overrides (a fresh copy each call: callers may change it)."""
    return copy.deepcopy(_composed(config_name, overrides))


@lru_cache(maxsize=256)
def _composed(config_name: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    # Composing takes ~0.1 s (up to 1 s with many groups), most of it reading the YAML of
    # the config groups; the tests compose thousands of configs that differ only in values.
    # Hydra applies group choices (added, changed or deleted) to the defaults list first and
    # value overrides (set, added with +, forced with ++, deleted with ~) to the composed
    # config after, so the composition of the group choices is kept and the values are
    # applied to a copy of it, by Hydra's own override parser and override step. Anything
    # else (hydra.*, packages, nested groups) takes the whole compose.
    groups = tuple(o for o in overrides if _is_group_choice(o))
    values = [o for o in overrides if not _is_group_choice(o)]
    if any(o.lstrip("+~").startswith("hydra") or "@" in o.split("=", 1)[0]
           or "/" in o.split("=", 1)[0] for o in values):
        return _container(_compose_groups(config_name, overrides))
    cfg = copy.deepcopy(_compose_groups(config_name, groups))
    ConfigLoaderImpl._apply_overrides_to_config([_parsed(o) for o in values], cfg)
    return _container(cfg)


@lru_cache(maxsize=4096)
def _parsed(override: str) -> Override:
    """One value override as Hydra's parser reads it (about 1 ms each; the tests repeat the
    same few hundred). Applying an override reads it and never changes it."""
    return _PARSER.parse_overrides([override])[0]


def _is_group_choice(override: str) -> bool:
    key = override.split("=", 1)[0].lstrip("+~")
    return key.isidentifier() and (CONF / key).is_dir()


@lru_cache(maxsize=64)
def _compose_groups(config_name: str, overrides: tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def _container(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("hydra", None)
    return out


def compose_cfg(*overrides: str) -> dict[str, Any]:
    """The config the main job would see for these command-line overrides. ``step_mode``
    is a plain top-level value that nothing interpolates: it is set on the composed config,
    so a fast and an exact run of the same overrides compose once."""
    modes = [o for o in overrides if o.startswith("step_mode=")]
    out = compose_named("config", *(o for o in overrides if not o.startswith("step_mode=")))
    if modes:
        out["step_mode"] = modes[-1].split("=", 1)[1]
    out["progress"] = False
    return out


def small_cfg(*overrides: str) -> dict[str, Any]:
    """A quick run of the default model and hardware on a small workload."""
    return compose_cfg("workload.num_requests=60", "workload.qps=20", *overrides)


def free_queue(pool: Any) -> tuple[range, list[int]]:
    """A KV pool's free queue (``free_blocks()``, front first) as ``(run, rest)``: the queue
    is ``[*run, *rest]``, ``run`` its longest start of the form ``a, a + 1, ..., num_blocks - 1``.
    Two queues of pools of one size are equal exactly when these are (``run`` is a function
    of the queue), and a default pool's millions of never-used blocks stay a range."""
    n, a, rest = pool.num_blocks, pool.fresh, pool.returned_blocks()
    if a == n and rest and rest[:n - rest[0]] == list(range(rest[0], n)):
        a, rest = rest[0], rest[n - rest[0]:]
    return range(a, n), rest


def free_queues(res: Any) -> list[tuple[range, list[int]]] | None:
    """Every replica's GPU free queue at the end of a run (``free_queue``): equal queues in
    two runs mean the same block ids were handed out in the same order. None on the array
    core, which keeps no block ids (its pool cannot bind)."""
    if res.summary["step_engine"] == "array_core":
        return None
    return [free_queue(rep.kv._gpu) for rep in res.replicas]


def assert_approx(actual: Any, expected: Any, rel: float, abs: float, nan_ok: bool = False,
                  what: str | None = None) -> None:
    """``assert actual == pytest.approx(expected, rel=rel, abs=abs, nan_ok=nan_ok), what`` for
    two float arrays, decided by numpy with approx's own test of each element (equal; or the
    expected one finite and within ``max(rel * |expected|, abs)``; or, with ``nan_ok``, both
    nan). pytest.approx compares element by element in Python (a second per run of ~10^5
    steps); it still decides, and reports, wherever numpy finds a difference."""
    a, b = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    if a.shape == b.shape:
        with np.errstate(invalid="ignore"):
            ok = (a == b) | (np.isfinite(b) & (np.abs(b - a) <= np.maximum(rel * np.abs(b), abs)))
            if nan_ok:
                ok |= np.isnan(a) & np.isnan(b)
        if ok.all():
            return
    assert actual == pytest.approx(expected, rel=rel, abs=abs, nan_ok=nan_ok), what
