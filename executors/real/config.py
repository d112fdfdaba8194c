"""Model arguments derived from the shared ``ModelSpec`` and the real executor's options.

``LlamaArgs.from_spec(load_model_spec("llama3_8b"))`` has exactly the shapes the cost model
prices, so ``model=llama3_8b`` means the same network in both executors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sim.config_types import typed_fields
from sim.errors import ConfigError, require, require_known_fields
from sim.specs import ModelSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
LLAMA3_ROPE_KEYS = {"factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"}
MAX_THREADS = 4096  # torch.set_num_threads takes a C int; no host has more cores
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class LlamaArgs:
    """Shapes and constants of one Llama-architecture decoder (gpt-fast's ``ModelArgs``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, float] | None = None
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> LlamaArgs:
        if spec.head_dim % 2:
            raise ConfigError("model.head_dim", f"rotary embeddings need an even head_dim, got "
                                                f"{spec.head_dim}")
        if spec.rope_scaling is not None:
            rope_scaling_checked(spec.rope_scaling)
        return cls(
            name=spec.name, num_layers=spec.num_layers, hidden_size=spec.hidden_size,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
            max_position=spec.max_model_len, rope_theta=spec.rope_theta,
            rope_scaling=dict(spec.rope_scaling) if spec.rope_scaling else None,
            rms_norm_eps=spec.rms_norm_eps, attention_bias=spec.attention_bias,
            tie_word_embeddings=spec.tie_word_embeddings,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def rope_scaling_checked(scaling: dict[str, Any]) -> dict[str, float]:
    """Only Llama-3 frequency scaling is supported; anything else is refused, not ignored."""
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    keys = set(scaling) - {"rope_type", "type"}
    if kind != "llama3" or keys != LLAMA3_ROPE_KEYS:
        raise ConfigError("model.rope_scaling", f"only Llama-3 scaling with keys "
                          f"{sorted(LLAMA3_ROPE_KEYS)} is supported, got {scaling}")
    return {k: float(scaling[k]) for k in LLAMA3_ROPE_KEYS}


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 scaling: long wavelengths are divided
    by ``factor``, short ones kept, and the band between interpolated smoothly."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if args.rope_scaling is None:
        return inv_freq.float()
    s = rope_scaling_checked(args.rope_scaling)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin_cache(args: LlamaArgs, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_position, head_dim] fp32: cos of every (position, frequency), then sin."""
    inv_freq = rope_inv_freq(args).double()
    freqs = torch.outer(torch.arange(args.max_position, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().contiguous().to(device)


@dataclass(frozen=True)
class RealExecutorConfig:
    """``conf/executor/real.yaml``. Nones are resolved against the device at build time."""

    name: str = "real"
    device: str | None = None  # cpu | cuda | cuda:N; None: cuda if available, else cpu
    dtype: str = "auto"  # auto (cpu: fp32, cuda: the model's activation dtype) | fp32 | fp16 | bf16
    num_threads: int = 1  # torch.set_num_threads on cpu: 1 keeps timings stable
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    checkpoint: str | None = None  # local Hugging Face folder; None: random weights
    # Seed of the random weights; None: the run's seed. Validation pins it, so that its runs
    # under other seeds (other arrivals and prompts) serve the same model and share one copy.
    weight_seed: int | None = None
    kernels: str | None = None  # triton | torch; None: triton on cuda, torch on cpu
    device_memory_gib: float | None = None  # None: the GPU's memory; 1 GiB on cpu
    warmup: bool = True  # run (and compile) one prefill and one decode before the first step
    # What a step's duration is: "wall" (perf_counter; after a CUDA sync on a GPU) or "cpu"
    # (this process's CPU time; cpu device only): on a shared host, wall time also counts the
    # time slices other processes take, CPU time does not (docs/calibration.md, CPU validation).
    timer: str = "wall"
    # cpu device: glibc keeps freed memory (no mmap, no trim), as CUDA's caching allocator
    # does, so large steps do not page-fault their temporaries back in (host_memory.py).
    keep_host_memory: bool = True
    # Keep Python's garbage collector out of the timed step: a collection is triggered by
    # whichever allocation crosses the threshold and scans the whole simulator's heap
    # (requests, simpy events), host overhead that belongs to no step. Deferred, it runs
    # right after the step, outside the timing (docs/calibration.md, "CPU validation").
    defer_gc: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.dtype, str) and (self.dtype == "auto" or self.dtype in DTYPES),
                "executor.dtype",
                f"must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        require(1 <= self.num_threads <= MAX_THREADS, "executor.num_threads",
                f"must be in [1, {MAX_THREADS}], got {self.num_threads}")
        # Logits divided by a smaller temperature overflow to inf (vLLM samples greedily
        # below the same 1e-5).
        require(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
                "executor.temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got "
                                        f"{self.temperature}")
        require(0 < self.top_p <= 1, "executor.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.checkpoint is None or isinstance(self.checkpoint, str),
                "executor.checkpoint", f"must be a folder name or null, got {self.checkpoint!r}")
        require(self.kernels in (None, "triton", "torch"), "executor.kernels",
                f"must be triton or torch, got {self.kernels!r}")
        require(self.timer in ("wall", "cpu"), "executor.timer",
                f"must be wall or cpu, got {self.timer!r}")
        require(self.weight_seed is None or self.weight_seed >= 0, "executor.weight_seed",
                f"must be >= 0, got {self.weight_seed}")
        require(self.device_memory_gib is None or self.device_memory_gib > 0,
                "executor.device_memory_gib", f"must be > 0, got {self.device_memory_gib}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RealExecutorConfig:
        require_known_fields(data, cls, "executor", "option for the real executor")
        return cls(**typed_fields(cls, data, "executor"))
