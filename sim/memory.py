"""Memory planner: how many KV blocks fit on one GPU (vLLM's profile-then-divide rule).

    usable   = device memory x gpu_memory_utilization
    kv bytes = usable - weights (this rank) - activation/workspace reserve
    blocks   = kv bytes // (block_size x KV bytes per token on this rank)
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ConfigError, require
from sim.specs import HardwareSpec, ModelSpec


@dataclass(frozen=True)
class MemoryPlan:
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    device_bytes: float
    usable_bytes: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes_per_token: float  # this rank
    kv_bytes_per_block: float
    num_offload_blocks: int = 0  # the offload tier's blocks in host memory (kv.kv_offloading_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def activation_reserve_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int,
                             tensor_parallel: int = 1) -> float:
    """Peak activation memory of the largest step, as vLLM's profiling run would find it.

    The largest live set is inside the MLP: the hidden state and residual, the gate/up output
    (2 x intermediate / TP) and its activation; plus fp32 logits for the sampled rows, and a
    fixed CUDA-graph/NCCL/allocator workspace of 1 GiB (what vLLM typically reports as
    non-torch memory).
    """
    t = max_num_batched_tokens
    a = model.act_bytes
    per_token = (2 * model.hidden_size + 3 * model.intermediate_size // tensor_parallel
                 + (model.q_size + 2 * model.kv_size) // tensor_parallel) * a
    logits = max_num_seqs * model.vocab_size * 4.0
    return t * per_token + logits + 2**30


# KV block sizes (tokens): powers of two up to 256, vLLM's choices (1, 8, 16 ... 256) plus 2
# and 4 for tiny test pools. Our Triton attention kernel (executors/real/kernels/
# paged_attention.py) finds a token's block by division and would run any size; the rule
# follows vLLM, whose attention backends are built for power-of-two blocks.
MAX_BLOCK_SIZE = 256


def check_block_size(block_size: int, field: str = "kv.block_size") -> None:
    """Refuse a KV block size that is not a power of two in 1..``MAX_BLOCK_SIZE``."""
    ok = 1 <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0
    require(ok, field, f"must be a power of two from 1 to {MAX_BLOCK_SIZE} (vLLM uses 8, 16, "
                       f"32 ... 256; 16 by default), got {block_size}")


def plan_memory(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    block_size: int,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    swap_space: float = 4.0,
    num_gpu_blocks_override: int | None = None,
    activation_reserve_override_bytes: float | None = None,
    weight_bytes_override: float | None = None,
    parallel_field: str = "cluster.tensor_parallel_size",
    activation_field: str | None = None,
) -> MemoryPlan:
    """KV blocks that fit beside the weights and the activation reserve. ``activation_field``:
    the option that set the reserve (None: the batch limits sized it). ``parallel_field``:
    the config field a model that does not fit is reported on (a disaggregated pool's own
    ``cluster.<side>.tensor_parallel_size``)."""
    if block_size < 1:
        raise ConfigError("kv.block_size", f"must be >= 1, got {block_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError("kv.gpu_memory_utilization",
                          f"must be in (0, 1], got {gpu_memory_utilization}")
    if swap_space < 0:
        raise ConfigError("kv.swap_space", f"must be >= 0, got {swap_space}")
    if activation_reserve_override_bytes is not None and activation_reserve_override_bytes < 0:
        # A negative reserve would plan a KV pool larger than the GPU's memory.
        raise ConfigError("kv.activation_reserve_gib",
                          f"must be >= 0, got {activation_reserve_override_bytes / 2**30} GiB")
    weights = (weight_bytes_override if weight_bytes_override is not None
               else model.weight_bytes(tensor_parallel, pipeline_parallel))
    act = (activation_reserve_override_bytes if activation_reserve_override_bytes is not None
           else activation_reserve_bytes(model, max_num_batched_tokens, max_num_seqs,
                                         tensor_parallel))
    usable = hardware.memory_bytes * gpu_memory_utilization
    per_token = model.kv_bytes_per_token_per_rank(tensor_parallel, pipeline_parallel)
    per_block = per_token * block_size
    num_cpu_blocks = int(swap_space * 2**30 // per_block)
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override < 1:
            raise ConfigError("kv.num_gpu_blocks_override", f"must be >= 1, got {num_gpu_blocks_override}")
        num_gpu_blocks = int(num_gpu_blocks_override)
        # More blocks than the device's whole memory holds is no pool a GPU can have (vLLM
        # would fail allocating its KV tensor): say so rather than simulate it.
        if num_gpu_blocks * per_block > hardware.memory_bytes:
            raise ConfigError("kv.num_gpu_blocks_override", (
                f"{num_gpu_blocks} blocks of {per_block:.0f} bytes ({model.name}, "
                f"kv.block_size={block_size}, TP={tensor_parallel}, PP={pipeline_parallel}) "
                f"need {num_gpu_blocks * per_block / 1e9:.4g} GB per GPU, more than the "
                f"{hardware.memory_bytes / 1e9:.4g} GB {hardware.name} has; at most "
                f"{int(hardware.memory_bytes // per_block)} fit"))
    else:
        free = usable - weights - act
        if free < per_block and usable - weights >= per_block:
            # The weights fit, their activations do not: name what sized them (the batch
            # limits, the larger one, unless a reserve was set).
            field = activation_field or (
                "policy.max_num_batched_tokens" if max_num_batched_tokens >= max_num_seqs
                else "policy.max_num_seqs")
            raise ConfigError(field, (
                f"{act / 1e9:.4g} GB of activations (max_num_batched_tokens="
                f"{max_num_batched_tokens}, max_num_seqs={max_num_seqs}) leave no room for KV "
                f"beside {model.name}'s {weights / 1e9:.2f} GB weights per GPU on "
                f"{hardware.name} ({usable / 1e9:.2f} GB usable at TP={tensor_parallel}, "
                f"PP={pipeline_parallel})"))
        if free < per_block:
            raise ConfigError(
                parallel_field,
                f"{model.name} does not fit on {hardware.name} at TP={tensor_parallel}, "
                f"PP={pipeline_parallel}: {weights / 1e9:.2f} GB weights per GPU + "
                f"{act / 1e9:.2f} GB activations > {usable / 1e9:.2f} GB usable "
                f"(gpu_memory_utilization={gpu_memory_utilization}); raise the parallelism "
                f"or use a bigger GPU",
            )
        num_gpu_blocks = int(free // per_block)
    return MemoryPlan(
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        block_size=block_size,
        device_bytes=hardware.memory_bytes,
        usable_bytes=usable,
        weight_bytes=weights,
        activation_bytes=act,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
    )
