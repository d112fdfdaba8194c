"""RMSNorm with the residual add fused in (vLLM's ``fused_add_rms_norm``).

::

    x, residual  [num_tokens, hidden]
    residual_out = x + residual            (or x when there is no residual: the first layer)
    out          = residual_out / sqrt(mean(residual_out^2) + eps) * weight   (in fp32)
"""

from __future__ import annotations

import torch

from executors.real.kernels._triton import next_pow2, tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out, residual_out)``."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), x


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,  # row strides; rows are contiguous
    eps,
    N: tl.constexpr,  # hidden size
    BLOCK: tl.constexpr,  # next power of two >= N
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(x.dtype), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), weight.shape
    out = torch.empty_like(x)
    if residual is None:
        res_in = res_out = x  # unused by the kernel; the residual stream is x itself
    else:
        assert residual.shape == x.shape and residual.stride(1) == 1, residual.shape
        assert residual.dtype == x.dtype, (residual.dtype, x.dtype)
        res_in, res_out = residual, torch.empty_like(x)
    if x.shape[0]:
        n = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](
            x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0), out.stride(0),
            res_out.stride(0), eps, N=n, BLOCK=next_pow2(n), HAS_RESIDUAL=residual is not None,
        )
    return out, (x if residual is None else res_out)
