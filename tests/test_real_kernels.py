"""Triton kernels: against their torch references under the interpreter (in a subprocess, since
TRITON_INTERPRET must be set before triton is imported), and compiled ahead of time for real
GPUs (sm_90, sm_80) to catch what the interpreter accepts but the GPU compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("torch")
triton = pytest.importorskip("triton")


@pytest.mark.slow
def test_triton_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # -n 0: one process (pyproject's addopts would start a pytest-xdist worker per core, each
    # importing torch and triton, for the one file a worker runs whole).
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-W",
         "ignore::DeprecationWarning", "tests/kernels_interpreted.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout, p.stdout[-2000:]


def _kernel_specs(dt: str, decode: bool = False):
    """(name, jit function, signature, constexprs) of every kernel at Llama-3-8B shapes, as
    the wrappers launch them (``dt``: the activation dtype)."""
    from executors.real.kernels.kv_store import _kv_store_kernel
    from executors.real.kernels.paged_attention import _paged_attention_kernel
    from executors.real.kernels.rms_norm import _rms_norm_kernel
    from executors.real.kernels.rotary import _rotary_kernel
    from executors.real.kernels.silu_mul import _silu_mul_kernel

    p = "*" + dt
    attn_sig = {"q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "out_ptr": p,
                "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "seq_lens_ptr": "*i32", "scale_log2": "fp32"}
    attn_sig.update({s: "i32" for s in ("stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                         "stride_cb", "stride_cs", "stride_ch", "stride_bt")})
    block_m = 16 if decode else 64
    attn_const = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=block_m,
                      TOKENS_PER_TILE=block_m // 4, BLOCK_N=64,
                      DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
    return [
        ("paged_attention", _paged_attention_kernel, attn_sig, attn_const),
        ("kv_store", _kv_store_kernel,
         {"key_ptr": p, "value_ptr": p, "cache_ptr": p, "slot_ptr": "*i64", "stride_kt": "i32",
          "stride_vt": "i32", "half_stride": "i64"}, dict(ROW=1024, BLOCK=1024)),
        ("rms_norm", _rms_norm_kernel,
         {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p, "res_out_ptr": p,
          "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32",
          "eps": "fp32"}, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True)),
        ("rotary", _rotary_kernel,
         {"x_ptr": p, "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "stride_t": "i32",
          "stride_h": "i32"}, dict(HALF=64, BLOCK=64)),
        ("silu_mul", _silu_mul_kernel,
         {"x_ptr": p, "out_ptr": p, "stride_x": "i32", "stride_o": "i32"},
         dict(N=14336, BLOCK=1024)),
    ]


CASES = [(cap, "bf16", False) for cap in (90, 80)] + [(90, "fp32", True), (80, "fp16", True)]


@pytest.mark.parametrize("cap,dt,decode", CASES,
                         ids=[f"sm{c}-{d}{'-decode' if dec else ''}" for c, d, dec in CASES])
def test_kernels_compile_ahead_of_time_for_cuda(cap, dt, decode):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", cap, 32)
    specs = _kernel_specs(dt, decode)
    if dt != "bf16":  # the other dtypes only change the attention kernel's dot path
        specs = specs[:1]
    for name, fn, sig, consts in specs:
        signature = {**sig, **{k: "constexpr" for k in consts}}
        assert set(signature) == set(fn.arg_names), (name, set(fn.arg_names) ^ set(signature))
        compiled = triton.compile(ASTSource(fn, signature, consts), target=target)
        assert compiled.asm.get("cubin"), f"{name}: no cubin for sm_{cap}"
