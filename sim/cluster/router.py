"""Routers: pick the replica that serves a newly arrived request.

A router sees only what a real front-end could know at that instant: each replica's count of
outstanding (accepted, unfinished) requests, which the router itself tracks, the KV usage
the replica reports (its block manager's usage then: the blocks its step in progress
holds), and, for a prefix-aware router, how much of the request's prompt each replica's
prefix cache holds (as llm-d's precise prefix-cache scorer reads KV events) or, for its
approximate variant, what it routed where (as SGLang's router remembers). It never looks at queue contents or the future.

Register a new one with ``@ROUTERS.register("name")``; the class gets the run's seeded
``numpy.random.Generator``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from sim.errors import ConfigError
from sim.prefix_cache import shared_block_hashes
from sim.registry import Registry
from sim.request import Request


class RouteTarget(Protocol):
    """The load signals a router may read from a replica."""

    @property
    def num_outstanding(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    def cached_prefix_tokens(self, req: Request) -> int: ...


ROUTERS: Registry[type[Router]] = Registry("router")


class Router(ABC):
    #: True if ``choose`` reads nothing of the targets but ``num_outstanding`` (and its own
    #: state and generator). A replica's count changes only at its own arrivals and finishes,
    #: so the array core can route on counts alone (a disaggregated deployment's prefill
    #: router, sim/array_disagg.py, and with ``reads_only_load`` below). A subclass states it
    #: itself: what its parent stated, a subclass's own reads may break.
    reads_only_counts: ClassVar[bool] = False
    #: True if ``choose`` reads nothing of the targets but ``num_outstanding`` and
    #: ``kv_usage`` (and its own state and generator): co-located replicas behind it run on
    #: the array core (sim/array_cluster.py), which knows both at every arrival. Stated the
    #: same way; ``reads_only_counts`` implies it.
    reads_only_load: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "reads_only_counts" not in cls.__dict__:
            cls.reads_only_counts = False
        if "reads_only_load" not in cls.__dict__:
            cls.reads_only_load = cls.reads_only_counts

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    @abstractmethod
    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        """Index into ``targets`` of the replica that gets ``req``."""


@ROUTERS.register("round_robin")
class RoundRobin(Router):
    reads_only_counts = True

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__(rng)
        self._next = 0

    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        i = self._next % len(targets)
        self._next = i + 1
        return i


@ROUTERS.register("random")
class RandomRouter(Router):
    reads_only_counts = True

    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        return int(self.rng.integers(len(targets)))


@ROUTERS.register("least_outstanding")
class LeastOutstanding(Router):
    """Fewest unfinished requests; ties go to the lowest index."""

    reads_only_counts = True

    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        return min(range(len(targets)), key=lambda i: targets[i].num_outstanding)


@ROUTERS.register("least_kv")
class LeastKV(Router):
    """Lowest reported KV usage; ties (e.g. several idle replicas) go to fewer outstanding
    requests, then the lowest index. Queued requests hold no KV yet, so this router cannot
    see a backlog that has not been admitted: see docs/cluster.md."""

    reads_only_load = True

    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        return min(range(len(targets)),
                   key=lambda i: (targets[i].kv_usage, targets[i].num_outstanding))


@ROUTERS.register("power_of_two")
class PowerOfTwo(Router):
    """Two distinct replicas drawn at random; the one with fewer outstanding requests wins
    (the first drawn on a tie). Mitzenmacher's "power of two choices"."""

    reads_only_counts = True

    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        n = len(targets)
        if n == 1:
            return 0
        a, b = (int(x) for x in self.rng.choice(n, size=2, replace=False))
        return b if targets[b].num_outstanding < targets[a].num_outstanding else a


@ROUTERS.register("prefix_aware")
class PrefixAware(Router):
    """SGLang's cache-aware router (``sgl-model-gateway``, ``cache_aware`` policy) with exact
    prefix matches. While the load is balanced, the replica whose prefix cache holds the most
    of the prompt gets it if that is more than ``CACHE_THRESHOLD`` of the prompt; otherwise
    the replica with the most free KV (lowest usage). When the outstanding counts are out of
    balance (the busiest has more than ``BALANCE_ABS`` more than the idlest and more than
    ``BALANCE_REL`` times as many), the fewest outstanding wins, cache or not. Ties go to
    fewer outstanding requests, then the lowest index. SGLang's defaults; its router matches
    an approximate tree of the prompts it routed, this one asks each replica's cache
    (``cached_prefix_tokens``) and so sees evictions."""

    CACHE_THRESHOLD = 0.5
    BALANCE_ABS = 32
    BALANCE_REL = 1.0001

    def choose(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        i = self._pick(req, targets)
        self.routed(req, i)
        return i

    def _pick(self, req: Request, targets: Sequence[RouteTarget]) -> int:
        n = len(targets)
        load = [t.num_outstanding for t in targets]
        lo, hi = min(load), max(load)
        if hi - lo > self.BALANCE_ABS and hi > lo * self.BALANCE_REL:
            return min(range(n), key=lambda i: load[i])
        cached = self.matched(req, targets)
        best = min(range(n), key=lambda i: (-cached[i], load[i]))
        if cached[best] > self.CACHE_THRESHOLD * req.prompt_len:
            return best
        return min(range(n), key=lambda i: (targets[i].kv_usage, load[i]))

    def matched(self, req: Request, targets: Sequence[RouteTarget]) -> list[int]:
        """Prompt tokens of ``req`` each target is believed to hold: its cache, exactly."""
        return [t.cached_prefix_tokens(req) for t in targets]

    def routed(self, req: Request, index: int) -> None:
        """``req`` went to target ``index`` (for a router that remembers)."""


@ROUTERS.register("prefix_aware_approx")
class PrefixAwareApprox(PrefixAware):
    """``prefix_aware``'s rule on what SGLang's router knows instead of each cache: per
    replica, the prompts it routed there, kept as chained keys of ``GRANULE``-token pieces of
    their shared content (``sim/prefix_cache.py``) in least-recently-used order and trimmed to
    ``MAX_TOKENS`` per replica (SGLang's router keeps an approximate radix tree of the request
    texts, trimmed to ``max_tree_size``). It never sees a replica evict, nor the answers
    computed there, so it may send a prompt where its prefix is gone."""

    GRANULE = 16
    MAX_TOKENS = 1 << 24

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__(rng)
        self.trees: dict[int, OrderedDict[int, None]] = {}

    def _keys(self, req: Request) -> list[int]:
        if req.prefix is None:
            return []
        return shared_block_hashes(req.prefix, self.GRANULE)[:(req.prompt_len - 1)
                                                             // self.GRANULE]

    def matched(self, req: Request, targets: Sequence[RouteTarget]) -> list[int]:
        keys = self._keys(req)
        out = []
        for i in range(len(targets)):
            tree = self.trees.get(i)
            n = 0
            if tree:
                for key in keys:
                    if key not in tree:
                        break
                    n += 1
            out.append(n * self.GRANULE)
        return out

    def routed(self, req: Request, index: int) -> None:
        tree = self.trees.setdefault(index, OrderedDict())
        for key in reversed(self._keys(req)):  # the prefix last: trimmed last (leaves first)
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) * self.GRANULE > self.MAX_TOKENS:
            tree.popitem(last=False)


# A stream id for the routers' generator that no workload stream uses (workloads spawn
# children 0..3 of SeedSequence(seed)); each router gets its own child of this one.
ROUTER_STREAM = 0x524F55


def router_rng(seed: int, index: int = 0) -> np.random.Generator:
    """The seeded generator of router ``index`` in a run with ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(ROUTER_STREAM, index)))


def make_router(name: str, seed: int, index: int = 0, field: str = "cluster.router") -> Router:
    try:
        cls = ROUTERS.get(str(name))
    except KeyError as e:
        raise ConfigError(field, str(e.args[0])) from None
    return cls(router_rng(seed, index))
