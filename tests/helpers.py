"""Shared test helpers: compose the real Hydra config, build tiny replicas by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parent.parent / "conf"
ROOT = CONF.parent
SHARED = ROOT.parent / "shared"


def compose_named(config_name: str, *overrides: str) -> dict[str, Any]:
    """The config an experiment whose Hydra config is ``conf/<config_name>.yaml`` would see
    for these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("hydra", None)
    return out


def compose_cfg(*overrides: str) -> dict[str, Any]:
    """The config the main job would see for these command-line overrides."""
    out = compose_named("config", *overrides)
    out["progress"] = False
    return out


def small_cfg(*overrides: str) -> dict[str, Any]:
    """A quick run of the default model and hardware on a small workload."""
    return compose_cfg("workload.num_requests=60", "workload.qps=20", *overrides)
