"""The ``cluster`` config section: one pool of co-located replicas behind a router
(``conf/cluster/single.yaml``), or a prefill pool and a decode pool joined by a link
(``conf/cluster/disaggregated.yaml``). Pure data, validated with errors naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sim.cluster.link import LinkConfig
from sim.cluster.router import ROUTERS
from sim.config_types import typed_fields
from sim.errors import ConfigError, refuse_unknown, require
from sim.specs import ModelSpec

# The most replicas one pool may have: each is built up front (about a millisecond and tens of
# kilobytes apiece).
MAX_REPLICAS = 2**14


def _check_count(value: int, field: str) -> None:
    require(1 <= value <= MAX_REPLICAS, field, f"must be in [1, {MAX_REPLICAS}], got {value}")


def _check_router(name: str, where: str) -> None:
    require(isinstance(name, str) and name in ROUTERS.names(), where,
            f"unknown router {name!r}; known: {', '.join(ROUTERS.names())}")


@dataclass(frozen=True)
class ClusterConfig:
    """``num_replicas`` identical replicas (each ``tensor_parallel_size x
    pipeline_parallel_size`` GPUs) behind ``router``. The default (one replica) is the plain
    single-replica run."""

    name: str = "single"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_replicas: int = 1
    router: str = "round_robin"

    def __post_init__(self) -> None:
        require(self.tensor_parallel_size >= 1, "cluster.tensor_parallel_size",
                f"must be >= 1, got {self.tensor_parallel_size}")
        require(self.pipeline_parallel_size >= 1, "cluster.pipeline_parallel_size",
                f"must be >= 1, got {self.pipeline_parallel_size}")
        _check_count(self.num_replicas, "cluster.num_replicas")
        _check_router(self.router, "cluster.router")

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, model: ModelSpec) -> None:
        """Refuse a ``tensor_parallel_size`` the model's heads cannot be split over (vLLM's
        rule, ``ModelSpec.check_tensor_parallel``)."""
        model.check_tensor_parallel(self.tensor_parallel_size, "cluster.tensor_parallel_size")


@dataclass(frozen=True)
class PoolConfig:
    """One side of a disaggregated deployment. ``None`` inherits the run's value."""

    hardware: str | None = None  # a conf/hardware/<name>.yaml
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    policy: dict[str, Any] = field(default_factory=dict)  # merged over the run's policy


@dataclass(frozen=True)
class DisaggregatedConfig:
    name: str = "disaggregated"
    num_prefill_replicas: int = 1
    num_decode_replicas: int = 1
    tensor_parallel_size: int = 1  # default for both pools
    pipeline_parallel_size: int = 1
    router: str = "least_outstanding"  # picks the prefill replica at arrival
    decode_router: str = "least_outstanding"  # picks the decode replica after the prefill
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    link: LinkConfig = field(default_factory=LinkConfig)

    def __post_init__(self) -> None:
        for f in ("tensor_parallel_size", "pipeline_parallel_size"):
            require(getattr(self, f) >= 1, f"cluster.{f}", f"must be >= 1, got {getattr(self, f)}")
        for f in ("num_prefill_replicas", "num_decode_replicas"):
            _check_count(getattr(self, f), f"cluster.{f}")
        _check_router(self.router, "cluster.router")
        _check_router(self.decode_router, "cluster.decode_router")
        for side in ("prefill", "decode"):
            pool = getattr(self, side)
            for f in ("tensor_parallel_size", "pipeline_parallel_size"):
                v = getattr(pool, f)
                require(v is None or v >= 1, f"cluster.{side}.{f}", f"must be >= 1, got {v}")

    def tp(self, side: str) -> int:
        v = getattr(self, side).tensor_parallel_size
        return self.tensor_parallel_size if v is None else v

    def pp(self, side: str) -> int:
        v = getattr(self, side).pipeline_parallel_size
        return self.pipeline_parallel_size if v is None else v

    def tp_field(self, side: str) -> str:
        """The config field that sets ``side``'s tensor parallelism: the pool's own, else the
        shared default (what an error about it names)."""
        own = getattr(self, side).tensor_parallel_size is not None
        return f"cluster.{side}.tensor_parallel_size" if own else "cluster.tensor_parallel_size"

    def check_model(self, model: ModelSpec) -> None:
        """Refuse a pool's tensor parallelism that the model's heads cannot be split over,
        naming the field that set it (``tp_field``)."""
        for side in ("prefill", "decode"):
            model.check_tensor_parallel(self.tp(side), self.tp_field(side))


def _pool_from(data: Any, side: str) -> PoolConfig:
    if data is None:
        return PoolConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"cluster.{side}", f"must be a mapping, got {data!r}")
    refuse_unknown(data, set(PoolConfig.__dataclass_fields__), f"cluster.{side}")
    policy = data.get("policy") or {}
    if not isinstance(policy, dict):
        raise ConfigError(f"cluster.{side}.policy", f"must be a mapping, got {policy!r}")
    return PoolConfig(**typed_fields(PoolConfig, {**data, "policy": dict(policy)},
                                     f"cluster.{side}"))


def cluster_config_from(data: dict[str, Any],
                        model: ModelSpec | None = None) -> ClusterConfig | DisaggregatedConfig:
    """Parse the ``cluster`` section. A section without ``name`` is a ``single`` one. With
    ``model``, its tensor parallelism is also checked against the model's heads."""
    cfg = _cluster_config_from(dict(data))
    if model is not None:
        cfg.check_model(model)
    return cfg


def _cluster_config_from(data: dict[str, Any]) -> ClusterConfig | DisaggregatedConfig:
    name = data.get("name", "single")
    if name == "disaggregated":
        refuse_unknown(data, set(DisaggregatedConfig.__dataclass_fields__), "cluster")
        data["prefill"] = _pool_from(data.get("prefill"), "prefill")
        data["decode"] = _pool_from(data.get("decode"), "decode")
        data["link"] = LinkConfig.from_value(data.get("link"))
        return DisaggregatedConfig(**typed_fields(DisaggregatedConfig, data, "cluster"))
    if name != "single":
        raise ConfigError("cluster.name", f"must be 'single' or 'disaggregated', got {name!r}")
    refuse_unknown(data, set(ClusterConfig.__dataclass_fields__), "cluster")
    return ClusterConfig(**typed_fields(ClusterConfig, data, "cluster"))
