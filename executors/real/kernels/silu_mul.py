"""SiLU-and-multiply, the SwiGLU activation over the fused gate/up projection.

::

    x   [num_tokens, 2 * intermediate]   gate = x[:, :I], up = x[:, I:]
    out [num_tokens, intermediate]       silu(gate) * up, computed in fp32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executors.real.kernels._triton import tl, triton


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_o,  # row strides
    N: tl.constexpr,  # intermediate size
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    y = gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(g.dtype), mask=mask)


def silu_mul_triton(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, (x.shape, x.stride())
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), N=n, BLOCK=block)
    return out
