"""The real executor: a Llama-architecture model with a paged KV cache (Triton kernels on a
GPU, torch reference kernels on a CPU), driven by the same StepPlans as the cost model.

torch and triton are imported only under this package; ``executors/__init__.py`` registers
``build_real_executor`` lazily, so selecting ``executor=real`` is what imports them.
"""

from __future__ import annotations

from typing import Any

from executors.real.config import RealExecutorConfig
from executors.real.executor import RealExecutor, resolve_device
from sim.specs import HardwareSpec, ModelSpec


def build_real_executor(model: ModelSpec, hardware: HardwareSpec, tensor_parallel: int,
                        config: dict[str, Any], block_size: int = 16, seed: int = 0,
                        device: str | None = None, **_: Any) -> RealExecutor:
    """Factory for ``executor=real``. ``device`` is the top-level ``device`` option, used when
    ``executor.device`` is not set."""
    return RealExecutor(model, RealExecutorConfig.from_dict(config), device=device, seed=seed,
                        tensor_parallel=tensor_parallel)


def device_name(device: str | None) -> str:
    """``cpu``, or the name torch gives the GPU that ``device`` (the ``device`` option: cpu,
    cuda, cuda:N, or None for cuda if available) resolves to, e.g. ``NVIDIA H100 80GB HBM3``:
    what ``conf/hardware/*.yaml``'s ``display_name`` says (``validate.hardware: auto``)."""
    import torch

    dev = resolve_device(device)
    return "cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev)


__all__ = ["RealExecutor", "RealExecutorConfig", "build_real_executor", "device_name"]
