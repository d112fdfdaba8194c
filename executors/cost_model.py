"""Roofline cost model: the duration of a StepPlan from model shape x hardware.

Per layer and per tensor-parallel rank, every operator costs
``max(FLOPs / (peak x compute_eff), bytes / (HBM bandwidth x memory_eff))``:

* QKV, output, gate/up and down projections: weights read once per step, activations per token;
* attention, split the way kernels split it: prefill chunks (FLOPs grow with chunk x context,
  causal within the chunk) and decode rows (one query; the cached KV is read);
* element-wise work (RMSNorms, RoPE, SiLU-and-mul, residual adds): bytes only;
* two all-reduces per layer under TP: latency + ring traffic 2(t-1)/t x bytes / bus bandwidth,
  with the coefficients fitted per (hardware, TP degree) in ``conf/network/`` (see
  ``executors/network.py``);
* under pipeline parallelism (PP stages of ceil(layers / PP) layers each) the batch crosses
  every stage, so its time is PP x one stage plus PP - 1 stage-to-stage sends of the hidden
  states; ``duration`` is that whole latency and the replica overlaps PP micro-batches
  (``sim/cluster/pipeline.py``);

plus the LM head for the sampled rows only, a fixed per-step CPU overhead, a per-sequence
overhead (input preparation, sampling), and the PCIe time of the step's swap copies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from executors.base import EXECUTORS, Executor
from executors.network import load_network
from sim.errors import ConfigError, require
from sim.memory import activation_reserve_bytes
from sim.plan import StepPlan, StepResult
from sim.specs import HardwareSpec, ModelSpec


@dataclass(frozen=True)
class CostModelConfig:
    name: str = "cost_model"
    step_overhead_ms: float = 0.3  # scheduler + launch cost of one step (CUDA graphs on)
    per_seq_overhead_us: float = 15.0  # input prep and sampling per scheduled request
    # Override the hardware spec's efficiencies (None: use the spec's).
    compute_efficiency: float | None = None
    memory_efficiency: float | None = None
    attention_efficiency: float = 0.8  # FlashAttention vs a dense GEMM, relative
    profile: str | None = None  # calibrated coefficients (issue: calibration)
    network: str | None = "auto"  # conf/network/<hardware>.yaml; "none": hardware spec only

    def __post_init__(self) -> None:
        require(self.step_overhead_ms >= 0, "executor.step_overhead_ms", "must be >= 0")
        require(self.per_seq_overhead_us >= 0, "executor.per_seq_overhead_us", "must be >= 0")
        for f in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, f)
            require(v is None or 0 < v <= 1, f"executor.{f}", f"must be in (0, 1], got {v}")
        require(0 < self.attention_efficiency <= 1, "executor.attention_efficiency",
                f"must be in (0, 1], got {self.attention_efficiency}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModelConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"executor.{unknown[0]}",
                              f"unknown option for the cost model; known: {', '.join(sorted(names))}")
        return cls(**data)


@dataclass
class StepBreakdown:
    """Seconds per term for one step (summed over layers)."""

    linear: float = 0.0
    attention_prefill: float = 0.0
    attention_decode: float = 0.0
    elementwise: float = 0.0
    lm_head: float = 0.0
    communication: float = 0.0
    pipeline: float = 0.0  # stage-to-stage sends
    overhead: float = 0.0
    swap: float = 0.0

    @property
    def total(self) -> float:
        return (self.linear + self.attention_prefill + self.attention_decode + self.elementwise
                + self.lm_head + self.communication + self.pipeline + self.overhead + self.swap)


class RooflineCostModel(Executor):
    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tensor_parallel: int = 1,
                 config: CostModelConfig | None = None, block_size: int = 16,
                 pipeline_parallel: int = 1) -> None:
        require(tensor_parallel >= 1, "cluster.tensor_parallel", f"must be >= 1, got {tensor_parallel}")
        require(pipeline_parallel >= 1, "cluster.pipeline_parallel",
                f"must be >= 1, got {pipeline_parallel}")
        require(pipeline_parallel <= model.num_layers, "cluster.pipeline_parallel",
                f"{pipeline_parallel} stages for {model.name}'s {model.num_layers} layers")
        require(model.num_heads % tensor_parallel == 0, "cluster.tensor_parallel",
                f"{tensor_parallel} does not divide {model.name}'s {model.num_heads} heads")
        self.model = model
        self.hardware = hardware
        self.tp = tensor_parallel
        self.pp = pipeline_parallel
        # Layers the batch crosses, counting each stage as its largest (ceil) share.
        self._layers = (model.num_layers if pipeline_parallel == 1
                        else pipeline_parallel * -(-model.num_layers // pipeline_parallel))
        self.config = config or CostModelConfig()
        self.network = load_network(hardware, self.config.network)
        self.block_size = block_size
        c = self.config
        ce = c.compute_efficiency or hardware.compute_efficiency
        me = c.memory_efficiency or hardware.memory_efficiency
        self._flops = hardware.peak_flops(model.weight_dtype) * ce  # achievable FLOP/s
        self._attn_flops = hardware.peak_tflops_fp16 * 1e12 * ce * c.attention_efficiency
        self._bw = hardware.memory_bandwidth_gbps * 1e9 * me  # achievable bytes/s
        self._pcie_bw = hardware.pcie_bandwidth_gbps * 1e9
        self._pcie_lat = hardware.pcie_latency_us * 1e-6
        self._overhead = c.step_overhead_ms * 1e-3
        self._per_seq = c.per_seq_overhead_us * 1e-6

        t, m = tensor_parallel, model
        h, a, wb = m.hidden_size, m.act_bytes, m.weight_bytes_per_element
        q, kv, inter = m.q_size // t, max(m.head_dim, m.kv_size // t), m.intermediate_size // t
        # (in_features, out_features) of each projection on one rank
        self._linears = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
        self._wb, self._ab = wb, a
        self._heads = m.num_heads // t
        self._kv_width = kv  # kv_heads x head_dim on one rank
        self._kvb = m.kv_bytes_per_element
        # Element-wise bytes per token per layer: 2 RMSNorms with residual add (read x and
        # residual, write both), RoPE on q and k (read+write), SiLU-and-mul (read 2I, write I).
        self._elementwise_bytes_per_token = a * (2 * 4 * h + 2 * (q + kv) + 3 * inter)
        self._kv_block_bytes = m.kv_bytes_per_token_per_rank(t, pipeline_parallel) * block_size

    # ---- Executor interface -------------------------------------------------------------
    def weight_bytes(self) -> float:
        return self.model.weight_bytes(self.tp, self.pp)

    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        return activation_reserve_bytes(self.model, max_num_batched_tokens, max_num_seqs, self.tp)

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult(self.breakdown(plan).total)

    # ---- the model ----------------------------------------------------------------------
    def _roof(self, flops: float, nbytes: float, flops_rate: float | None = None) -> float:
        return max(flops / (flops_rate or self._flops), nbytes / self._bw)

    def breakdown(self, plan: StepPlan) -> StepBreakdown:
        n_tokens = 0
        n_sampled = 0
        n_rows = 0
        pf_flops = 0.0  # prefill attention: query x key pairs (causal within a chunk)
        pf_kv_tokens = 0  # prefill attention: KV tokens read
        pf_q_tokens = 0
        dec_ctx = 0  # decode attention: KV tokens read
        n_dec = 0
        for s in plan.scheduled:
            n = s.num_new_tokens
            n_tokens += n
            n_rows += 1
            if s.sample:
                n_sampled += 1
            if n == 1 and s.start_position > 0:
                dec_ctx += s.start_position + 1
                n_dec += 1
            else:
                pf_flops += n * s.start_position + n * (n + 1) / 2
                pf_kv_tokens += s.start_position + n
                pf_q_tokens += n
        return self.time_for(n_tokens, n_sampled, n_rows, pf_flops, pf_kv_tokens, pf_q_tokens,
                             dec_ctx, n_dec, len(plan.swap_out), len(plan.swap_in))

    def time_for(self, n_tokens: int, n_sampled: int, n_rows: int, pf_pairs: float,
                 pf_kv_tokens: int, pf_q_tokens: int, dec_ctx: int, n_dec: int,
                 n_swap_out_blocks: int = 0, n_swap_in_blocks: int = 0) -> StepBreakdown:
        """Step time from aggregate shape figures (what ``breakdown`` computes from a plan)."""
        m, b = self.model, StepBreakdown()
        if n_tokens:
            layers = self._layers
            ab, wb = self._ab, self._wb
            lin = 0.0
            for fin, fout in self._linears:
                flops = 2.0 * n_tokens * fin * fout
                nbytes = fin * fout * wb + n_tokens * (fin + fout) * ab
                lin += self._roof(flops, nbytes)
            b.linear = layers * lin
            d, hq, kvw, kvb = m.head_dim, self._heads, self._kv_width, self._kvb
            if pf_q_tokens:
                flops = 4.0 * hq * d * pf_pairs
                nbytes = 2 * kvw * kvb * pf_kv_tokens + 2 * hq * d * ab * pf_q_tokens
                b.attention_prefill = layers * self._roof(flops, nbytes, self._attn_flops)
            if n_dec:
                flops = 4.0 * hq * d * dec_ctx
                nbytes = 2 * kvw * kvb * dec_ctx + 2 * hq * d * ab * n_dec
                b.attention_decode = layers * self._roof(flops, nbytes, self._attn_flops)
            # KV store of the new tokens is element-wise traffic too.
            b.elementwise = layers * n_tokens * (self._elementwise_bytes_per_token
                                                 + 2 * kvw * kvb) / self._bw
            msg = n_tokens * m.hidden_size * ab  # the hidden states of the step
            if self.tp > 1:
                b.communication = layers * 2 * self.network.all_reduce(msg, self.tp)
            if self.pp > 1:
                b.pipeline = (self.pp - 1) * self.network.send_recv(msg)
        if n_sampled:
            v, h = m.vocab_size // self.tp, m.hidden_size
            b.lm_head = self._roof(2.0 * n_sampled * h * v, h * v * 2 + n_sampled * (h + v) * 4)
        if n_rows or n_swap_out_blocks or n_swap_in_blocks:
            b.overhead = self._overhead + self._per_seq * n_rows
        for blocks in (n_swap_out_blocks, n_swap_in_blocks):
            if blocks:
                b.swap += self._pcie_lat + blocks * self._kv_block_bytes / self._pcie_bw
        return b


@EXECUTORS.register("cost_model")
def build_cost_model(model: ModelSpec, hardware: HardwareSpec, tensor_parallel: int,
                     config: dict[str, Any], block_size: int = 16, pipeline_parallel: int = 1,
                     **_: Any) -> RooflineCostModel:
    return RooflineCostModel(model, hardware, tensor_parallel, CostModelConfig.from_dict(config),
                             block_size=block_size, pipeline_parallel=pipeline_parallel)
