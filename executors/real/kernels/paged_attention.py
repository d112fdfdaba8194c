"""Paged attention over one unified varlen batch.

Every scheduled request is one row group: ``q_len`` query tokens at absolute positions
``seq_len - q_len .. seq_len - 1`` that attend causally to the first ``seq_len`` tokens of their
paged KV (the step's new K/V were stored first). A decode is ``q_len == 1``; a prefill chunk,
a recompute or a whole prompt is ``q_len > 1`` with or without cached context. So chunked
prefill, mixed batches and recompute need no separate path.

::

    q            [num_tokens, num_heads, head_dim]          (a strided view of the qkv output)
    kv_cache     [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables [num_seqs, max_blocks] int32, padded (pads are never read: masked by seq_len)
    query_start_loc [num_seqs + 1] int32; seq_lens [num_seqs] int32
    out          [num_tokens, num_heads, head_dim]

The Triton kernel runs one program per (sequence, KV head, tile of query tokens). A tile's
rows are (token, head-in-group) pairs of one KV head, so grouped-query attention with any group
size reads each K/V block once per group, and an online softmax walks the context in
``BLOCK_N``-token pieces gathered through the block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executors.real.kernels._triton import next_pow2, tl, triton


@dataclass
class AttentionMetadata:
    """Where each row's tokens go and what they attend to (built by the runner on the host).

    The device tensors drive the kernels; the host lists let the torch reference loop without
    synchronizing with the device.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    block_tables_host: list[list[int]]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @staticmethod
    def build(rows: list[tuple[int, int, list[int]]], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """``rows``: (start position, new tokens, block table) per sequence, in batch order."""
        qsl = [0]
        seq_lens: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for start, n, table in rows:
            end = start + n
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(table[:-(-end // block_size)])
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
            block_tables=torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width)
            .to(device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
            query_start_loc_host=qsl, seq_lens_host=seq_lens, block_tables_host=tables,
            max_query_len=max((n for _, n, _ in rows), default=0),
            max_seq_len=max(seq_lens, default=0),
        )


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float | None = None) -> torch.Tensor:
    """Torch reference: gather each sequence's context and run causal softmax attention."""
    t, hq, d = q.shape
    _, _, block_size, hk, _ = kv_cache.shape
    group = hq // hk
    scale = d**-0.5 if scale is None else scale
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    for i, table in enumerate(meta.block_tables_host):
        qs, qe, ctx = qsl[i], qsl[i + 1], lens[i]
        n = qe - qs
        if n == 0:
            continue
        idx = torch.tensor(table, dtype=torch.long, device=q.device)
        k = kv_cache[0, idx].reshape(-1, hk, d)[:ctx].float()  # [ctx, Hk, D]
        v = kv_cache[1, idx].reshape(-1, hk, d)[:ctx].float()
        qi = q[qs:qe].float().view(n, hk, group, d)  # [n, Hk, G, D]
        s = torch.einsum("nkgd,lkd->kgnl", qi, k) * scale  # [Hk, G, n, ctx]
        if n > 1:  # query j sits at position ctx - n + j and sees keys 0 .. ctx - n + j
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            masked = torch.arange(ctx, device=q.device)[None, :] > qpos[:, None]  # [n, ctx]
            s = s.masked_fill(masked, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("kgnl,lkd->nkgd", p, v)
        out[qs:qe] = o.reshape(n, hq, d).to(q.dtype)
    return out


# The block table's row stride is its width, which changes from step to step: specialized (on
# == 1 and on divisibility by 16, as Triton does for integers), every new kind of width would
# compile another variant in the middle of a timed step, seconds inside a serving run.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2,  # softmax scale x log2(e): the kernel works in base 2
    stride_qt, stride_qh,  # q [T, Hq, D], head dim contiguous
    stride_ot, stride_oh,  # out [T, Hq, D]
    stride_cb, stride_cs, stride_ch,  # K and V caches [num_blocks, block_size, Hk, D]
    stride_bt,  # block table row stride
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_M: tl.constexpr,  # rows per program: (token, head-in-group) pairs
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,  # context tokens per inner iteration
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else "tf32" (ignored)
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_start = tile * TOKENS_PER_TILE
    if tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_start = seq_len - q_len  # tokens cached before this step

        rows = tl.arange(0, BLOCK_M)
        tok = tile_start + rows // GROUP  # query token within the sequence
        head = kvh * GROUP + rows % GROUP
        row_ok = (tok < q_len) & (rows < TOKENS_PER_TILE * GROUP)
        q_pos = ctx_start + tok  # absolute position of each row's token
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM

        q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # The tile's last token sees keys up to its own position.
        kv_end = ctx_start + tl.minimum(tile_start + TOKENS_PER_TILE, q_len)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for n0 in range(0, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
            n_ok = n < kv_end
            blk = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            kv_off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
            see = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptr + o_off + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def attention_tiles(group: int, max_query_len: int, block_m: int | None = None) -> tuple[int, int]:
    """(BLOCK_M, TOKENS_PER_TILE): decode batches use the smallest tile that holds a group."""
    if block_m is None:
        block_m = 16 if max_query_len <= 1 else 64
    block_m = max(block_m, next_pow2(group), 16)  # tl.dot needs >= 16 rows
    return block_m, block_m // group


def paged_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float | None = None, block_m: int | None = None,
                           block_n: int = 64) -> torch.Tensor:
    t, hq, d = q.shape
    _, _, block_size, hk, dk = kv_cache.shape
    assert dk == d and hq % hk == 0, (q.shape, kv_cache.shape)
    assert q.stride(2) == 1 and kv_cache.is_contiguous() and q.dtype == kv_cache.dtype
    group = hq // hk
    scale = d**-0.5 if scale is None else scale
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    bm, tokens_per_tile = attention_tiles(group, meta.max_query_len, block_m)
    grid = (meta.num_seqs, hk, triton.cdiv(meta.max_query_len, tokens_per_tile))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_SIZE=block_size,
        BLOCK_M=bm, TOKENS_PER_TILE=tokens_per_tile, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
