"""Helpers for the real-executor tests: build a tiny executor and drive it with hand-made plans
over a real KVBlockManager."""

from __future__ import annotations

import torch

from executors.real import RealExecutor, RealExecutorConfig
from executors.real.kernels import AttentionMetadata
from sim.kv_manager import KVBlockManager
from sim.plan import ScheduledRequest, StepPlan
from sim.specs import load_model_spec


def tiny_executor(num_gpu_blocks: int = 64, num_cpu_blocks: int = 32, block_size: int = 4,
                  seed: int = 0, spec=None, **cfg) -> tuple[RealExecutor, KVBlockManager]:
    spec = spec or load_model_spec("tiny")
    ex = RealExecutor(spec, RealExecutorConfig(device="cpu", warmup=False, **cfg), seed=seed)
    ex.init_kv_cache(num_gpu_blocks, num_cpu_blocks, block_size)
    return ex, KVBlockManager(num_gpu_blocks, block_size, num_cpu_blocks)


def paged_logits(ex: RealExecutor, kv: KVBlockManager,
                 rows: list[tuple[int, list[int], int, int]]) -> list[torch.Tensor]:
    """Run one step of rows (request id, all its token ids, start, new tokens) and return each
    row's logits for every new token ([n, V] per row)."""
    ids, pos, meta_rows = [], [], []
    for rid, toks, start, n in rows:
        assert kv.allocate_slots(rid, start + n) is not None
        ids += toks[start:start + n]
        pos += range(start, start + n)
        meta_rows.append((start, n, kv.block_table(rid)))
    meta = AttentionMetadata.build(meta_rows, kv.block_size)
    logits = ex.model.forward(torch.tensor(ids), torch.tensor(pos), ex.runner.gpu_cache, meta,
                              torch.arange(len(ids)))
    return list(logits.split([n for *_, n in rows]))


def plan_step(ex: RealExecutor, kv: KVBlockManager, rows: list[tuple[int, int]],
              progress: dict[int, int]) -> list[int]:
    """One executor step granting (request id, new tokens) rows; ``progress`` holds each
    request's computed tokens and is advanced. Returns the sampled ids."""
    plan = StepPlan()
    for rid, n in rows:
        start = progress.get(rid, 0)
        assert kv.allocate_slots(rid, start + n) is not None
        total = len(ex.runner.tokens[rid])
        plan.scheduled.append(ScheduledRequest(rid, start, n, kv.block_table(rid),
                                               start + n == total))
        progress[rid] = start + n
    return ex.execute(plan).sampled_token_ids
