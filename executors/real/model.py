"""The Llama-architecture decoder over a paged KV cache, in one readable file.

One ``forward`` serves every kind of step: the batch is the concatenation of each scheduled
request's new tokens (a decode contributes one, a prefill chunk many), ``positions`` says where
each token sits in its sequence, and the attention metadata says which cache slots to write and
which blocks each sequence reads. Shapes: ``T`` tokens in the step, ``H`` hidden size, ``Hq``
and ``Hk`` query and KV heads of ``D`` dims, ``I`` intermediate size, ``V`` vocabulary.

Matrix products go through torch; RMSNorm, rotary, SiLU-and-mul, the KV store and attention go
through the selected kernel set (Triton on a GPU, the torch references on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executors.real.config import LlamaArgs, rope_cos_sin_cache
from executors.real.kernels import AttentionMetadata, Kernels
from executors.real.weights import LlamaWeights


class LlamaModel:
    def __init__(self, args: LlamaArgs, weights: LlamaWeights, kernels: Kernels,
                 device: torch.device | str) -> None:
        self.args = args
        self.weights = weights
        self.kernels = kernels
        self.cos_sin = rope_cos_sin_cache(args, device)  # [max_position, D] fp32
        self.scale = args.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """Run one step and return fp32 logits ``[len(logits_rows), V]`` for the chosen rows.

        input_ids, positions: [T]; kv_caches: one [2, num_blocks, block_size, Hk, D] per layer.
        """
        a, k, w = self.args, self.kernels, self.weights
        t = input_ids.shape[0]
        eps = a.rms_norm_eps
        h = w.embed[input_ids]  # [T, H]
        residual: torch.Tensor | None = None
        for lw, cache in zip(w.layers, kv_caches):
            x, residual = k.rms_norm(h, lw.input_norm, eps, residual)  # [T, H] each
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # [T, Hq*D + 2*Hk*D]
            q = qkv[:, :a.q_size].view(t, a.num_heads, a.head_dim)  # [T, Hq, D] (strided)
            key = qkv[:, a.q_size:a.q_size + a.kv_size].view(t, a.num_kv_heads, a.head_dim)
            value = qkv[:, a.q_size + a.kv_size:].view(t, a.num_kv_heads, a.head_dim)
            k.rotary(q, key, positions, self.cos_sin)  # in place
            k.kv_store(key, value, cache, meta.slot_mapping)
            o = k.paged_attention(q, cache, meta, self.scale)  # [T, Hq, D]
            h = F.linear(o.view(t, a.q_size), lw.o_proj)  # [T, H]
            x, residual = k.rms_norm(h, lw.post_norm, eps, residual)
            act = k.silu_mul(F.linear(x, lw.gate_up))  # [T, 2I] -> [T, I]
            h = F.linear(act, lw.down)  # [T, H]
        # Only the rows that sample need the final norm and the LM head.
        x, _ = k.rms_norm(h[logits_rows], w.norm, eps, residual[logits_rows])  # [S, H]
        return F.linear(x, w.lm_head).float()  # [S, V]
