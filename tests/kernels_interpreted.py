"""Each Triton kernel against its torch reference, run by Triton's CPU interpreter.

Not collected by the normal suite: ``TRITON_INTERPRET=1`` must be set before triton is
imported, so ``tests/test_real_kernels.py`` runs this file in a separate pytest process::

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels_interpreted.py

fp32 and fp16 only: the interpreter mishandles bf16 arithmetic (bf16 runs in gpu_check.py).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from executors.real.kernels import TORCH, TRITON, AttentionMetadata  # noqa: E402

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=gen(seed)).to(dtype)


# ---- paged attention ----------------------------------------------------------------------
# (start position, new tokens): decodes, whole prompts, prefill chunks over cached context;
# every context ends mid-block except one, so partial last blocks are everywhere.
RAGGED = [(0, 7), (9, 1), (5, 6), (0, 1), (13, 1), (16, 3), (31, 1)]
DECODES = [(4, 1), (17, 1), (0, 1), (30, 1), (8, 1)]
CHUNKED = [(24, 9), (0, 12), (11, 1)]  # chunk of 9 attending to 24 cached tokens


def attention_case(rows, group, dtype, head_dim=32, block_size=4, kv_heads=2, seed=0):
    need = [-(-(s + n) // block_size) for s, n in rows]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen(seed)).tolist()  # scattered block ids
    tables, i = [], 0
    for k in need:
        tables.append(perm[i:i + k])
        i += k
    meta = AttentionMetadata.build([(s, n, t) for (s, n), t in zip(rows, tables)], block_size)
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=seed + 1)
    q = randn(sum(n for _, n in rows), kv_heads * group, head_dim, dtype=dtype, seed=seed + 2)
    return q, cache, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("rows", [RAGGED, DECODES, CHUNKED], ids=["ragged", "decode", "chunked"])
def test_paged_attention(rows, group, dtype):
    q, cache, meta = attention_case(rows, group, dtype)
    want = TORCH.paged_attention(q, cache, meta)
    got = TRITON.paged_attention(q, cache, meta, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("group,head_dim,block_size", [(3, 24, 16), (5, 16, 8)])
def test_paged_attention_odd_groups_and_head_dims(group, head_dim, block_size):
    q, cache, meta = attention_case(RAGGED, group, torch.float32, head_dim, block_size)
    want = TORCH.paged_attention(q, cache, meta)
    got = TRITON.paged_attention(q, cache, meta, block_n=32)  # default (64-row) tiles
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_paged_attention_reads_q_through_strides():
    q, cache, meta = attention_case(RAGGED, 2, torch.float32)
    qkv = torch.cat([q.flatten(1), randn(q.shape[0], 128, dtype=torch.float32)], dim=1)
    view = qkv[:, :q.shape[1] * q.shape[2]].view_as(q)  # as the model slices qkv
    torch.testing.assert_close(TRITON.paged_attention(view, cache, meta, block_m=16,
                                                      block_n=16),
                               TORCH.paged_attention(q, cache, meta), **TOL[torch.float32])


# ---- KV store, RMSNorm, rotary, SiLU-and-mul -----------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_kv_store(dtype):
    t, hk, d = 6, 2, 32
    qkv = randn(t, (4 + 2 * hk) * d, dtype=dtype)
    kv = qkv[:, 4 * d:].view(t, 2, hk, d)  # strided K and V, as the model passes them
    slots = torch.tensor([3, 17, -1, 0, 31, 8])  # -1: a padding token, skipped
    want = randn(2, 8, 4, hk, d, dtype=dtype, seed=1)
    got = want.clone()
    TORCH.kv_store(kv[:, 0], kv[:, 1], want, slots)
    TRITON.kv_store(kv[:, 0], kv[:, 1], got, slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 80])
def test_rms_norm(dtype, residual, hidden):
    x = randn(5, hidden, dtype=dtype)
    w = randn(hidden, dtype=dtype, seed=1)
    r = randn(5, hidden, dtype=dtype, seed=2) if residual else None
    want_out, want_res = TORCH.rms_norm(x, w, 1e-5, r)
    got_out, got_res = TRITON.rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])
    assert torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_rotary(dtype, head_dim):
    t, hq, hk = 6, 4, 2
    qkv = randn(t, (hq + 2 * hk) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 3, 7, 100, 5, 2])
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = torch.outer(torch.arange(128).float(), inv)
    cos_sin = torch.cat([f.cos(), f.sin()], -1).contiguous()
    want, got = qkv.clone(), qkv.clone()
    for buf, k in ((want, TORCH), (got, TRITON)):
        q = buf[:, :hq * head_dim].view(t, hq, head_dim)
        key = buf[:, hq * head_dim:(hq + hk) * head_dim].view(t, hk, head_dim)
        k.rotary(q, key, positions, cos_sin)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[:, (hq + hk) * head_dim:], qkv[:, (hq + hk) * head_dim:])  # V untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_silu_mul(dtype):
    x = randn(5, 2 * 96, dtype=dtype)
    torch.testing.assert_close(TRITON.silu_mul(x, block=64), TORCH.silu_mul(x), **TOL[dtype])


# ---- the whole model ---------------------------------------------------------------------
def test_model_with_triton_kernels_matches_torch_kernels():
    from sim.specs import load_model_spec
    from tests.real_helpers import paged_logits, tiny_executor

    spec = load_model_spec("tiny", num_layers=1)
    a = [int(x) for x in torch.randint(0, 512, (11,), generator=gen(0))]
    b = [int(x) for x in torch.randint(0, 512, (6,), generator=gen(1))]
    outs = []
    for kernels in ("torch", "triton"):
        ex, kv = tiny_executor(spec=spec, kernels=kernels)
        first = paged_logits(ex, kv, [(0, a, 0, 11), (1, b, 0, 4)])
        second = paged_logits(ex, kv, [(0, a + [7], 11, 1), (1, b, 4, 2)])
        outs.append(torch.cat(first + second))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
