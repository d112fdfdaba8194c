"""One decomposition of a step, shared by the roofline and the calibrated cost model.

::

    StepPlan --step_shape()--> StepShape --StepDecomposer--> StepDrivers --Coefficients--> seconds
    (ids, block tables)        (aggregate ints)              (FLOPs, bytes,     (s per FLOP, per
                                                              tokens, rows)      byte, per token...)

``StepShape`` is what the plan means to a step-time model (how many tokens, rows, attention
pairs...). ``StepDrivers`` turns it into the physical quantities each roofline term is driven by,
summed over layers on one tensor-parallel rank. ``Coefficients`` prices the drivers: the roofline
derives them from the hardware spec, the calibrated cost model fits them to a measured profile
(``executors/calibration.py``). Communication and swap traffic are priced from the spec in both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from sim.plan import StepPlan
from sim.specs import ModelSpec


@dataclass(frozen=True, slots=True)
class StepShape:
    """Aggregate shape of one step: all any step-time model needs to know about a plan."""

    num_tokens: int = 0  # query tokens computed
    num_sampled: int = 0  # rows that sample (LM head rows)
    num_rows: int = 0  # scheduled requests
    prefill_pairs: int = 0  # prefill rows: sum of chunk x (cached + chunk) (query, key) pairs
    prefill_kv_tokens: int = 0  # prefill rows: KV tokens read (cached + chunk)
    prefill_q_tokens: int = 0  # prefill rows: query tokens
    num_prefill: int = 0  # prefill rows
    decode_ctx: int = 0  # decode rows: KV tokens read (context incl. the new token)
    num_decode: int = 0  # decode rows (one query over a non-empty cache)
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0


def step_shape(plan: StepPlan) -> StepShape:
    """The shape of a plan. A row is "decode" exactly when ``ScheduledRequest.is_decode``.

    Prefill attention is counted as the full chunk x (cached + chunk) rectangle: kernels work in
    whole tiles along the causal diagonal, torch's reference attention computes the masked score
    matrix in full, and Vidur's measured A100 FlashAttention profile tracks the rectangle too
    (docs/calibration.md).
    """
    n_tokens = n_sampled = pairs = pf_kv = pf_q = n_pf = dec_ctx = n_dec = 0
    for s in plan.scheduled:
        n = s.num_new_tokens
        n_tokens += n
        n_sampled += s.sample
        if n == 1 and s.start_position > 0:
            dec_ctx += s.start_position + 1
            n_dec += 1
        else:
            ctx = s.start_position + n
            pairs += n * ctx
            pf_kv += ctx
            pf_q += n
            n_pf += 1
    return StepShape(n_tokens, n_sampled, len(plan.scheduled), pairs, pf_kv, pf_q, n_pf,
                     dec_ctx, n_dec, len(plan.swap_out), len(plan.swap_in))


@dataclass(frozen=True, slots=True)
class StepDrivers:
    """Physical drivers of a step's time on one rank, summed over layers."""

    nonempty: float = 0.0  # 1 if the step runs anything (fixed per-step overhead)
    rows: float = 0.0  # per-sequence overhead (input prep, sampling bookkeeping)
    tokens: float = 0.0  # per-token work outside the GEMMs and attention (element-wise ops)
    linear_flops: float = 0.0  # QKV, output, gate/up, down projections
    linear_bytes: float = 0.0  # their weight bytes (+ activations in and out)
    lm_head_flops: float = 0.0  # sampled rows only
    lm_head_bytes: float = 0.0
    prefill_flops: float = 0.0  # attention of prefill rows
    prefill_bytes: float = 0.0  # KV read + Q/O traffic of prefill rows
    decode_flops: float = 0.0
    decode_bytes: float = 0.0
    attn_kernels: float = 0.0  # attention kernel launches (one per layer per kind present)
    elementwise_bytes: float = 0.0  # norms, RoPE, SiLU, residual adds, KV store
    comm_calls: float = 0.0  # all-reduces (TP only)
    comm_bytes: float = 0.0  # ring traffic per rank
    swap_calls: float = 0.0  # swap-out and swap-in batches
    swap_bytes: float = 0.0  # KV bytes over PCIe


class StepDecomposer:
    """Turns a ``StepShape`` into ``StepDrivers`` for one model on ``tensor_parallel`` ranks."""

    def __init__(self, model: ModelSpec, tensor_parallel: int = 1, block_size: int = 16) -> None:
        t, m = tensor_parallel, model
        self.model, self.tp, self.layers = m, t, m.num_layers
        h, a, wb = m.hidden_size, m.act_bytes, m.weight_bytes_per_element
        q, kv, inter = m.q_size // t, max(m.head_dim, m.kv_size // t), m.intermediate_size // t
        # (in_features, out_features) of each projection on one rank
        linears = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
        self._lin_flops_per_token = sum(2.0 * fi * fo for fi, fo in linears)
        self._lin_weight_bytes = sum(fi * fo * wb for fi, fo in linears)
        self._lin_act_bytes_per_token = sum((fi + fo) * a for fi, fo in linears)
        self._heads = m.num_heads // t
        self._kv_width = kv  # kv_heads x head_dim on one rank
        self._kvb = m.kv_bytes_per_element
        self._ab = a
        # Element-wise bytes per token per layer: 2 RMSNorms with residual add (read x and
        # residual, write both), RoPE on q and k (read+write), SiLU-and-mul (read 2I, write I),
        # and the KV store of the new token.
        self._ew_bytes_per_token = a * (2 * 4 * h + 2 * (q + kv) + 3 * inter) + 2 * kv * self._kvb
        self._kv_block_bytes = m.kv_bytes_per_token_per_rank(t) * block_size

    def drivers(self, s: StepShape) -> StepDrivers:
        L, m = self.layers, self.model
        d, hq, kvw, kvb, ab = m.head_dim, self._heads, self._kv_width, self._kvb, self._ab
        n = s.num_tokens
        out: dict[str, float] = {}
        if n:
            out["tokens"] = float(n)
            out["linear_flops"] = L * n * self._lin_flops_per_token
            out["linear_bytes"] = L * (self._lin_weight_bytes + n * self._lin_act_bytes_per_token)
            if s.num_prefill:
                out["prefill_flops"] = L * 4.0 * hq * d * s.prefill_pairs
                out["prefill_bytes"] = L * (2 * kvw * kvb * s.prefill_kv_tokens
                                            + 2 * hq * d * ab * s.prefill_q_tokens)
            if s.num_decode:
                out["decode_flops"] = L * 4.0 * hq * d * s.decode_ctx
                out["decode_bytes"] = L * (2 * kvw * kvb * s.decode_ctx
                                           + 2 * hq * d * ab * s.num_decode)
            out["attn_kernels"] = float(L * ((s.num_prefill > 0) + (s.num_decode > 0)))
            out["elementwise_bytes"] = L * n * self._ew_bytes_per_token
            if self.tp > 1:
                out["comm_calls"] = 2.0 * L
                out["comm_bytes"] = 2.0 * L * 2.0 * (self.tp - 1) / self.tp * n * m.hidden_size * ab
        if s.num_sampled:
            v, h = m.vocab_size // self.tp, m.hidden_size
            out["lm_head_flops"] = 2.0 * s.num_sampled * h * v
            out["lm_head_bytes"] = h * v * 2 + s.num_sampled * (h + v) * 4  # fp32 logits
        if s.num_rows or s.swap_out_blocks or s.swap_in_blocks:
            out["nonempty"] = 1.0
            out["rows"] = float(s.num_rows)
        out["swap_calls"] = float((s.swap_out_blocks > 0) + (s.swap_in_blocks > 0))
        out["swap_bytes"] = (s.swap_out_blocks + s.swap_in_blocks) * self._kv_block_bytes
        return StepDrivers(**out)


@dataclass
class StepBreakdown:
    """Seconds per term for one step (summed over layers)."""

    linear: float = 0.0
    attention_prefill: float = 0.0
    attention_decode: float = 0.0
    elementwise: float = 0.0
    lm_head: float = 0.0
    communication: float = 0.0
    overhead: float = 0.0
    swap: float = 0.0

    @property
    def total(self) -> float:
        return (self.linear + self.attention_prefill + self.attention_decode + self.elementwise
                + self.lm_head + self.communication + self.overhead + self.swap)


def _nonzero(x: float | np.ndarray) -> bool:
    return bool(x.any()) if isinstance(x, np.ndarray) else x != 0


def knee(compute: float, memory: float, sharpness: float) -> float:
    """Roofline of one term: ``max`` when ``sharpness`` is inf, else the p-norm, which rounds
    the ridge where compute and memory traffic are both significant and overlap imperfectly.
    Element-wise over arrays (decode jumps evaluate many steps at once)."""
    if isinstance(compute, np.ndarray) or isinstance(memory, np.ndarray):
        return knee_array(np.asarray(compute, dtype=float), np.asarray(memory, dtype=float),
                          sharpness)
    if math.isinf(sharpness):
        return max(compute, memory)
    if compute == 0.0 or memory == 0.0:
        return compute + memory
    p = sharpness
    hi = max(compute, memory)  # scale first: the p-th powers of tiny seconds underflow
    return hi * ((compute / hi) ** p + (memory / hi) ** p) ** (1.0 / p)


def knee_array(compute: np.ndarray, memory: np.ndarray, sharpness: float) -> np.ndarray:
    if math.isinf(sharpness):
        return np.maximum(compute, memory)
    hi = np.maximum(np.maximum(compute, memory), 1e-300)
    return hi * ((compute / hi) ** sharpness + (memory / hi) ** sharpness) ** (1.0 / sharpness)


#: Coefficient name -> the driver(s) it prices. Knee terms pair a FLOP and a byte coefficient.
COEFFICIENT_DOCS: dict[str, str] = {
    "s_per_step": "fixed overhead of a non-empty step (scheduler, launches, sync)",
    "s_per_seq": "per scheduled request (input preparation, sampling)",
    "s_per_token": "per query token outside GEMMs and attention (element-wise work)",
    "s_per_flop": "per GEMM FLOP (projections and LM head), compute side of their roofline",
    "s_per_weight_byte": "per GEMM byte (weights + activations), memory side of their roofline",
    "s_per_attn_flop": "per attention FLOP, compute side of the attention roofline",
    "s_per_kv_byte": "per attention byte (KV read + Q/O), memory side of the attention roofline",
    "s_per_attn_kernel": "per attention kernel launch (launch, ramp-up and tail floor)",
}


@dataclass(frozen=True)
class Coefficients:
    """Prices of the drivers, in seconds per unit; ``sharpness`` is the roofline knee's p."""

    s_per_step: float = 0.0
    s_per_seq: float = 0.0
    s_per_token: float = 0.0
    s_per_flop: float = 0.0
    s_per_weight_byte: float = 0.0
    s_per_attn_flop: float = 0.0
    s_per_kv_byte: float = 0.0
    s_per_attn_kernel: float = 0.0
    sharpness: float = math.inf

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (v >= 0 and not math.isnan(v)):
                raise ValueError(f"coefficient {f.name} must be >= 0, got {v}")
        if self.sharpness < 1:
            raise ValueError(f"sharpness must be >= 1 (1: compute and memory add), "
                             f"got {self.sharpness}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "sharpness"]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def breakdown(self, d: StepDrivers, tokens_priced_by_bytes: float | None = None,
                  ) -> StepBreakdown:
        """Seconds per term, without communication and swap (priced from the spec).

        ``tokens_priced_by_bytes``: seconds per element-wise byte; when given, element-wise
        work is ``elementwise_bytes x`` it (the roofline) instead of ``tokens x s_per_token``.
        """
        p = self.sharpness
        b = StepBreakdown()
        b.linear = knee(self.s_per_flop * d.linear_flops,
                        self.s_per_weight_byte * d.linear_bytes, p)
        b.lm_head = knee(self.s_per_flop * d.lm_head_flops,
                         self.s_per_weight_byte * d.lm_head_bytes, p)
        b.attention_prefill = knee(self.s_per_attn_flop * d.prefill_flops,
                                   self.s_per_kv_byte * d.prefill_bytes, p)
        b.attention_decode = knee(self.s_per_attn_flop * d.decode_flops,
                                  self.s_per_kv_byte * d.decode_bytes, p)
        # The kernel floor is charged to the attention terms, one per kind present.
        has_prefill, has_decode = _nonzero(d.prefill_flops), _nonzero(d.decode_flops)
        per_layer = d.attn_kernels and self.s_per_attn_kernel * d.attn_kernels / (
            has_prefill + has_decode)
        if has_prefill:
            b.attention_prefill += per_layer
        if has_decode:
            b.attention_decode += per_layer
        if tokens_priced_by_bytes is None:
            b.elementwise = self.s_per_token * d.tokens
        else:
            b.elementwise = tokens_priced_by_bytes * d.elementwise_bytes
        b.overhead = self.s_per_step * d.nonempty + self.s_per_seq * d.rows
        return b


#: Driver columns of the design matrix the fitter uses, in ``predict_array`` order.
DRIVER_COLUMNS = ("nonempty", "rows", "tokens", "linear_flops", "linear_bytes", "lm_head_flops",
                  "lm_head_bytes", "prefill_flops", "prefill_bytes", "decode_flops",
                  "decode_bytes", "attn_kernels")


def driver_matrix(drivers: list[StepDrivers]) -> np.ndarray:
    """Rows of drivers as an (n, len(DRIVER_COLUMNS)) float array."""
    return np.array([[getattr(d, c) for c in DRIVER_COLUMNS] for d in drivers], dtype=float)


def predict_array(x: np.ndarray, X: np.ndarray, sharpness: float) -> np.ndarray:
    """Vectorised ``Coefficients.breakdown(...).total`` (without comm/swap) for fitting.

    ``x`` is in ``Coefficients.names()`` order; ``X`` from ``driver_matrix``.
    """
    step, seq, tok, flop, wbyte, aflop, kvbyte, kern = x
    c = {name: X[:, i] for i, name in enumerate(DRIVER_COLUMNS)}
    return (step * c["nonempty"] + seq * c["rows"] + tok * c["tokens"]
            + knee_array(flop * c["linear_flops"], wbyte * c["linear_bytes"], sharpness)
            + knee_array(flop * c["lm_head_flops"], wbyte * c["lm_head_bytes"], sharpness)
            + knee_array(aflop * c["prefill_flops"], kvbyte * c["prefill_bytes"], sharpness)
            + knee_array(aflop * c["decode_flops"], kvbyte * c["decode_bytes"], sharpness)
            + kern * c["attn_kernels"])
