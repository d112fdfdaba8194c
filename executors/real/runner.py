"""Turns a ``StepPlan`` into tensors, runs the model, and keeps the KV and swap storage.

::

    GPU KV   one tensor per layer  [2, num_gpu_blocks, block_size, Hk, D]   rows = manager's ids
    CPU swap one tensor per layer  [2, num_cpu_blocks, block_size, Hk, D]   rows = CPU pool ids
    offload  one tensor per layer  [2, num_offload_blocks, block_size, Hk, D] rows = tier ids
    tokens   request id -> prompt ids + ids sampled so far (a recompute re-prefills them all)

On a CPU device both live in host memory; swap-out and swap-in are still real copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executors.real.kernels import AttentionMetadata
from executors.real.model import LlamaModel
from executors.real.sampling import Sampler
from sim.plan import StepPlan


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, dtype: torch.dtype,
                 sampler: Sampler) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.sampler = sampler
        self.tokens: dict[int, list[int]] = {}
        self.prompt_lens: dict[int, int] = {}
        self.gpu_cache: list[torch.Tensor] = []
        self.cpu_cache: list[torch.Tensor] = []
        self.offload_cache: list[torch.Tensor] = []
        self.block_size = 0

    # ---- storage --------------------------------------------------------------------------
    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                      num_offload_blocks: int = 0) -> None:
        a = self.model.args
        shape = (2, num_gpu_blocks, block_size, a.num_kv_heads, a.head_dim)
        cpu_shape = (2, num_cpu_blocks, block_size, a.num_kv_heads, a.head_dim)
        on_gpu = self.device.type == "cuda"
        # Host tensors are left uninitialized: untouched pages cost no memory, and no slot is
        # read before it is written (attention masks everything past each sequence's length).
        alloc = torch.zeros if on_gpu else torch.empty
        self.gpu_cache = [alloc(shape, dtype=self.dtype, device=self.device)
                          for _ in range(a.num_layers)]
        # Pinned host memory makes swaps real DMA copies; an empty pool (recompute only, or a
        # profiler's) pins nothing.
        pin = on_gpu and num_cpu_blocks > 0
        self.cpu_cache = [torch.empty(cpu_shape, dtype=self.dtype, pin_memory=pin)
                          for _ in range(a.num_layers)]
        off_shape = (2, num_offload_blocks, block_size, a.num_kv_heads, a.head_dim)
        self.offload_cache = [torch.empty(off_shape, dtype=self.dtype,
                                          pin_memory=on_gpu and num_offload_blocks > 0)
                              for _ in range(a.num_layers)]
        self.block_size = block_size

    def release(self) -> None:
        """Drop the KV and swap storage and every request (``RealExecutor.release``)."""
        self.gpu_cache, self.cpu_cache, self.offload_cache = [], [], []
        self.tokens.clear()
        self.prompt_lens.clear()
        self.block_size = 0

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.gpu_cache)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt_token_ids: Sequence[int] | None) -> None:
        if prompt_token_ids is None or len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id} has no prompt token ids; the real executor "
                             f"needs them (workload.token_ids=true)")
        vocab = self.model.args.vocab_size
        lo, hi = min(prompt_token_ids), max(prompt_token_ids)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"request {request_id}: prompt token id {bad} is outside the "
                             f"vocabulary [0, {vocab}) of model {self.model.args.name}")
        if request_id in self.tokens:
            raise ValueError(f"request {request_id} was added twice")
        self.tokens[request_id] = [int(t) for t in prompt_token_ids]
        self.prompt_lens[request_id] = len(prompt_token_ids)

    def free_request(self, request_id: int) -> None:
        del self.tokens[request_id]
        del self.prompt_lens[request_id]

    def output_token_ids(self, request_id: int) -> list[int]:
        return self.tokens[request_id][self.prompt_lens[request_id]:]

    # ---- one step -------------------------------------------------------------------------
    def swap(self, plan: StepPlan) -> None:
        """Make the plan's block copies, in the order the scheduler made them."""
        ops = plan.swaps
        if not ops and (plan.swap_out or plan.swap_in):  # a hand-made plan: out, then in
            ops = [("out", plan.swap_out), ("in", plan.swap_in)]
        else:
            outs = [p for d, pairs in ops if d == "out" for p in pairs]
            ins = [p for d, pairs in ops if d == "in" for p in pairs]
            if outs != plan.swap_out or ins != plan.swap_in:
                raise ValueError("StepPlan.swaps disagrees with swap_out/swap_in")
        # Consecutive copies in one direction are batched while their destinations differ
        # (an offload tier block may be stored into twice in one step: the later copy wins).
        runs: list[tuple[str, list[tuple[int, int]]]] = []
        dests: set[int] = set()
        for direction, pairs in ops:
            if direction not in ("out", "in", "store", "load"):
                raise ValueError(f"unknown swap direction {direction!r}")
            for pair in pairs:
                if runs and runs[-1][0] == direction and pair[1] not in dests:
                    runs[-1][1].append(pair)
                else:
                    runs.append((direction, [pair]))
                    dests = set()
                dests.add(pair[1])
        for direction, pairs in runs:
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
            # Swaps use the swap pool, the offload tier's stores and loads its own tensors.
            host = self.cpu_cache if direction in ("out", "in") else self.offload_cache
            for gpu, cpu in zip(self.gpu_cache, host):
                if direction in ("out", "store"):  # device -> host
                    cpu[:, dst] = gpu[:, src.to(self.device)].to("cpu")
                else:  # host -> device
                    gpu[:, dst.to(self.device)] = cpu[:, src].to(self.device)

    def step(self, plan: StepPlan) -> list[int]:
        """Swap, run the scheduled rows, sample; returns one id per sampling row, in order."""
        if not self.gpu_cache:
            raise RuntimeError("the KV cache is not allocated (init_kv_cache was not called, "
                               "or the executor was released)")
        self.swap(plan)
        if not plan.scheduled:
            return []
        ids: list[int] = []
        positions: list[int] = []
        rows: list[tuple[int, int, list[int]]] = []
        sample_rows: list[int] = []
        sample_rids: list[int] = []
        out_index: list[int] = []
        for s in plan.scheduled:
            toks = self.tokens.get(s.request_id)
            if toks is None:
                raise ValueError(f"request {s.request_id} is scheduled but was never added")
            start, end = s.start_position, s.start_position + s.num_new_tokens
            if end > len(toks) or (s.sample and end != len(toks)):
                raise ValueError(f"request {s.request_id}: plan row covers tokens "
                                 f"[{start}, {end}) with sample={s.sample}, but the request "
                                 f"has {len(toks)} tokens")
            ids.extend(toks[start:end])
            positions.extend(range(start, end))
            rows.append((start, s.num_new_tokens, s.block_table))
            if s.sample:
                sample_rows.append(len(ids) - 1)
                sample_rids.append(s.request_id)
                out_index.append(len(toks) - self.prompt_lens[s.request_id])
        dev = self.device
        meta = AttentionMetadata.build(rows, self.block_size, dev)
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long).to(dev),
            torch.tensor(positions, dtype=torch.long).to(dev),
            self.gpu_cache, meta, torch.tensor(sample_rows, dtype=torch.long).to(dev))
        sampled = self.sampler(logits, sample_rids, out_index)
        for rid, tok in zip(sample_rids, sampled):
            self.tokens[rid].append(tok)
        return sampled
