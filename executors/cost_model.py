"""Roofline cost model: the duration of a StepPlan from model shape x hardware.

A plan is reduced to a ``StepShape`` and then to ``StepDrivers`` (``executors/step_terms.py``):
FLOPs and bytes per roofline term, summed over layers on one tensor-parallel rank. Each term
costs ``knee(FLOPs x s_per_flop, bytes x s_per_byte)`` (``max`` by default):

* QKV, output, gate/up and down projections: weights read once per step, activations per token;
* attention, split the way kernels split it: prefill chunks (chunk x (cached + chunk) pairs) and
  decode rows (one query; the cached KV is read, at ``kv_read_efficiency`` of the bandwidth since
  paged KV is gathered in block-sized pieces), plus a floor per attention kernel;
* element-wise work (RMSNorms, RoPE, SiLU-and-mul, residual adds, KV store): bytes only;
* two all-reduces per layer under TP: latency + ring traffic 2(t-1)/t x bytes / bus bandwidth,
  with the coefficients fitted per (hardware, TP degree) in ``conf/network/`` (see
  ``executors/network.py``);
* under pipeline parallelism (PP stages of ceil(layers / PP) layers each) the batch crosses
  every stage, so its time is PP x one stage plus PP - 1 stage-to-stage sends of the hidden
  states; ``duration`` is that whole latency and the replica overlaps PP micro-batches
  (``sim/cluster/pipeline.py``);

plus the LM head for the sampled rows only and the PCIe time of the step's swap copies. The
engine's host (CPU) work per step is a fixed time plus a time per scheduled request
(scheduling, input preparation, sampling and output bookkeeping), the latter for at most
``per_seq_overhead_max_seqs`` requests; with ``num_scheduler_steps`` N it is paid once per N
steps (vLLM's multi-step scheduling: each step carries 1/N of it), and with ``host_overlap``
it runs while the GPU runs (vLLM's asynchronous output processing, engines that schedule the
next step during the current one): a step then takes the longer of its GPU and host times
instead of their sum. A model with FP8 or INT8 weights runs its GEMMs at the hardware's FP8 or
INT8 peak where the spec has one and at its fp16 peak where it has none (weight-only kernels
that dequantize to fp16, such as vLLM's FP8 Marlin path on A100), the weights streamed at
their own size either way.

With ``executor.profile=<file>`` the prices come from a fitted hardware profile instead
(``executors/calibration.py``); communication and swap stay priced from the spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from executors.base import EXECUTORS, Executor
from executors.network import load_network
from executors.step_terms import (
    ATTENTION_TILE,
    DECODE_PLACEMENTS,
    SPLIT_RULES,
    Coefficients,
    DecodeGeometry,
    StepBreakdown,
    StepDecomposer,
    StepShape,
    _max,
    block_decode_context,
    knee,
    knee2,
    step_shape,
)
from sim.config_types import typed_fields
from sim.errors import require, require_known_fields
from sim.memory import activation_reserve_bytes
from sim.plan import StepPlan, StepResult
from sim.specs import HardwareSpec, ModelSpec

__all__ = ["CostModelConfig", "RooflineCostModel", "StepBreakdown", "build_cost_model"]

#: Shapes of steps without decode rows whose durations ``execute`` keeps (~400 bytes each):
#: a run's prompt lengths fit many times over; a trace whose batches of prompts never repeat
#: stops adding at this many instead of growing with the run.
NO_DECODE_SHAPES_KEPT = 1 << 16


#: The largest ``step_time_factor``: a thousand times slower is a different machine, and
#: larger factors run a simulated clock whose times lose the precision latencies need.
MAX_STEP_TIME_FACTOR = 1e3


@dataclass(frozen=True)
class CostModelConfig:
    name: str = "cost_model"
    step_overhead_ms: float = 0.3  # host time of one step: scheduler + launches (CUDA graphs on)
    # Host time per scheduled request per step (input prep, sampling, output bookkeeping), for
    # at most per_seq_overhead_max_seqs of a step's requests (None: every request).
    per_seq_overhead_us: float = 15.0
    per_seq_overhead_max_seqs: int | None = 256
    # The host work runs once per num_scheduler_steps steps (vLLM's --num-scheduler-steps):
    # each step carries 1/N of it.
    num_scheduler_steps: int = 1
    # True: host work overlaps the GPU's (vLLM's async output processing, overlap schedulers):
    # a step takes max(GPU, host) instead of GPU + host. None: the policy's engine default
    # (``Policy.host_overlap_default``; vllm_v1 and sglang overlap), False where no policy
    # says (a cost model built directly).
    host_overlap: bool | None = None
    # Override the hardware spec's efficiencies (None: use the spec's).
    compute_efficiency: float | None = None
    memory_efficiency: float | None = None
    # FlashAttention-2 (paged KV) vs a dense GEMM, relative: Vidur's A100 profile measures
    # ~110 TFLOP/s on long prefixes, 0.35 of peak (docs/calibration.md).
    attention_efficiency: float = 0.5
    kv_read_efficiency: float = 0.85  # paged-KV gathers vs streaming weights, relative
    # Element-wise kernels (RMSNorm, RoPE, SiLU-and-mul, adds, KV store) vs streaming weights,
    # relative. 1.0: the weights' rate; Vidur's A100/H100 profiles of these operators measure
    # 0.54..0.68 of it from 256 tokens up (docs/calibration.md, "Element-wise kernels").
    elementwise_efficiency: float = 1.0
    attention_kernel_us: float = 7.0  # launch + ramp-up + tail of one attention kernel
    attention_wave_us: float = 3.0  # start-up + write-back of one wave of decode thread blocks
    attention_ctas_per_sm: int = 2  # decode thread blocks resident per SM (one wave's slots)
    # How decode attention splits each sequence's KV (executors/step_terms.SPLIT_RULES):
    # "flash" (FlashAttention's heuristic, the kernel Vidur profiled) or "fill" (fill the SMs).
    attention_split_rule: str = "flash"
    # Width of the block table FlashAttention's heuristic sees, in tokens (CUDA graphs pad
    # tables to a fixed width); None: the batch's longest context in whole KV blocks.
    attention_split_kv_len: int | None = None
    # Where the flash rule's decode thread blocks run (executors/step_terms.DECODE_PLACEMENTS):
    # "launch" (launch order, docs/calibration.md) or "waves" (the geometry before it).
    attention_decode_placement: str = "launch"
    # p of the knee (FLOP time^p + byte time^p)^(1/p); None: the sharp roofline max().
    roofline_sharpness: float | None = 2.0
    profile: str | None = None  # a fitted hardware profile (YAML/JSON; executors/calibration.py)
    # Every price of a step (host and GPU terms, a profile's or the roofline's) times this
    # factor; TP communication, pipeline sends and swap copies keep their own prices. A what-if
    # for a slower or faster device, and the bounds of the error bars (experiments/intervals.py).
    step_time_factor: float = 1.0
    network: str | None = "auto"  # conf/network/<hardware>.yaml; "none": hardware spec only

    def __post_init__(self) -> None:
        require(self.step_overhead_ms >= 0, "executor.step_overhead_ms", "must be >= 0")
        require(self.per_seq_overhead_us >= 0, "executor.per_seq_overhead_us", "must be >= 0")
        require(self.per_seq_overhead_max_seqs is None or self.per_seq_overhead_max_seqs >= 1,
                "executor.per_seq_overhead_max_seqs",
                f"must be >= 1 or null (every request), got {self.per_seq_overhead_max_seqs}")
        require(self.num_scheduler_steps >= 1, "executor.num_scheduler_steps",
                f"must be >= 1, got {self.num_scheduler_steps}")
        require(self.attention_kernel_us >= 0, "executor.attention_kernel_us", "must be >= 0")
        require(self.attention_wave_us >= 0, "executor.attention_wave_us", "must be >= 0")
        require(self.attention_ctas_per_sm >= 1, "executor.attention_ctas_per_sm",
                f"must be >= 1, got {self.attention_ctas_per_sm}")
        require(self.attention_split_rule in SPLIT_RULES, "executor.attention_split_rule",
                f"must be one of {', '.join(SPLIT_RULES)}, got {self.attention_split_rule!r}")
        require(self.attention_split_kv_len is None or self.attention_split_kv_len >= 1,
                "executor.attention_split_kv_len",
                f"must be >= 1 or null, got {self.attention_split_kv_len}")
        require(self.attention_decode_placement in DECODE_PLACEMENTS,
                "executor.attention_decode_placement",
                f"must be one of {', '.join(DECODE_PLACEMENTS)}, got "
                f"{self.attention_decode_placement!r}")
        for f in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, f)
            require(v is None or 0 < v <= 1, f"executor.{f}", f"must be in (0, 1], got {v}")
        for f in ("attention_efficiency", "kv_read_efficiency", "elementwise_efficiency"):
            v = getattr(self, f)
            require(0 < v <= 1, f"executor.{f}", f"must be in (0, 1], got {v}")
        require(0 < self.step_time_factor <= MAX_STEP_TIME_FACTOR, "executor.step_time_factor",
                f"must be in (0, {MAX_STEP_TIME_FACTOR:g}], got {self.step_time_factor}")
        require(self.roofline_sharpness is None or self.roofline_sharpness >= 1,
                "executor.roofline_sharpness",
                f"must be >= 1 or null (max), got {self.roofline_sharpness}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModelConfig:
        require_known_fields(data, cls, "executor", "option for the cost model")
        return cls(**typed_fields(cls, data, "executor"))


class RooflineCostModel(Executor):
    """Prices a step's drivers (``executors/step_terms.py``) from the hardware spec, or from
    calibrated ``coefficients`` (a fitted hardware profile) when given."""

    closed_form_decode = True
    prices_on_arrays = True

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tensor_parallel: int = 1,
                 config: CostModelConfig | None = None, block_size: int = 16,
                 coefficients: Coefficients | None = None, num_sms: int | None = -1,
                 pipeline_parallel: int = 1, attention_tile: int = ATTENTION_TILE,
                 split_rule: str | None = None, split_kv_len: int | None = -1,
                 decode_placement: str | None = None) -> None:
        """``num_sms``, ``attention_tile``, ``split_rule``, ``split_kv_len`` and
        ``decode_placement`` describe the kernels a fitted profile was measured with (-1 /
        None: the hardware's and the config's)."""
        # The heads must split over the ranks (vLLM's rule; one home in the model spec).
        model.check_tensor_parallel(tensor_parallel)
        require(pipeline_parallel >= 1, "cluster.pipeline_parallel_size",
                f"must be >= 1, got {pipeline_parallel}")
        require(pipeline_parallel <= model.num_layers, "cluster.pipeline_parallel_size",
                f"{pipeline_parallel} stages for {model.name}'s {model.num_layers} layers")
        self.model = model
        self.hardware = hardware
        self.tp = tensor_parallel
        self.pp = pipeline_parallel
        self.config = c = config or CostModelConfig()
        self.network = load_network(hardware, c.network)
        self.block_size = block_size
        # num_sms: the hardware's unless a fitted profile says what it was fitted with.
        sms = hardware.num_sms if num_sms == -1 else num_sms
        self.decomposer = StepDecomposer(
            model, tensor_parallel, block_size, sms, c.attention_ctas_per_sm, pipeline_parallel,
            attention_tile, split_rule or c.attention_split_rule,
            c.attention_split_kv_len if split_kv_len == -1 else split_kv_len,
            decode_placement or c.attention_decode_placement)
        ce = c.compute_efficiency or hardware.compute_efficiency
        me = c.memory_efficiency or hardware.memory_efficiency
        bw = hardware.memory_bandwidth_gbps * 1e9 * me  # achievable bytes/s
        # Host time per step: the per-request price on the first per_seq_overhead_max_seqs
        # requests only (Coefficients' first-requests price), all of it 1/N per step under
        # multi-step scheduling (N = 1 divides exactly: the same floats).
        n_sched = c.num_scheduler_steps
        s_seq = c.per_seq_overhead_us * 1e-6 / n_sched
        capped = c.per_seq_overhead_max_seqs is not None and s_seq > 0
        self.roofline = Coefficients(
            s_per_step=c.step_overhead_ms * 1e-3 / n_sched,
            s_per_seq=0.0 if capped else s_seq,
            s_per_first_seq=s_seq if capped else 0.0,
            seq_knee=c.per_seq_overhead_max_seqs if capped else 0,
            s_per_token=0.0,  # element-wise work is priced by its bytes (below)
            s_per_flop=1.0 / (hardware.peak_flops(model.weight_dtype) * ce),
            s_per_weight_byte=1.0 / bw,
            s_per_attn_flop=1.0 / (hardware.peak_tflops_fp16 * 1e12 * ce * c.attention_efficiency),
            s_per_diag_flop=1.0 / (hardware.peak_tflops_fp16 * 1e12 * ce * c.attention_efficiency),
            s_per_kv_byte=1.0 / (bw * c.kv_read_efficiency),
            # One decode thread block streams at its SM's share of the paged-KV bandwidth; an
            # SM's resident blocks overlap fully (only a fit can tell by how much less).
            s_per_cta_byte=hardware.num_sms / (bw * c.kv_read_efficiency),
            s_per_sm_byte=hardware.num_sms / (bw * c.kv_read_efficiency * c.attention_ctas_per_sm),
            s_per_attn_wave=c.attention_wave_us * 1e-6,
            s_per_attn_kernel=c.attention_kernel_us * 1e-6,
            # A split-KV partial (the query rows of one KV head x (head dim + 1 log-sum-exp)
            # in fp32, ~4 KB at 8 query heads per KV head) is written once and read once:
            # nanoseconds at HBM bandwidth, inside the combine kernel's own floor
            # (attention_kernel_us, charged per combine kernel), so the roofline adds nothing.
            s_per_split_partial=0.0,
            # The streaming bounds above already price each tile at its bytes, load latency
            # included at steady state; the per-iteration latency on top is what only a fit
            # to a measured profile can separate, so the roofline leaves it at 0.
            s_per_kv_tile=0.0,
            sharpness=math.inf if c.roofline_sharpness is None else c.roofline_sharpness,
        )
        if coefficients is not None and n_sched > 1:  # a profile's host prices, 1/N per step
            coefficients = replace(coefficients, **{
                f: getattr(coefficients, f) / n_sched
                for f in ("s_per_step", "s_per_seq", "s_per_first_seq")})
        self._coefficients = coefficients or self.roofline
        self.host_overlap = bool(c.host_overlap)
        # Element-wise bytes stay priced by bandwidth unless a profile fitted s_per_token.
        self._ew_s_per_byte = (None if coefficients is not None
                               else 1.0 / (bw * c.elementwise_efficiency))
        if c.step_time_factor != 1.0:  # 1 keeps the prices' own floats
            self._coefficients = self._coefficients.scaled(c.step_time_factor)
            if self._ew_s_per_byte is not None:
                self._ew_s_per_byte *= c.step_time_factor
        self._pcie_bw = hardware.pcie_bandwidth_gbps * 1e9
        self._pcie_lat = hardware.pcie_latency_us * 1e-6
        # Memoized terms of ``duration`` (see there).
        self._per_tokens: dict[int, tuple[float, float, float, float]] = {}
        self._prefill_consts: tuple | None = None
        self._lm_head: dict[int, float] = {}
        self._overhead: dict[tuple[int, bool], float] = {}
        self._decode_consts: dict[int, tuple] = {}
        self._decode_split_consts: dict[tuple[int, int, int], tuple] = {}
        self._decode_curves: dict[tuple, tuple] = {}
        self._step_pricers: dict[int, Callable[[int, int], float] | None] = {}
        # Durations of steps without decode rows, by shape: a prompt-only step's shape
        # repeats with its prompt length (a few thousand shapes per run, unlike decode
        # contexts, which grow every step); at most NO_DECODE_SHAPES_KEPT of them (~26 MB).
        self._no_decode: dict[StepShape, float] = {}

    @property
    def coefficients(self) -> Coefficients:
        return self._coefficients

    @coefficients.setter
    def coefficients(self, value: Coefficients) -> None:
        self._coefficients = value
        self._clear_terms()

    def _clear_terms(self) -> None:
        self._per_tokens.clear()
        self._prefill_consts = None
        self._lm_head.clear()
        self._overhead.clear()
        self._decode_consts.clear()
        self._decode_split_consts.clear()
        self._decode_curves.clear()
        self._step_pricers.clear()
        self._no_decode.clear()

    # ---- Executor interface -------------------------------------------------------------
    def weight_bytes(self) -> float:
        return self.model.weight_bytes(self.tp, self.pp)

    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        return activation_reserve_bytes(self.model, max_num_batched_tokens, max_num_seqs, self.tp)

    def execute(self, plan: StepPlan) -> StepResult:
        shape = step_shape(plan)
        if shape.num_decode:
            return StepResult(self.duration(shape))
        seconds = self._no_decode.get(shape)
        if seconds is None:
            seconds = self.duration(shape)
            if len(self._no_decode) < NO_DECODE_SHAPES_KEPT:
                self._no_decode[shape] = seconds
        return StepResult(seconds)

    # ---- the model ----------------------------------------------------------------------
    def breakdown(self, plan: StepPlan) -> StepBreakdown:
        return self.breakdown_shape(step_shape(plan))

    def breakdown_shape(self, shape: StepShape) -> StepBreakdown:
        """Seconds per term for a step of this shape. ``overhead`` is the host time the step
        adds: all of it, or with ``host_overlap`` what exceeds the GPU's time (the other
        terms), so that ``total`` is max(GPU, host)."""
        b = self._breakdown_raw(shape)
        if self.host_overlap:
            gpu = (b.linear + b.attention_prefill + b.attention_decode + b.elementwise
                   + b.lm_head + b.communication + b.pipeline)
            b.overhead = _exposed(b.overhead, gpu + b.swap)
        return b

    def _breakdown_raw(self, shape: StepShape) -> StepBreakdown:
        """``breakdown_shape`` with the whole host time in ``overhead`` (no overlap)."""
        d = self.decomposer.drivers(shape)
        b = self.coefficients.breakdown(d, self._ew_s_per_byte)
        if shape.num_tokens and (self.tp > 1 or self.pp > 1):
            msg = shape.num_tokens * self.model.hidden_size * self.model.act_bytes
            if self.tp > 1:  # two all-reduces per layer (fitted NCCL timings, conf/network)
                b.communication = d.comm_calls * self.network.all_reduce(msg, self.tp)
            if self.pp > 1:  # the hidden states cross PP - 1 stage boundaries
                b.pipeline = (self.pp - 1) * self.network.send_recv(msg)
        if d.swap_calls:
            b.swap = d.swap_calls * self._pcie_lat + d.swap_bytes / self._pcie_bw
        return b

    def decode_durations(self, plan: StepPlan, num_steps: int) -> np.ndarray:
        """Durations of ``num_steps`` consecutive steps in which every row of this decode-only
        plan advances by one token (each context grows by one per step), evaluated with the
        same terms as ``execute`` (the decode context enters as an array). Where the decode
        geometry depends on the longest context (a FlashAttention split below 0.8 x the SM
        count), the steps are priced in runs of one geometry."""
        block = plan.decode_block
        if block is not None and not (plan.swap_out or plan.swap_in or plan.num_offload_loads):
            # A decode run's step (one block, nothing else): its shape's decode terms alone.
            return self.decode_run_durations(*block_decode_context(block), num_steps)
        shape = step_shape(plan)
        nd = shape.num_decode
        if not (nd == shape.num_tokens == shape.num_rows == shape.num_sampled) or (
                shape.swap_out_blocks or shape.swap_in_blocks):
            runs = self._geometry_runs(nd, shape.decode_max_ctx, num_steps)
            steps = np.arange(num_steps, dtype=np.int64)
            ctx, mx = shape.decode_ctx + nd * steps, shape.decode_max_ctx + steps
            if runs is None:
                return self.duration(shape._replace(decode_ctx=ctx, decode_max_ctx=mx))
            return np.concatenate([self.duration(shape._replace(
                decode_ctx=ctx[i:j], decode_max_ctx=mx[i:j])) for i, j, _ in runs])
        return self.decode_run_durations(nd, shape.decode_ctx, shape.decode_max_ctx, num_steps)

    def decode_run_durations(self, num_decode: int, ctx: int, max_ctx: int,
                             num_steps: int) -> np.ndarray:
        """Durations of ``num_steps`` decode-only steps of ``num_decode`` rows (each computes
        and samples one token) whose contexts, new token included, total ``ctx`` in the first
        step (the longest ``max_ctx``) and grow by one per row per step.

        Everything but decode attention is the same every step, and decode attention is
        affine in the steps inside each roofline bound (and each run of one decode geometry);
        evaluated with its constants folded (equal to the term-by-term sum to rounding,
        ~1e-16 relative)."""
        nd = num_decode
        curve = self._decode_curves.get((nd, None))
        if curve is None and not (nd and self.decomposer.decode_splits_vary(nd)):
            curve = self._run_curve(nd, None)
        if curve is not None:  # one geometry for every step (the common case: one call)
            if num_steps == 1 and curve.keys_are_mx and not curve.a_tile:
                return self._decode_step(curve, float(ctx), float(max_ctx))
            # A float arange of integers holds them exactly (start + i x step, < 2^53): the
            # same contexts as ctx + nd x arange in one call.
            ctxs = (np.arange(float(ctx), float(ctx + nd * num_steps), float(nd)) if nd
                    else np.full(num_steps, float(ctx)))
            return self._decode_run(curve, ctxs,
                                    np.arange(float(max_ctx), float(max_ctx + num_steps)))
        runs = self._geometry_runs(nd, max_ctx, num_steps)
        steps = np.arange(num_steps, dtype=np.float64)
        ctx = ctx + nd * steps
        mx = max_ctx + steps
        return np.concatenate([self._decode_run(self._run_curve(nd, key), ctx[i:j], mx[i:j])
                               for i, j, key in runs])

    def decode_stretch_durations(self, stretches: list[tuple[int, int, int, int]],
                                 ) -> list[float]:
        """``decode_run_durations`` of each stretch (num_decode, ctx, max_ctx, num_steps), one
        after the other, as one list: the stretches of a decode jump whose members finish one
        after another. When every stretch has one decode geometry (``_RunCurve.row``), all
        are priced in one pass over (columns x steps) arrays: each step's products, maxima,
        knees and wave-by-wave sums are the ones ``_decode_run`` makes for it (a missing
        second wave adds an exact 0.0), so the same floats in a fraction of the numpy
        calls; otherwise stretch by stretch."""
        if not stretches:
            return []
        if len(stretches) == 1:  # nothing to share: the stretch's own path
            nd, ctx, mx, m = stretches[0]
            return self.decode_run_durations(nd, ctx, mx, m).tolist()
        rows = []
        lens = []
        g0 = 0  # the stretch's first step in the joint array
        curves = self._decode_curves
        for nd, ctx, mx, m in stretches:
            curve = curves.get((nd, None))
            if curve is None:
                if not nd or self.decomposer.decode_splits_vary(nd):
                    return super().decode_stretch_durations(stretches)  # type: ignore[return-value]
                curve = self._run_curve(nd, None)
            row = curve.row
            if row is None:
                return super().decode_stretch_durations(stretches)  # type: ignore[return-value]
            # Step g of the joint array (stretch step g - g0) has total context
            # ctx + nd x (g - g0) and longest context mx + (g - g0): integers, exact as
            # floats, as the stretch's own aranges give them.
            c, b = ctx - nd * g0, mx - g0
            rows.append((*row, c, c, c, c, b, b, nd, nd, nd, nd, 1, 1,
                         *(() if curve.host is None else (curve.host,))))
            lens.append(m)
            g0 += m
        # One row per column: const, the two waves' counts, FLOP slopes, byte slopes and
        # longest-block slopes, Q/O seconds; then the bases and slopes of the contexts the
        # six slopes multiply (the total context four times, the longest twice); with
        # host_overlap, the host seconds.
        x = np.array(rows, dtype=np.float64).T.repeat(lens, axis=1)
        lin = x[3:9] * (x[11:17] + x[17:23] * np.arange(float(g0)))
        byte = lin[2:4]  # rows: each wave's FLOP, byte and longest-block seconds
        byte += x[9:11]
        hbm = np.maximum(byte, lin[4:6], out=byte)
        p = self._coefficients.sharpness
        knees = np.hypot(lin[0:2], hbm) if p == 2.0 else _knee2_arrays(lin[0:2], hbm, p)
        knees *= x[1:3]  # a count of 1.0 (or 0.0: no such wave) times the knee
        out = x[0] + knees[0]
        out += knees[1]
        if self.host_overlap:  # the stretch's host seconds (every curve has them)
            np.maximum(out, x[23], out=out)
        return out.tolist()

    def decode_step_pricer(self, num_decode: int) -> Callable[[int, int], float] | None:
        """The price of one decode-only step of ``num_decode`` rows as a plain-float function
        of the total and the longest context (new token included): the folded run curve of
        ``decode_run_durations`` evaluated per step, with ``math.hypot`` for the p = 2 knee
        (a tenth of numpy's scalar call; it rounds differently from ``np.hypot`` in the last
        bit for ~0.5% of pairs, so a price may differ from ``decode_run_durations``' by an ulp
        or two). Decode jumps price their steps one at a time with it, as far as the
        horizon (sim/fast_forward.py). None where the curve has no plain-float form: a
        decode geometry that varies with the context, a tile term, streaming keys other than
        the longest context, more than two waves, or a knee other than p = 2 or max."""
        pricer = self._step_pricers.get(num_decode, _UNSET)
        if pricer is _UNSET:
            pricer = self._step_pricers[num_decode] = self._make_step_pricer(num_decode)
        return pricer  # type: ignore[return-value]

    def _make_step_pricer(self, nd: int) -> Callable[[int, int], float] | None:
        if not nd or self.decomposer.decode_splits_vary(nd):
            return None
        curve = self._run_curve(nd, None)
        p = self._coefficients.sharpness
        if curve.row is None or p not in (2.0, math.inf):
            return None
        return _step_pricer(curve.const, curve.waves, math.hypot if p == 2.0 else max,
                            curve.host)

    def _geometry_runs(self, nd: int, max_ctx: int, num_steps: int,
                       ) -> list[tuple[int, int, tuple[int, int]]] | None:
        """(start, stop, geometry key) of the runs of steps that share a decode geometry when
        the longest context grows by one per step from ``max_ctx``; None if it never varies."""
        dec = self.decomposer
        if not (nd and dec.decode_splits_vary(nd)):
            return None
        tiles, table = dec.decode_geometry_key(nd, max_ctx + np.arange(num_steps, dtype=np.int64))
        cut = np.flatnonzero((np.diff(tiles) != 0) | (np.diff(table) != 0)) + 1
        bounds = [0, *cut.tolist(), num_steps]
        return [(i, j, (int(tiles[i]), int(table[i]))) for i, j in zip(bounds, bounds[1:])]

    def _run_curve(self, nd: int, key: tuple[int, int] | None) -> _RunCurve:
        """The folded decode-step curve of ``nd`` rows of one decode geometry (``key``),
        memoized."""
        curve = self._decode_curves.get((nd, key))
        if curve is None:
            host = None
            if self.host_overlap:  # GPU terms only (no rows: no host time); host apart
                fixed = self.duration(StepShape(num_tokens=nd, num_sampled=nd))
                host = self._host_time(nd)
            else:
                fixed = self.duration(StepShape(num_tokens=nd, num_sampled=nd, num_rows=nd))
            const, waves, g, a_tile = self._decode_curve(nd, key)
            counts = [w[0] for w in waves]
            col = lambda xs: np.array(xs, dtype=np.float64).reshape(-1, 1)
            curve = self._decode_curves[(nd, key)] = _RunCurve(
                fixed + const, len(waves), col([w[1] for w in waves] + [w[2] for w in waves]),
                col([w[3] for w in waves]), col([w[4] for w in waves]),
                None if all(c == 1.0 for c in counts) else counts, g, a_tile,
                g.exact_keys and not g.cta_tiles, waves, _joint_row(fixed + const, waves, g,
                                                                    a_tile), host)
        return curve

    def _decode_step(self, curve: _RunCurve, ctx: float, mx: float) -> np.ndarray:
        """``_decode_run`` of one step (one stretch in eight) in plain floats
        (``_step_pricer``'s arithmetic, with numpy's own hypot on two floats: Python's
        math.hypot rounds differently), so the same float. Curves whose keys are the longest
        context and with no tile term."""
        p = self._coefficients.sharpness
        if p not in (2.0, math.inf):  # the generic p-norm: leave it to the array path
            return self._decode_run(curve, np.array([ctx]), np.array([mx]))
        knee = _np_hypot if p == 2.0 else max
        return np.array([_step_pricer(curve.const, curve.waves, knee, curve.host)(ctx, mx)])

    def _decode_run(self, curve: _RunCurve, ctx: np.ndarray, mx: np.ndarray) -> np.ndarray:
        """Durations of decode-only steps of one ``_run_curve`` at total contexts ``ctx`` and
        longest contexts ``mx``. All waves in one pass of (waves x steps) arrays: the same
        products, sums, maxima and knees per element as one wave at a time, so the same
        floats, in a third of the numpy calls (most jumps price a few steps)."""
        out, nw, a_lin, b_byte, a_max, counts, g, a_tile, keys_are_mx, _, _, host = curve
        keys = mx if keys_are_mx else self.decomposer.decode_stream_keys(g, mx)
        lin = a_lin * ctx  # rows: each wave's FLOP seconds, then each wave's byte seconds
        flop, byte = lin[:nw], lin[nw:]
        byte += b_byte
        knees = _knee2_arrays(flop, np.maximum(byte, a_max * keys, out=byte),
                       self._coefficients.sharpness)
        for w in range(nw):  # wave by wave, in order: the sum's rounding is the same
            out = out + (knees[w] if counts is None else counts[w] * knees[w])
        if a_tile:
            out = out + a_tile * self.decomposer.decode_cta_keys(g, mx)
        if host is not None:
            out = np.maximum(out, host)
        return out

    def _decode_curve(self, nd: int, key: tuple[int, int] | None,
                      ) -> tuple[float, list[tuple[float, ...]], DecodeGeometry, float]:
        """Decode attention for ``nd`` rows of one geometry as (constant seconds, [(wave
        count, s per context token of FLOPs, s per context token of bytes, s of Q/O bytes,
        s per key of the longest block)] for the full waves and the tail wave, geometry,
        s per key of the longest block along the busiest SM's tile loops)."""
        (c_flops, c_kv, c_q, L, c_cta, g, kernels, wave_count, partials,
         chain) = self._decode_constants(nd, key)
        c = self.coefficients
        const = (c.s_per_attn_kernel * kernels + c.s_per_attn_wave * wave_count
                 + c.s_per_split_partial * partials)
        a_tile = c.s_per_kv_tile * chain
        waves = []
        cta = c.s_per_cta_byte * c_cta
        for count, share, per_sm in ((g.full, g.slots, self.decomposer.ctas_per_sm),
                                     (1 if g.rem else 0, g.rem, g.tail_sm)):
            if not count:
                continue
            f = share / g.ctas
            waves.append((float(count), c.s_per_attn_flop * c_flops * f,
                          c.s_per_kv_byte * L * c_kv * f, c.s_per_kv_byte * L * c_q * f,
                          max(cta, c.s_per_sm_byte * per_sm * c_cta)))
        return const, waves, g, a_tile

    # ---- the same total, term by term with memoized terms (the simulator's hot path) --------
    def duration(self, shape: StepShape) -> float | np.ndarray:
        """``breakdown_shape(shape).total``, bit for bit, in a fraction of the time: the terms
        that depend on one small integer (tokens, sampled rows, rows) are computed once per
        value by ``breakdown_shape`` itself; prefill and decode attention repeat its
        arithmetic with the constants hoisted (``decode_ctx`` and ``decode_max_ctx`` may be
        arrays). tests/test_decode_run.py checks the equality."""
        n = shape.num_tokens
        per_n = self._per_tokens.get(n)
        if per_n is None:
            per_n = self._per_tokens[n] = self._token_terms(n)
        linear, elementwise, communication, pipeline = per_n
        prefill = self._prefill_attention(shape) if shape.num_prefill else 0.0
        decode = (self._decode_attention(shape.num_decode, shape.decode_ctx,
                                         shape.decode_max_ctx) if shape.num_decode else 0.0)
        lm_head = self._lm_head.get(shape.num_sampled)
        if lm_head is None:
            lm_head = self._lm_head[shape.num_sampled] = self.breakdown_shape(
                StepShape(num_sampled=shape.num_sampled)).lm_head
        swaps = shape.swap_out_blocks or shape.swap_in_blocks
        overhead = self._host_time(shape.num_rows, bool(swaps))
        swap = 0.0
        if swaps:
            swap = self.breakdown_shape(StepShape(swap_out_blocks=shape.swap_out_blocks,
                                                  swap_in_blocks=shape.swap_in_blocks)).swap
        # StepBreakdown.total's order, so the sum is the same float.
        if self.host_overlap:
            gpu = linear + prefill + decode + elementwise + lm_head + communication + pipeline
            return gpu + _exposed(overhead, gpu + swap) + swap
        return (linear + prefill + decode + elementwise + lm_head + communication + pipeline
                + overhead + swap)

    def _host_time(self, num_rows: int, swaps: bool = False) -> float:
        """The whole host time of a step of ``num_rows`` requests (memoized)."""
        key = (num_rows, swaps)
        overhead = self._overhead.get(key)
        if overhead is None:
            overhead = self._overhead[key] = self._breakdown_raw(
                StepShape(num_rows=num_rows, swap_out_blocks=int(swaps))).overhead
        return overhead

    def _token_terms(self, n: int) -> tuple[float, float, float, float]:
        """(linear, elementwise, communication, pipeline) seconds of a step of ``n`` tokens:
        ``breakdown_shape(StepShape(num_tokens=n))``'s terms. On one GPU (no communication)
        with the same operations in the same order (StepDecomposer.drivers and
        Coefficients.breakdown) without building the whole breakdown: a prefill step's token
        count is new to the memo about once per 5 prefill steps in a 10k-request run."""
        if not n or self.tp > 1 or self.pp > 1:
            b = self.breakdown_shape(StepShape(num_tokens=n))
            return b.linear, b.elementwise, b.communication, b.pipeline
        dec, c = self.decomposer, self._coefficients
        L = dec.layers
        linear = knee2(c.s_per_flop * (L * n * dec._lin_flops_per_token),
                       c.s_per_weight_byte * (L * (dec._lin_weight_bytes
                                                   + n * dec._lin_act_bytes_per_token)),
                       c.sharpness)
        if self._ew_s_per_byte is None:
            elementwise = c.s_per_token * float(n)
        else:
            elementwise = self._ew_s_per_byte * (L * n * dec._ew_bytes_per_token)
        return linear, elementwise, 0.0, 0.0

    def _prefill_attention(self, s: StepShape) -> float:
        """``breakdown_shape(s).attention_prefill`` (StepDecomposer.drivers and
        Coefficients.breakdown, the same operations in the same order)."""
        k = self._prefill_consts
        if k is None:
            dec = self.decomposer
            m, L = dec.model, dec.layers
            k = self._prefill_consts = (L * 4.0 * dec._heads * m.head_dim, L,
                                        2 * dec._kv_width * dec._kvb,
                                        2 * dec._heads * m.head_dim * dec._ab, float(L),
                                        dec.attention_tile == 1)
        c_flops, L, c_kv, c_q, kernels, untiled = k
        c = self._coefficients
        if untiled:  # torch reference attention: no query tiles
            prefix, diag_pairs = s.prefill_prefix_pairs_exact, s.prefill_diag_pairs_exact
        else:
            prefix, diag_pairs = s.prefill_prefix_pairs, s.prefill_diag_pairs
        flops = c_flops * prefix
        diag = c_flops * diag_pairs
        nbytes = L * (c_kv * s.prefill_kv_tokens + c_q * s.prefill_q_tokens)
        return knee2(c.s_per_attn_flop * flops + c.s_per_diag_flop * diag,
                     c.s_per_kv_byte * nbytes, c.sharpness) + c.s_per_attn_kernel * kernels \
            + c.s_per_prefill_row * float(L * s.num_prefill)

    def _decode_attention(self, nd: int, ctx, max_ctx):
        """``breakdown_shape(...).attention_decode`` for ``nd`` decode rows of total context
        ``ctx`` and longest context ``max_ctx`` (StepDecomposer.drivers and
        Coefficients.breakdown, the same operations in the same order). Arrays of steps
        must share one decode geometry (``decode_durations`` cuts them into such runs)."""
        k = self._decode_consts.get(nd)
        if k is None:
            dec = self.decomposer
            if dec.decode_splits_vary(nd):  # memoized per (rows, tiles, table tiles)
                m = max_ctx if not isinstance(max_ctx, np.ndarray) else int(max_ctx[0])
                key = (nd, *dec.decode_geometry_key(nd, m))
                k = self._decode_split_consts.get(key)
                if k is None:
                    k = self._decode_split_consts[key] = self._decode_constants(nd, key[1:])
            else:
                k = self._decode_consts[nd] = self._decode_constants(nd, None)
        c_flops, c_kv, c_q, L, c_cta, g, kernels, wave_count, partials, chain = k
        c = self._coefficients
        p = c.sharpness
        total_flops = c_flops * ctx
        total_bytes = L * (c_kv * ctx + c_q)
        cta_bytes = c_cta * self.decomposer.decode_stream_keys(g, max_ctx)
        decode = c.s_per_attn_kernel * kernels
        cta = c.s_per_cta_byte * cta_bytes
        # One step (plain numbers, the per-step hot path) or an array of steps (knee, _max).
        scalar = not isinstance(ctx, np.ndarray) and not isinstance(max_ctx, np.ndarray)
        if g.full:
            flop = c.s_per_attn_flop * (total_flops * g.slots / g.ctas)
            hbm = c.s_per_kv_byte * (total_bytes * g.slots / g.ctas)
            sm = c.s_per_sm_byte * (self.decomposer.ctas_per_sm * cta_bytes)
            decode = decode + float(g.full) * (
                knee2(flop, max(hbm, cta, sm), p) if scalar
                else knee(flop, _max(hbm, cta, sm), sharpness=p))
        if g.rem:
            flop = c.s_per_attn_flop * (total_flops * g.rem / g.ctas)
            hbm = c.s_per_kv_byte * (total_bytes * g.rem / g.ctas)
            sm = c.s_per_sm_byte * (g.tail_sm * cta_bytes)
            decode = decode + (knee2(flop, max(hbm, cta, sm), p) if scalar
                               else knee(flop, _max(hbm, cta, sm), sharpness=p))
        decode = decode + c.s_per_attn_wave * wave_count
        decode = decode + c.s_per_split_partial * partials
        if chain and c.s_per_kv_tile:  # adding a zero term would give the same float
            decode = decode + c.s_per_kv_tile * (chain * self.decomposer.decode_cta_keys(
                g, max_ctx))
        return decode

    def _decode_constants(self, nd: int, key: tuple[int, int] | None) -> tuple:
        """Constants of decode attention for ``nd`` rows; ``key``: the geometry key
        (``StepDecomposer.decode_geometry_key``), None where the geometry does not vary."""
        dec = self.decomposer
        m, L = dec.model, dec.layers
        d, hq, kvw, kvb, ab = m.head_dim, dec._heads, dec._kv_width, dec._kvb, dec._ab
        g = dec.decode_wave_geometry(nd, key=key)
        kernels = float(L) * (2 if g.splits > 1 else 1)  # the split-KV combine kernel
        partials = dec.decode_partials(nd, g)
        chain = dec.decode_chain_per_key(g)
        return (L * 4.0 * hq * d, 2 * kvw * kvb, 2 * hq * d * ab * nd, L, L * 2 * d * kvb,
                g, kernels, float(L * (g.full + (g.rem > 0))), partials, chain)


class _RunCurve(NamedTuple):
    """Decode-only steps of one batch size and decode geometry as a function of the total
    and the longest context (``RooflineCostModel._run_curve``); W waves of thread blocks."""

    const: float  # seconds that do not depend on the contexts (all but the waves' knees)
    num_waves: int  # W
    a_lin: np.ndarray  # (2W, 1): s per context token of each wave's FLOPs, then of its bytes
    b_byte: np.ndarray  # (W, 1): s of each wave's Q/O bytes
    a_max: np.ndarray  # (W, 1): s per key of the longest block (one block or busiest SM)
    counts: list[float] | None  # wave counts (None: all 1)
    geometry: DecodeGeometry
    a_tile: float  # s per key of the longest block along the tile chain
    keys_are_mx: bool  # the streaming keys are the longest context itself
    waves: list[tuple[float, ...]]  # (count, the four above) per wave, as plain floats
    # const, then per wave (two, a missing second one all zeros) its count, FLOP slope, byte
    # slope, longest-block slope and Q/O seconds, column by column: the curve's columns in
    # ``decode_stretch_durations``; None where that cannot price it (a tile term, streaming
    # keys other than the longest context, or more than two waves).
    row: tuple[float, ...] | None
    # With host_overlap: the host seconds a step takes at least (its price is max(GPU, host),
    # ``const`` holding GPU seconds only); None: the host time is in ``const``.
    host: float | None = None


def _joint_row(const: float, waves: list[tuple[float, ...]], g: DecodeGeometry,
               a_tile: float) -> tuple[float, ...] | None:
    if a_tile or not (g.exact_keys and not g.cta_tiles) or not 1 <= len(waves) <= 2:
        return None
    a, b = [*waves, (0.0, 0.0, 0.0, 0.0, 0.0)][:2]
    return (const, a[0], b[0], a[1], b[1], a[2], b[2], a[4], b[4], a[3], b[3])


_UNSET = object()


def _np_hypot(x: float, y: float) -> float:
    return float(np.hypot(x, y))


def _step_pricer(const: float, waves: list[tuple[float, ...]],
                 knee: Callable[[float, float], float],
                 host: float | None = None) -> Callable[[int, int], float]:
    """``_decode_run``'s arithmetic for one step in plain floats, wave by wave in its order:
    per wave (count, FLOP slope, byte slope, Q/O seconds, longest-block slope), the knee of
    the FLOP seconds and the larger of the byte and longest-block seconds, times the count
    (a count of 1.0 multiplies exactly), added to the constant; with ``host`` (overlapped
    host seconds) the larger of that and the host time. Integer contexts convert to floats
    exactly, as numpy's float aranges of them do."""
    gpu = _gpu_step_pricer(const, waves, knee)
    if host is None:
        return gpu

    def overlapped(ctx: int, mx: int) -> float:
        g = gpu(ctx, mx)
        return max(g, host)
    return overlapped


def _exposed(host: float | np.ndarray, gpu: float | np.ndarray) -> float | np.ndarray:
    """The host seconds a step adds to ``gpu`` seconds when the two overlap: what the host
    time exceeds it by (0 when the GPU takes longer)."""
    if isinstance(host, np.ndarray) or isinstance(gpu, np.ndarray):
        return np.maximum(host - gpu, 0.0)
    return host - gpu if host > gpu else 0.0


def _gpu_step_pricer(const: float, waves: list[tuple[float, ...]],
                     knee: Callable[[float, float], float]) -> Callable[[int, int], float]:
    if len(waves) == 1:
        (c0, f0, b0, q0, m0), = waves
        if c0 == 1.0:
            def price(ctx: int, mx: int) -> float:
                byte = b0 * ctx + q0
                keys = m0 * mx
                return const + knee(f0 * ctx, byte if byte >= keys else keys)
        else:
            def price(ctx: int, mx: int) -> float:
                byte = b0 * ctx + q0
                keys = m0 * mx
                return const + c0 * knee(f0 * ctx, byte if byte >= keys else keys)
        return price
    (c0, f0, b0, q0, m0), (c1, f1, b1, q1, m1) = waves

    def price2(ctx: int, mx: int) -> float:
        byte = b0 * ctx + q0
        keys = m0 * mx
        k0 = knee(f0 * ctx, byte if byte >= keys else keys)
        byte = b1 * ctx + q1
        keys = m1 * mx
        k1 = knee(f1 * ctx, byte if byte >= keys else keys)
        return const + (k0 if c0 == 1.0 else c0 * k0) + (k1 if c1 == 1.0 else c1 * k1)
    return price2


def _knee2_arrays(x: np.ndarray, y: np.ndarray, p: float) -> np.ndarray:
    """``knee(x, y, sharpness=p)`` on two arrays, in as few array operations as possible
    (``step_terms.knee2`` is the same on two floats)."""
    if math.isinf(p):
        return np.maximum(x, y)
    if p == 2.0:
        return np.hypot(x, y)
    hi = np.maximum(np.maximum(x, y), 1e-300)
    return hi * ((x / hi) ** p + (y / hi) ** p) ** (1.0 / p)


@EXECUTORS.register("cost_model")
def build_cost_model(model: ModelSpec, hardware: HardwareSpec, tensor_parallel: int,
                     config: dict[str, Any], block_size: int = 16, pipeline_parallel: int = 1,
                     engine_host_overlap: bool = False, **_: Any) -> RooflineCostModel:
    """``executor=cost_model``; ``engine_host_overlap``: the policy's engine default for
    ``host_overlap: null``."""
    cfg = CostModelConfig.from_dict(config)
    if cfg.host_overlap is None:
        cfg = replace(cfg, host_overlap=engine_host_overlap)
    if cfg.profile is not None:
        from executors.calibration import load_profile_for  # scipy-free, but keep it lazy

        prof = load_profile_for(cfg.profile, model, tensor_parallel)
        return RooflineCostModel(model, hardware, tensor_parallel, cfg, block_size=block_size,
                                 coefficients=prof.coefficients,
                                 num_sms=prof.fit.get("num_sms", hardware.num_sms),
                                 pipeline_parallel=pipeline_parallel, **prof.decomposition())
    return RooflineCostModel(model, hardware, tensor_parallel, cfg, block_size=block_size,
                             pipeline_parallel=pipeline_parallel)
