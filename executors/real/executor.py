"""The real executor: the shared ``StepPlan``s run through a real Llama model, and the measured
step times drive the simulated clock."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Sequence

import torch

from executors.base import Executor
from executors.step_terms import ATTENTION_TILE
from executors.real.config import DTYPE_NAMES, DTYPES, LlamaArgs, RealExecutorConfig
from executors.real.host_memory import keep_freed_host_memory
from executors.real.kernels import AttentionMetadata, get_kernels
from executors.real.kernels._triton import HAS_TRITON, interpreting
from executors.real.kernels.paged_attention import attention_tiles
from executors.real.model import LlamaModel
from executors.real.runner import ModelRunner
from executors.real.sampling import Sampler
from executors.real.weights import load_hf_checkpoint, shared_random_weights
from sim.errors import ConfigError
from sim.plan import StepPlan, StepResult
from sim.specs import HardwareSpec, ModelSpec

CPU_DEFAULT_MEMORY_GIB = 1.0  # what a cpu run may spend on weights, activations and KV
CUDA_WORKSPACE_BYTES = 256 * 2**20  # allocator slack, Triton and cuBLAS workspaces


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(str(name))
    except RuntimeError as e:
        raise ConfigError("device", f"not a torch device: {name!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"must be cpu or cuda[:N], got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} asked for, but torch {torch.__version__} sees no "
                                    f"CUDA device; use device=cpu")
    return dev


def resolve_kernels(name: str | None, device: torch.device) -> str:
    kernels = name or ("triton" if device.type == "cuda" else "torch")
    if kernels == "triton":
        if not HAS_TRITON:
            raise ConfigError("executor.kernels", "triton is not installed; use "
                                                  "executor.kernels=torch")
        if device.type == "cpu" and not interpreting():
            raise ConfigError("executor.kernels", "Triton kernels need a CUDA device; on cpu "
                              "use executor.kernels=torch, or set TRITON_INTERPRET=1 (slow)")
    return kernels


def prefill_attention_tile(kernels: str, group_size: int) -> int:
    """The query tile (``executors.step_terms.ATTENTION_TILES``) that prices this executor's
    prefill attention best. torch's reference attention is untiled (1). The Triton kernel
    runs ``64 // group_size`` query tokens per program (a 64-row tile of (token, head) pairs,
    ``attention_tiles``), each looping over keys only up to its own causal end: with a full
    64-token tile (group size 1) that is ``ATTENTION_TILE``; with Llama-3's group of 4 it is
    16 tokens, so a chunk is padded to at most 15 more tokens and the untiled count (1) is the
    closer one (64 would price a 65-token prompt as 128 x 128 pairs)."""
    if kernels == "torch":
        return 1
    tokens = attention_tiles(group_size, 2)[1]
    return ATTENTION_TILE if tokens >= ATTENTION_TILE else 1


class RealExecutor(Executor):
    produces_tokens = True

    def __init__(self, spec: ModelSpec, config: RealExecutorConfig, *, device: str | None = None,
                 seed: int = 0, tensor_parallel: int = 1) -> None:
        if tensor_parallel != 1:
            raise ConfigError("cluster.tensor_parallel_size",
                              f"the real executor runs one device; got {tensor_parallel}")
        self.spec = spec
        self.config = config
        self.device = resolve_device(config.device if config.device is not None else device)
        self.kernels_name = resolve_kernels(config.kernels, self.device)
        if config.dtype == "auto":
            self.dtype = (torch.float32 if self.device.type == "cpu"
                          else DTYPES[spec.activation_dtype])
        else:
            self.dtype = DTYPES[config.dtype]
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
            if config.keep_host_memory:
                keep_freed_host_memory()
        elif config.timer == "cpu":
            raise ConfigError("executor.timer", f"cpu time measures host work only; a "
                              f"{self.device} step needs executor.timer=wall")
        self._clock = time.process_time if config.timer == "cpu" else time.perf_counter
        self.args = LlamaArgs.from_spec(spec)
        self._memory = self._device_memory()
        self._check_fits()
        if config.checkpoint:
            weights = load_hf_checkpoint(config.checkpoint, self.args, self.dtype, self.device)
        else:
            weights = shared_random_weights(
                self.args, self.dtype, self.device,
                seed if config.weight_seed is None else config.weight_seed)
        self.model = LlamaModel(self.args, weights, get_kernels(self.kernels_name), self.device)
        self.runner = ModelRunner(self.model, self.device, self.dtype,
                                  Sampler(config.temperature, config.top_p, seed))

    # ---- memory ---------------------------------------------------------------------------
    def _device_memory(self) -> float:
        if self.device.type == "cuda":
            total = float(torch.cuda.get_device_properties(self.device).total_memory)
        else:
            total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        gib = self.config.device_memory_gib
        if gib is None:
            return total if self.device.type == "cuda" else CPU_DEFAULT_MEMORY_GIB * 2**30
        # The KV cache is allocated up front: more than the device has fails there.
        if gib * 2**30 > total:
            raise ConfigError("executor.device_memory_gib", (
                f"{gib} GiB is more than the {total / 2**30:.2f} GiB the {self.device} device "
                f"has"))
        return gib * 2**30

    def _check_fits(self) -> None:
        size = self.dtype.itemsize
        need = self.spec.num_params * size
        if need > self._memory:
            raise ConfigError(
                "executor.device_memory_gib",
                f"{self.spec.name} needs {need / 2**30:.2f} GiB of {DTYPE_NAMES[self.dtype]} "
                f"weights, more than the {self._memory / 2**30:.2f} GiB the {self.device} "
                f"device may use")

    def weight_bytes(self) -> float:
        return float(self.model.weights.nbytes + self.model.cos_sin.numel() * 4)

    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """The largest step's live tensors: hidden, residual, qkv, attention output and the
        gate/up product with its activation, plus fp32 logits and probabilities."""
        a = self.args
        per_token = (2 * a.hidden_size + a.q_size + 2 * a.kv_size + a.q_size
                     + 3 * a.intermediate_size) * self.dtype.itemsize
        logits = 2 * max_num_seqs * a.vocab_size * 4
        workspace = CUDA_WORKSPACE_BYTES if self.device.type == "cuda" else 0
        return float(max_num_batched_tokens * per_token + logits + workspace)

    @property
    def attention_tile(self) -> int:
        """Query rows per prefill attention tile, as ``StepDecomposer`` prices them
        (``prefill_attention_tile``): what ``experiments/validate.py`` fits profiles with."""
        return prefill_attention_tile(self.kernels_name, self.args.group_size)

    def kv_cache_dtype(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def device_spec(self, hardware: HardwareSpec) -> HardwareSpec:
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
        else:
            name = "cpu"
        return dataclasses.replace(hardware, name=name, display_name=name,
                                   memory_gib=self._memory / 2**30)

    # ---- hooks ----------------------------------------------------------------------------
    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                      num_offload_blocks: int = 0) -> None:
        if self.device.type == "cuda":
            self._check_kv_fits(num_gpu_blocks, block_size)
        self.runner.init_kv_cache(num_gpu_blocks, num_cpu_blocks, block_size,
                                  num_offload_blocks)
        if self.config.warmup:
            self._warmup(num_gpu_blocks, block_size)

    def _check_kv_fits(self, num_gpu_blocks: int, block_size: int) -> None:
        """A KV pool the GPU cannot hold is a config error naming the pool, not an allocator
        traceback: the planner sizes pools from the device's total memory, so it cannot see
        what other executors in this process (a profiler's pool, an earlier run's) still hold."""
        a = self.args
        need = 2 * a.num_layers * num_gpu_blocks * block_size * a.kv_size * self.dtype.itemsize
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory torch's caching allocator holds but does not use is free to this process.
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if need > free:
            raise ConfigError(
                "kv.num_gpu_blocks_override",
                f"{num_gpu_blocks} blocks of {DTYPE_NAMES[self.dtype]} KV for {self.spec.name} "
                f"need {need / 2**30:.1f} GiB, but only {free / 2**30:.1f} of the "
                f"{total / 2**30:.1f} GiB of {self.device} are free "
                f"({self.weight_bytes() / 2**30:.1f} GiB of weights; other executors in this "
                f"process may hold the rest): lower kv.num_gpu_blocks")

    def release(self) -> None:
        """Free the KV cache and the swap pool once the run is over (the weights are shared,
        ``weights.shared_random_weights``). Callers that keep a finished run's executor, as
        ``experiments/validate.py`` keeps every recorded run, would otherwise hold one pool
        per run on the device; it also lets go of the model, so that weights the shared
        cache has replaced are freed too. The executor runs no step afterwards."""
        self.runner.release()
        self.runner.model = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]

    def add_request(self, request_id: int, prompt_token_ids: Sequence[int] | None) -> None:
        self.runner.add_request(request_id, prompt_token_ids)

    def free_request(self, request_id: int) -> None:
        self.runner.free_request(request_id)

    def output_token_ids(self, request_id: int) -> list[int]:
        return self.runner.output_token_ids(request_id)

    # ---- steps ----------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        cuda = self.device.type == "cuda"
        defer = self.config.defer_gc and gc.isenabled()
        if defer:
            gc.disable()
        try:
            if cuda:  # nothing queued earlier (a pool's zero fill, a swap) is charged here
                torch.cuda.synchronize(self.device)
            t0 = self._clock()
            sampled = self.runner.step(plan)  # ends with a host copy of the sampled ids
            if cuda:
                torch.cuda.synchronize(self.device)
            t = self._clock() - t0
        finally:
            if defer:
                gc.enable()
        return StepResult(t, sampled)

    def _warmup(self, num_gpu_blocks: int, block_size: int) -> None:
        """One prefill and one decode step on scratch slots, so that kernel compilation and
        allocator growth are not charged to the first measured steps. The slots are free:
        every later read is preceded by the write of its own request."""
        n = min(2 * block_size + 1, num_gpu_blocks * block_size - 1)
        blocks = list(range(-(-(n + 1) // block_size)))
        if n < 1 or len(blocks) > num_gpu_blocks:
            return
        dev = self.device
        for start, count in ((0, n), (n, 1)):
            meta = AttentionMetadata.build([(start, count, blocks)], block_size, dev)
            ids = torch.zeros(count, dtype=torch.long, device=dev)
            pos = torch.arange(start, start + count, device=dev)
            self.model.forward(ids, pos, self.runner.gpu_cache, meta,
                               torch.tensor([count - 1], device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
