"""KV store: write the step's new K and V rows into their paged cache slots.

::

    key, value   [num_tokens, kv_heads, head_dim]   rows may be strided views of the qkv output
    kv_cache     [2, num_blocks, block_size, kv_heads, head_dim]   one layer; [0] = K, [1] = V
    slot_mapping [num_tokens] int32/64: block_id * block_size + offset in block; -1 = skip
"""

from __future__ import annotations

import torch

from executors.real.kernels._triton import next_pow2, tl, triton


def kv_store_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Torch reference: scatter rows into the flattened slot axis."""
    _check(key, value, kv_cache, slot_mapping)
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])  # [2, slots, Hk, D]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat[0, slots] = key[keep]
    flat[1, slots] = value[keep]


@triton.jit
def _kv_store_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_vt,  # token strides of key and value; a token's row is contiguous
    half_stride,  # elements between cache[0] and cache[1]
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two >= ROW
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # The slot broadcast over the row before the test: Triton 3.9's interpreter refuses a
    # mask made of a block and a scalar condition.
    mask = (offs < ROW) & (offs * 0 + slot >= 0)
    k = tl.load(key_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs, mask=mask)
    dst = cache_ptr + slot * ROW + offs  # the cache is contiguous: a slot is one ROW
    tl.store(dst, k, mask=mask)
    tl.store(dst + half_stride, v, mask=mask)


def kv_store_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    _check(key, value, kv_cache, slot_mapping)
    n, hk, d = key.shape
    if n == 0:
        return
    row = hk * d
    _kv_store_kernel[(n,)](
        key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0), kv_cache.stride(0),
        ROW=row, BLOCK=next_pow2(row),
    )


def _check(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    # The kernel addresses a token's [kv_heads, head_dim] row as one contiguous run.
    assert key.shape == value.shape and key.dim() == 3, (key.shape, value.shape)
    assert key.stride(2) == 1 and key.stride(1) == key.shape[2], key.stride()
    assert value.stride(2) == 1 and value.stride(1) == value.shape[2], value.stride()
    assert kv_cache.is_contiguous() and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3:] == key.shape[1:], (kv_cache.shape, key.shape)
    assert kv_cache.dtype == key.dtype == value.dtype, (kv_cache.dtype, key.dtype)
    assert slot_mapping.shape == (key.shape[0],), slot_mapping.shape
