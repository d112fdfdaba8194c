"""Rotary position embedding, in place, "rotate half" (GPT-NeoX / Hugging Face Llama) layout.

::

    q [num_tokens, num_heads, head_dim], k [num_tokens, kv_heads, head_dim]  (strided views ok)
    positions     [num_tokens] int
    cos_sin_cache [max_positions, head_dim] fp32: cos in the first half, sin in the second
    x1, x2 = x[..., :D/2], x[..., D/2:]
    out    = [x1 cos - x2 sin, x2 cos + x1 sin]
"""

from __future__ import annotations

import torch

from executors.real.kernels._triton import next_pow2, tl, triton


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates ``q`` and ``k`` in place and returns them."""
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return q, k


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_sin_ptr,
    stride_t, stride_h,  # x [T, H, D]; the head dim is contiguous
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK: tl.constexpr,  # next power of two >= HALF
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + i, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + i, mask=mask, other=0.0)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + i, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF + i, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert cos_sin_cache.is_contiguous() and cos_sin_cache.dtype == torch.float32
    half = q.shape[2] // 2
    assert cos_sin_cache.shape[1] == 2 * half and k.shape[2] == 2 * half
    assert positions.shape == (q.shape[0],) == (k.shape[0],)
    if q.shape[0] == 0:
        return q, k
    for x in (q, k):
        assert x.stride(2) == 1, x.stride()
        _rotary_kernel[(x.shape[0], x.shape[1])](
            x, positions, cos_sin_cache, x.stride(0), x.stride(1), HALF=half,
            BLOCK=next_pow2(half),
        )
    return q, k
