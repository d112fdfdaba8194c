"""Measure an executor over a grid of step shapes and write a profile CSV.

    python -m experiments.profile executor=real model=tiny          # the real executor (CPU)
    python -m experiments.profile profile.repeats=10 profile.decode_batch_sizes=[1,8,32]
    python -m experiments.calibrate profile_csv=outputs/profile/.../profile.csv

Shapes (``conf/profile.yaml``): decode batches (batch size x context length), prefill chunks
(chunk size x tokens already cached) and mixed steps (decode rows plus one prefill chunk). Each
shape is run ``warmup`` times unmeasured, then ``repeats`` times; the CSV (columns
``executors.calibration.PROFILE_COLUMNS``, documented in docs/calibration.md) holds the median and spread
of the executor's reported step durations (the real executor's are measured wall times).

Plans are real: every run registers fresh requests with the executor (seeded prompt token ids
covering the cached context) over KV blocks from a ``KVBlockManager`` sized for the largest
shape, and frees them afterwards, so a stateful executor sees well-formed steps. The pool is
written once before measuring (``profile.prime``), and the runs of one visit to a shape share
its blocks, so measured steps read written, warm KV as in a serving run.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

import executors
from executors.base import Executor
from executors.calibration import PROFILE_COLUMNS, ShapeSpec
from executors.step_terms import ATTENTION_TILE
from sim.errors import ConfigError, exit_on_config_error, require, require_known_fields
from sim.kv_manager import KVBlockManager, blocks_for
from sim.memory import check_block_size
from sim.specs import ModelSpec, hardware_spec_from, model_spec_from

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileGrid:
    decode_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (16, 128, 512, 1024)
    prefill_chunks: tuple[int, ...] = (8, 32, 128, 512)
    prefill_cached: tuple[int, ...] = (0, 128, 512)
    prefill_batch_sizes: tuple[int, ...] = (1,)  # prefill rows per step (whole prompts batched)
    mixed_decode_batch_sizes: tuple[int, ...] = (4, 16)
    mixed_decode_contexts: tuple[int, ...] = (256,)
    mixed_prefill_chunks: tuple[int, ...] = (32, 256)
    mixed_prefill_cached: tuple[int, ...] = (0,)
    warmup: int = 2
    repeats: int = 5
    prime: bool = True  # write the whole KV pool once before measuring (Profiler.prime)
    order: str = "rounds"  # rounds: every shape once per round, shuffled; grouped: back to back
    out: str = "profile.csv"  # relative: inside the run's output folder

    def __post_init__(self) -> None:
        require(self.warmup >= 0, "profile.warmup", f"must be >= 0, got {self.warmup}")
        require(self.repeats >= 1, "profile.repeats", f"must be >= 1, got {self.repeats}")
        require(self.order in ("rounds", "grouped"), "profile.order",
                f"must be rounds or grouped, got {self.order!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                bad = [x for x in v if int(x) < (0 if "cached" in f.name else 1)]
                require(not bad, f"profile.{f.name}", f"bad value {bad[:1]}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileGrid:
        require_known_fields(data, cls, "profile", "option")
        return cls(**{k: tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else v
                      for k, v in data.items()})

    def shapes(self, max_model_len: int) -> list[ShapeSpec]:
        """Every shape of the grid that fits ``max_model_len``, decode then prefill then mixed."""
        out = [ShapeSpec("decode", num_decode_seqs=b, decode_context=c)
               for b, c in itertools.product(self.decode_batch_sizes, self.decode_contexts)]
        out += [ShapeSpec("prefill", num_prefill_seqs=b, prefill_chunk=n, prefill_cached=k)
                for b, n, k in itertools.product(self.prefill_batch_sizes, self.prefill_chunks,
                                                 self.prefill_cached)]
        out += [ShapeSpec("mixed", num_prefill_seqs=1, prefill_chunk=n, prefill_cached=k,
                          num_decode_seqs=b, decode_context=c)
                for b, c, n, k in itertools.product(
                    self.mixed_decode_batch_sizes, self.mixed_decode_contexts,
                    self.mixed_prefill_chunks, self.mixed_prefill_cached)]
        return [s for s in out if max(s.tokens_per_row()) <= max_model_len]


def blocks_needed(shapes: Iterable[ShapeSpec], block_size: int) -> int:
    """GPU blocks the largest shape holds at once."""
    return max(sum(blocks_for(t, block_size) for t in s.tokens_per_row()) for s in shapes)


class Profiler:
    """Runs shapes through any ``Executor`` with real block tables."""

    def __init__(self, executor: Executor, model: ModelSpec, block_size: int,
                 num_gpu_blocks: int, seed: int = 0) -> None:
        self.executor = executor
        self.model = model
        self.kv = KVBlockManager(num_gpu_blocks, block_size)
        executor.init_kv_cache(num_gpu_blocks, 0, block_size)
        self._rng = np.random.default_rng(seed)
        # Prompts are prefixes of one seeded id sequence: generating ids per run would churn
        # the caches between measured steps.
        self._token_ids = self._rng.integers(0, model.vocab_size, model.max_model_len).tolist()
        self._next_id = 0

    def prime(self, chunk: int = 512) -> int:
        """Write every block of the pool once with prefill steps, then free them; returns the
        steps run. A measured shape reads "cached" context that it never computed: without
        this the executor would read never-written KV storage (fresh pages that fault on first
        touch, or stale bytes that may be denormal or NaN floats), which a serving run never
        does, and which made the tiny model's CPU decode steps ~30% slower than the same steps
        in a run (docs/calibration.md, "CPU validation")."""
        chunk = max(1, min(chunk, self.model.max_model_len, self.kv.num_gpu_blocks
                           * self.kv.block_size))
        steps = 0
        ids: list[int] = []
        while self.kv.num_free_blocks * self.kv.block_size >= chunk:
            rid = self._next_id
            self._next_id += 1
            self.executor.add_request(rid, self._token_ids[:chunk])
            ids.append(rid)
            if self.kv.allocate_slots(rid, chunk) is None:
                break
            plan = ShapeSpec("prefill", 1, chunk, 0).plan([self.kv.block_table(rid)], [rid])
            self.executor.execute(plan)
            steps += 1
        for rid in ids:
            self.executor.free_request(rid)
            self.kv.free(rid)
        return steps

    def allocate(self, shape: ShapeSpec) -> list[list[int]]:
        """Block tables for the rows of one shape, held until ``release``. The runs of one
        visit share them, so a measured step reads the KV its warm-ups just touched, as a
        decode reads the blocks its previous step read (fresh blocks from the pool's FIFO free
        queue would be cold in every cache)."""
        tables = []
        for i, tokens in enumerate(shape.tokens_per_row()):
            key = ("rows", i)
            if self.kv.allocate_slots(key, tokens) is None:
                self.release(shape)
                raise RuntimeError(f"KV pool of {self.kv.num_gpu_blocks} blocks cannot hold "
                                   f"shape {shape}")
            tables.append(list(self.kv.block_table(key)))
        return tables

    def release(self, shape: ShapeSpec) -> None:
        for i in range(shape.batch_size):
            self.kv.free(("rows", i))

    def run_once(self, shape: ShapeSpec, tables: Sequence[list[int]] | None = None) -> float:
        """One step of this shape on fresh requests (over ``tables``, or blocks allocated for
        this run only); the executor's reported seconds."""
        if tables is None:
            tables = self.allocate(shape)
            try:
                return self.run_once(shape, tables)
            finally:
                self.release(shape)
        ids = list(range(self._next_id, self._next_id + shape.batch_size))
        self._next_id += shape.batch_size
        for rid, tokens in zip(ids, shape.tokens_per_row()):
            self.executor.add_request(rid, self._token_ids[:tokens])
        try:
            return float(self.executor.execute(shape.plan(tables, ids)).duration)
        finally:
            for rid in ids:
                self.executor.free_request(rid)

    def visit(self, shape: ShapeSpec, warmup: int, repeats: int) -> list[float]:
        """``warmup`` unmeasured then ``repeats`` measured runs of one shape, back to back,
        over the same blocks; the measured seconds."""
        tables = self.allocate(shape)
        try:
            for _ in range(warmup):
                self.run_once(shape, tables)
            return [self.run_once(shape, tables) for _ in range(repeats)]
        finally:
            self.release(shape)

    def measure(self, shape: ShapeSpec, warmup: int, repeats: int) -> dict[str, Any]:
        """A profile row's timing columns from one visit of ``warmup + repeats`` runs."""
        return timing_row(shape, warmup, self.visit(shape, warmup, repeats))


def timing_row(shape: ShapeSpec, warmup: int, times: Sequence[float]) -> dict[str, Any]:
    """A profile row's shape and timing columns from one shape's measured seconds."""
    t = np.asarray(times, dtype=float)
    return {**shape.as_row(), "warmup": warmup, "repeats": len(t),
            "median_s": float(np.median(t)), "mean_s": float(t.mean()),
            "std_s": float(t.std(ddof=1)) if len(t) > 1 else 0.0,
            "p10_s": float(np.percentile(t, 10)), "p90_s": float(np.percentile(t, 90)),
            "min_s": float(t.min())}


def profile_executor(executor: Executor, model: ModelSpec, grid: ProfileGrid, block_size: int,
                     meta: dict[str, Any], seed: int = 0,
                     after_round: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Measure every shape of ``grid``; rows in ``PROFILE_COLUMNS`` order.

    ``grid.order="rounds"`` (the default) measures in rounds, each visiting every shape once
    in a fresh seeded order, ``warmup`` unmeasured runs right before its measured one: a burst
    of load from other processes then lands on one repeat of many shapes (which the median
    discards) instead of on every repeat of the few shapes measured during it, and every
    measured step follows steps like itself, as in a serving run (a small step right after a
    large one runs with cold caches: ~30% slower for the tiny model on a CPU). ``"grouped"``
    runs each shape's warm-ups then its repeats back to back.

    ``after_round(r)`` (rounds only) is called after round r = 1..repeats: other measurements
    interleaved with the rounds sample the same states of a shared host as the profile
    (``experiments/validate.py`` runs the real executor's serving runs there).
    """
    shapes = grid.shapes(model.max_model_len)
    require(bool(shapes), "profile", "no shape of the grid fits model.max_model_len")
    prof = Profiler(executor, model, block_size, blocks_needed(shapes, block_size), seed)
    if grid.prime:
        log.info("primed the KV pool in %d prefill steps", prof.prime())
    if grid.order == "grouped":
        timings = [prof.measure(shape, grid.warmup, grid.repeats) for shape in shapes]
    else:
        times: list[list[float]] = [[] for _ in shapes]
        rng = np.random.default_rng(seed)
        for r in range(grid.repeats):
            for i in rng.permutation(len(shapes)):
                times[i] += prof.visit(shapes[i], grid.warmup, 1)
            log.info("round %d/%d", r + 1, grid.repeats)
            if after_round is not None:
                after_round(r + 1)
        timings = [timing_row(s, grid.warmup, t) for s, t in zip(shapes, times)]
    rows = []
    for i, (shape, timing) in enumerate(zip(shapes, timings)):
        row = {**timing, **meta}
        rows.append({c: row[c] for c in PROFILE_COLUMNS})
        log.info("%d/%d %s: %.3g s", i + 1, len(shapes), shape, row["median_s"])
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(rows), columns=list(PROFILE_COLUMNS)).to_csv(path, index=False)
    return path


def build_executor(cfg: dict[str, Any]) -> tuple[Executor, ModelSpec, dict[str, Any]]:
    """The executor the composed config selects (as the main job builds it), the model, and
    the CSV's metadata columns."""
    model = model_spec_from(dict(cfg["model"]), "model config")
    hardware = hardware_spec_from(dict(cfg["hardware"]), "hardware config")
    ex = dict(cfg["executor"])
    tp = int(cfg.get("cluster", {}).get("tensor_parallel_size", 1))
    try:
        factory = executors.EXECUTORS.get(str(ex.get("name")))
    except KeyError as e:
        raise ConfigError("executor.name", str(e.args[0])) from None
    block_size = int(cfg["kv"]["block_size"])
    check_block_size(block_size)
    executor = factory(model=model, hardware=hardware, tensor_parallel=tp, config=ex,
                       block_size=block_size, seed=int(cfg.get("seed", 0)))
    # What the executor really runs on and with (not the config's request: device null or
    # dtype auto resolve in the executor): the device's name (cpu, the GPU's name, or the
    # priced hardware for a cost model), its KV/activation dtype, and the query tile its
    # prefill attention is priced in, which calibrate uses to fit the rows.
    meta = {"model": model.name, "device": executor.device_spec(hardware).name,
            "dtype": executor.kv_cache_dtype() or model.weight_dtype, "tensor_parallel": tp,
            "executor": str(ex.get("name")),
            "attention_tile": int(getattr(executor, "attention_tile", ATTENTION_TILE))}
    return executor, model, meta


def run(cfg: dict[str, Any], out_dir: Path) -> Path:
    grid = ProfileGrid.from_dict(dict(cfg.get("profile") or {}))
    executor, model, meta = build_executor(cfg)
    rows = profile_executor(executor, model, grid, int(cfg["kv"]["block_size"]), meta,
                            int(cfg.get("seed", 0)))
    out = Path(grid.out)
    return write_csv(rows, out if out.is_absolute() else out_dir / out)


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(version_base="1.3", config_path="../conf", config_name="profile")
    def _main(cfg: DictConfig) -> None:
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        with exit_on_config_error():
            path = run(OmegaConf.to_container(cfg, resolve=True), out_dir)
        print(f"profile: {path}")

    _main()


if __name__ == "__main__":
    from experiments.hydra_errors import hydra_errors_as_config_errors

    with hydra_errors_as_config_errors():
        main()
