"""Model and hardware specifications.

The data lives in ``conf/model/*.yaml`` and ``conf/hardware/*.yaml`` (the same files Hydra's
``model=`` and ``hardware=`` select); this module turns one into a validated dataclass and
derives the memory figures both executors use.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from sim.config_types import typed_fields
from sim.errors import ConfigError, require, require_known_fields

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# Bytes per element. int4 packs two weights per byte.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")


def dtype_bytes(dtype: str, field_name: str) -> float:
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ConfigError(field_name, f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# The largest value of each model dimension: generous bounds (served models stay far below
# them) that keep the memory plan's and the cost model's arithmetic and loops finite.
MODEL_SIZE_LIMITS = {
    "num_layers": 4096, "hidden_size": 2**20, "num_heads": 4096, "num_kv_heads": 4096,
    "head_dim": 4096, "intermediate_size": 2**22, "vocab_size": 2**24, "max_model_len": 2**31,
}
# The most SMs an accelerator may have (the cost model lays decode blocks out over them).
MAX_SMS = 4096


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-architecture decoder (Llama, Mistral and Qwen2 share it)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    hf_name: str = ""
    rope_theta: float = 10000.0
    # Llama-3.1 style frequency scaling: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; None for plain RoPE.
    rope_scaling: dict[str, float] | None = None
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False  # Qwen2 has biases on q, k, v
    tie_word_embeddings: bool = False
    weight_dtype: str = "fp16"  # linear-layer weights; embeddings and norms stay 16-bit
    kv_cache_dtype: str = "fp16"
    activation_dtype: str = "fp16"

    def __post_init__(self) -> None:
        for f, most in MODEL_SIZE_LIMITS.items():
            v = getattr(self, f)
            require(v >= 1, f"model.{f}", f"must be >= 1, got {v}")
            require(v <= most, f"model.{f}", f"must be <= {most} (beyond any served model's; "
                                             f"the cost model's work grows with it), got {v}")
        for f in ("name", "hf_name", "weight_dtype", "kv_cache_dtype", "activation_dtype"):
            v = getattr(self, f)
            require(isinstance(v, str), f"model.{f}", f"must be a string, got {v!r}")
        require(self.rope_theta > 0, "model.rope_theta", f"must be > 0, got {self.rope_theta}")
        require(self.rms_norm_eps > 0, "model.rms_norm_eps",
                f"must be > 0, got {self.rms_norm_eps}")
        require(self.rope_scaling is None or isinstance(self.rope_scaling, dict),
                "model.rope_scaling", f"must be a mapping or null, got {self.rope_scaling!r}")
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        dtype_bytes(self.weight_dtype, "model.weight_dtype")
        require(self.kv_cache_dtype in KV_DTYPES, "model.kv_cache_dtype",
                f"unknown KV dtype {self.kv_cache_dtype!r}; known: {', '.join(KV_DTYPES)}")
        require(self.activation_dtype in ("fp16", "bf16", "fp32"), "model.activation_dtype",
                f"must be fp16, bf16 or fp32, got {self.activation_dtype!r}")

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params_per_layer(self) -> int:
        h = self.hidden_size
        qkv = h * (self.q_size + 2 * self.kv_size)
        o = self.q_size * h
        mlp = 3 * h * self.intermediate_size
        return qkv + o + mlp

    @property
    def other_params_per_layer(self) -> int:
        bias = (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        return 2 * self.hidden_size + bias  # two RMSNorm weights (+ qkv bias)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        per_layer = self.linear_params_per_layer + self.other_params_per_layer
        return self.num_layers * per_layer + self.embedding_params + lm_head + self.hidden_size

    # ---- bytes --------------------------------------------------------------------------------
    @property
    def weight_bytes_per_element(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def act_bytes(self) -> float:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def kv_bytes_per_element(self) -> float:
        return DTYPE_BYTES[self.kv_cache_dtype]

    def weight_bytes(self, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> float:
        """Weight bytes held by one GPU (the largest rank under the given parallelism).

        Linear layers use ``weight_dtype``; embeddings, LM head and norms stay 16-bit, as in
        common weight-only quantization (AWQ/GPTQ) deployments. Under pipeline parallelism the
        first stage holds the embedding and the last the LM head; we charge the larger stage.
        """
        sixteen = 2.0
        layers = -(-self.num_layers // pipeline_parallel)
        bias = self.other_params_per_layer - 2 * self.hidden_size
        embed = self.embedding_params * sixteen
        lm_head = 0.0 if self.tie_word_embeddings else embed
        ends = embed + lm_head if pipeline_parallel == 1 else max(embed, lm_head)
        sharded = layers * (self.linear_params_per_layer * self.weight_bytes_per_element
                            + bias * sixteen) + ends
        # Norm weights are replicated on every rank.
        replicated = (layers * 2 + 1) * self.hidden_size * sixteen
        return sharded / tensor_parallel + replicated

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for one token across all layers (whole model, all ranks)."""
        return 2 * self.num_layers * self.kv_size * self.kv_bytes_per_element

    def check_tensor_parallel(self, tensor_parallel: int,
                              field: str = "cluster.tensor_parallel_size") -> None:
        """Refuse a TP degree the model's heads cannot be split over, by vLLM's rule: the
        attention heads divide evenly over the ranks, and either the KV heads do too (each rank
        holds ``num_kv_heads / TP``) or the ranks divide evenly over the KV heads (each rank
        holds one replicated KV head). The error names ``field`` and both numbers."""
        tp, heads, kv = tensor_parallel, self.num_heads, self.num_kv_heads
        require(tp >= 1, field, f"must be >= 1, got {tp}")
        require(heads % tp == 0, field, f"{tp} does not divide {self.name}'s num_heads={heads}: "
                                        f"each rank must hold the same number of query heads")
        require(kv % tp == 0 or tp % kv == 0, field,
                f"{tp} neither divides nor is a multiple of {self.name}'s num_kv_heads={kv}: "
                f"KV heads are split evenly over the ranks (TP dividing {kv}) or each rank "
                f"holds one replicated KV head (TP a multiple of {kv})")

    def kv_heads_per_rank(self, tensor_parallel: int = 1,
                          field: str = "cluster.tensor_parallel_size") -> int:
        """KV heads one TP rank stores: ``num_kv_heads / TP`` when they split evenly, else one
        replicated head (``TP`` a multiple of ``num_kv_heads``); other TPs are refused."""
        self.check_tensor_parallel(tensor_parallel, field)
        return max(1, self.num_kv_heads // tensor_parallel)

    def kv_bytes_per_token_per_rank(self, tensor_parallel: int = 1,
                                    pipeline_parallel: int = 1) -> float:
        """K and V for one token on one rank: its KV heads, its pipeline stage's (largest,
        ceil) share of the layers."""
        kv_heads = self.kv_heads_per_rank(tensor_parallel)
        layers = -(-self.num_layers // pipeline_parallel)
        return 2 * layers * kv_heads * self.head_dim * self.kv_bytes_per_element


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator. Bandwidths in GB/s (1e9 bytes), compute in TFLOP/s (1e12)."""

    name: str
    memory_gib: float
    memory_bandwidth_gbps: float
    peak_tflops_fp16: float  # dense tensor-core fp16/bf16
    num_sms: int  # streaming multiprocessors: how many thread blocks run side by side
    peak_tflops_fp8: float = 0.0  # 0: not supported
    peak_tops_int8: float = 0.0
    interconnect: str = "nvlink"
    interconnect_bandwidth_gbps: float = 300.0  # per direction, per GPU
    interconnect_latency_us: float = 8.0
    pcie_bandwidth_gbps: float = 25.0  # host<->device, effective per direction
    pcie_latency_us: float = 10.0
    # Achievable fractions of peak for large dense work; the cost model's defaults.
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.9
    interconnect_efficiency: float = 0.8
    display_name: str = ""

    def __post_init__(self) -> None:
        for f in ("memory_gib", "memory_bandwidth_gbps", "peak_tflops_fp16", "num_sms",
                  "interconnect_bandwidth_gbps", "pcie_bandwidth_gbps"):
            require(getattr(self, f) > 0, f"hardware.{f}", f"must be > 0, got {getattr(self, f)}")
        for f in ("peak_tflops_fp8", "peak_tops_int8"):
            require(getattr(self, f) >= 0, f"hardware.{f}",
                    f"must be >= 0 (0: not supported), got {getattr(self, f)}")
        for f in ("interconnect_latency_us", "pcie_latency_us"):
            v = getattr(self, f)
            require(v >= 0, f"hardware.{f}", f"must be >= 0, got {v}")
        require(self.num_sms <= MAX_SMS, "hardware.num_sms",
                f"must be <= {MAX_SMS}, got {self.num_sms}")
        for f in ("name", "interconnect", "display_name"):
            v = getattr(self, f)
            require(isinstance(v, str), f"hardware.{f}", f"must be a string, got {v!r}")
        for f in ("compute_efficiency", "memory_efficiency", "interconnect_efficiency"):
            v = getattr(self, f)
            require(0 < v <= 1, f"hardware.{f}", f"must be in (0, 1], got {v}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def peak_flops(self, weight_dtype: str) -> float:
        """Peak matmul FLOP/s for the dtype the matmuls run in (weight-only int4 runs fp16)."""
        if weight_dtype == "fp8" and self.peak_tflops_fp8 > 0:
            return self.peak_tflops_fp8 * 1e12
        if weight_dtype == "int8" and self.peak_tops_int8 > 0:
            return self.peak_tops_int8 * 1e12
        return self.peak_tflops_fp16 * 1e12


def _known(kind: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / kind).glob("*.yaml"))


def _from_mapping(cls: type, data: dict[str, Any], kind: str, where: str) -> Any:
    require_known_fields(data, cls, kind, f"field in {where}")
    missing = [f.name for f in fields(cls) if f.name not in data
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"{kind}.{missing[0]}", f"missing in {where}")
    return cls(**typed_fields(cls, data, kind))


def model_spec_from(data: dict[str, Any], where: str = "model config") -> ModelSpec:
    return _from_mapping(ModelSpec, dict(data), "model", where)


def hardware_spec_from(data: dict[str, Any], where: str = "hardware config") -> HardwareSpec:
    return _from_mapping(HardwareSpec, dict(data), "hardware", where)


def _load(kind: str, name: str) -> dict[str, Any]:
    known = _known(kind)
    if name not in known:  # compared by name: no path is built from an arbitrary value
        raise ConfigError(kind, f"unknown {kind} {name!r}; known: {', '.join(known)}")
    path = CONF_DIR / kind / f"{name}.yaml"
    with path.open() as f:
        return yaml.safe_load(f)


def load_model_spec(name: str, **overrides: Any) -> ModelSpec:
    """The spec of ``conf/model/<name>.yaml`` (what Hydra's ``model=<name>`` selects)."""
    return model_spec_from({**_load("model", name), **overrides}, f"conf/model/{name}.yaml")


def load_hardware_spec(name: str, **overrides: Any) -> HardwareSpec:
    return hardware_spec_from({**_load("hardware", name), **overrides},
                              f"conf/hardware/{name}.yaml")


def known_models() -> list[str]:
    return _known("model")


def known_hardware() -> list[str]:
    return _known("hardware")

