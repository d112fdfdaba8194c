"""The model's custom kernels, each a Triton kernel beside its torch reference.

``get_kernels("triton")`` or ``get_kernels("torch")`` returns one namespace with the same
five functions, so the model is written once against either set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from executors.real.kernels.kv_store import kv_store_ref, kv_store_triton
from executors.real.kernels.paged_attention import (
    AttentionMetadata,
    paged_attention_ref,
    paged_attention_triton,
)
from executors.real.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from executors.real.kernels.rotary import rotary_ref, rotary_triton
from executors.real.kernels.silu_mul import silu_mul_ref, silu_mul_triton


@dataclass(frozen=True)
class Kernels:
    name: str
    kv_store: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary: Callable
    silu_mul: Callable


TORCH = Kernels("torch", kv_store_ref, paged_attention_ref, rms_norm_ref, rotary_ref, silu_mul_ref)
TRITON = Kernels("triton", kv_store_triton, paged_attention_triton, rms_norm_triton,
                 rotary_triton, silu_mul_triton)
KERNEL_SETS = {"torch": TORCH, "triton": TRITON}


def get_kernels(name: str) -> Kernels:
    return KERNEL_SETS[name]


__all__ = ["AttentionMetadata", "Kernels", "get_kernels", "KERNEL_SETS", "TORCH", "TRITON"]
