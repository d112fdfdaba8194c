"""An independent dense Llama for checking the paged model: contiguous per-request KV, its own
RMSNorm, RoPE (with Llama-3 scaling written out again) and attention through torch's SDPA.
It shares only the weights with ``executors.real``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from executors.real.config import LlamaArgs
from executors.real.weights import LlamaWeights


def _inv_freq(args: LlamaArgs) -> torch.Tensor:
    d = args.head_dim
    base = 1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    s = args.rope_scaling
    if not s:
        return base
    out = []
    for f in base.tolist():
        wavelen = 2 * math.pi / f
        lo_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        hi_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < hi_wl:
            out.append(f)
        elif wavelen > lo_wl:
            out.append(f / s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    ang = (pos.double()[:, None] * inv_freq[None, :]).float()  # [n, D/2]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None, :]
    sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class DenseLlama:
    """fp32 forward of one sequence at a time over contiguous K/V lists."""

    def __init__(self, args: LlamaArgs, weights: LlamaWeights) -> None:
        self.a = args
        self.w = weights
        self.inv_freq = _inv_freq(args)
        self.cache: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def forward(self, rid: int, token_ids: list[int]) -> torch.Tensor:
        """Append ``token_ids`` to sequence ``rid``; logits [n, V] for each of them."""
        a, w = self.a, self.w
        layers = self.cache.setdefault(rid, [(torch.zeros(0, a.num_kv_heads, a.head_dim),) * 2
                                             for _ in range(a.num_layers)])
        start = layers[0][0].shape[0]
        n = len(token_ids)
        pos = torch.arange(start, start + n)
        x = w.embed.float()[torch.tensor(token_ids)]
        for i, lw in enumerate(w.layers):
            h = _rms(x, lw.input_norm.float(), a.rms_norm_eps)
            wq, wk, wv = lw.qkv.float().split([a.q_size, a.kv_size, a.kv_size])
            bq = bk = bv = None
            if lw.qkv_bias is not None:
                bq, bk, bv = lw.qkv_bias.float().split([a.q_size, a.kv_size, a.kv_size])
            q = F.linear(h, wq, bq).view(n, a.num_heads, a.head_dim)
            k = F.linear(h, wk, bk).view(n, a.num_kv_heads, a.head_dim)
            v = F.linear(h, wv, bv).view(n, a.num_kv_heads, a.head_dim)
            q, k = _rope(q, pos, self.inv_freq), _rope(k, pos, self.inv_freq)
            ck, cv = layers[i]
            ck, cv = torch.cat((ck, k)), torch.cat((cv, v))
            layers[i] = (ck, cv)
            total = ck.shape[0]
            allowed = torch.arange(total)[None, :] <= pos[:, None]  # [n, total]
            g = a.group_size
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), ck.repeat_interleave(g, 1).transpose(0, 1),
                cv.repeat_interleave(g, 1).transpose(0, 1), attn_mask=allowed)  # [Hq, n, D]
            x = x + F.linear(o.transpose(0, 1).reshape(n, a.q_size), lw.o_proj.float())
            h = _rms(x, lw.post_norm.float(), a.rms_norm_eps)
            gate, up = F.linear(h, lw.gate_up.float()).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, lw.down.float())
        return F.linear(_rms(x, w.norm.float(), a.rms_norm_eps), w.lm_head.float())
