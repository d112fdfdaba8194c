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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from typing import ClassVar, NamedTuple

import numpy as np

from sim.plan import DecodeBlock, StepPlan
from sim.specs import ModelSpec

#: Query rows per attention tile. FlashAttention-style kernels give each thread block a tile of
#: 64 (or 128) query rows, so a prefill chunk costs whole tiles: Vidur's A100 prefill profile
#: steps every 64 tokens (e.g. chunks of 160 and 192 tokens take the same time).
ATTENTION_TILE = 64
#: Query tiles a ``StepDecomposer`` can price prefill attention in: ``ATTENTION_TILE`` (GPU
#: kernels) or 1 (no tiles: torch's reference attention on a CPU computes each row's exact
#: chunk x context score matrix, so a 65-token prompt costs 65 x 65, not 128 x 128, pairs).
ATTENTION_TILES = (ATTENTION_TILE, 1)


#: How a decode kernel splits each sequence's KV across thread blocks (``StepDecomposer``):
#: ``flash``: FlashAttention's split-KV heuristic (``flash_num_splits``), which Vidur's A100
#: profile was measured with; ``fill``: enough pieces to fill the GPU's block slots.
SPLIT_RULES = ("flash", "fill")
#: FlashAttention splits no KV once the (sequence, KV head) blocks reach this share of the SMs.
FLASH_NO_SPLIT_FILL = 0.8
#: FlashAttention's limit on the pieces of one sequence's KV.
FLASH_MAX_SPLITS = 128
#: Where the ``flash`` rule's decode thread blocks run (``StepDecomposer``): ``launch``: in
#: launch order (a split grid's blocks land next to each other and later blocks take the slots
#: that empty splits free; a tail wave after full waves runs one block per SM; the streaming
#: bounds read the exact keys); ``waves``: the geometry fitted profiles were saved with before
#: (blocks / SMs per wave, whole tiles). Profiles record theirs (``attention_decode_placement``).
DECODE_PLACEMENTS = ("launch", "waves")


def flash_num_splits(units: int, num_sms: int, num_kv_tiles: int,
                     max_splits: int = FLASH_MAX_SPLITS) -> int:
    """FlashAttention-2's split count for ``units`` (sequence, KV head) thread blocks over
    ``num_kv_tiles`` KV tiles on ``num_sms`` SMs (``num_splits_heuristic`` in its
    ``flash_api.cpp``, written out here): no split once the blocks nearly fill the SMs; else
    the smallest split count whose wave efficiency (blocks / SMs over whole waves) is within
    85% of the best one, among counts that change the tiles per split. Float32 arithmetic,
    as the kernel's host code computes it, so ties fall the same way."""
    f32 = np.float32
    if f32(units) >= f32(FLASH_NO_SPLIT_FILL) * f32(num_sms):
        return 1
    top = min(max_splits, num_sms, num_kv_tiles)

    def eligible(s: int) -> bool:  # 64 tiles in 11 or 12 splits are 6 per split either way
        return s == 1 or -(-num_kv_tiles // s) != -(-num_kv_tiles // (s - 1))

    eff: dict[int, float] = {}
    for s in range(1, top + 1):
        if eligible(s):
            waves = f32(units * s) / f32(num_sms)
            eff[s] = float(waves / f32(math.ceil(waves)))
    best = max(eff.values(), default=0.0)
    for s in range(1, top + 1):
        if s in eff and eff[s] >= 0.85 * best:
            return s
    return 1


@lru_cache(maxsize=4096)
def busiest_sm_blocks(units: int, splits: int, working: int, num_sms: int,
                      ctas_per_sm: int) -> int:
    """Working thread blocks on the busiest SM when a split-KV grid of ``units`` x ``splits``
    blocks (a unit's splits next to each other in launch order) runs on ``num_sms`` SMs of
    ``ctas_per_sm`` slots and only the first ``working`` splits of each unit have KV.

    The first ``num_sms x ctas_per_sm`` blocks fill the slots round-robin (block i and
    i + num_sms share an SM); an empty split exits at once and frees its slot, which the next
    block in launch order takes; with no free slot a block waits for the least loaded SM. So
    at 14 sequences x 4 KV heads in 4 splits with only split 0 working, blocks 0 and 112 (both
    split 0) meet on SM 0: two working blocks on one SM, where blocks / SMs says one."""
    n = units * splits
    first = min(n, num_sms * ctas_per_sm)
    count = [0] * num_sms
    free: list[int] = []  # SMs of freed slots, in the order they free
    for i in range(n):
        works = i % splits < working
        if i < first:
            sm = i % num_sms
        elif free:
            sm = free.pop(0)
        else:
            sm = min(range(num_sms), key=count.__getitem__)
        if works:
            count[sm] += 1
        else:
            free.append(sm)
    return max(count)


class DecodeGeometry(NamedTuple):
    """How one decode batch runs (``StepDecomposer.decode_wave_geometry``)."""

    splits: int  # pieces each (sequence, KV head) KV is split into (1: no split)
    slots: int  # thread blocks resident at once (one wave)
    sms: int  # SMs the blocks spread over
    full: int  # full waves
    rem: int  # blocks in the tail wave
    ctas: int  # thread blocks with work (splits past a short context exit at once)
    tile_keys: int  # keys per KV tile (0: blocks read an exact share of the context)
    cta_tiles: int  # KV tiles of the longest block under a split (0: the whole context)
    tail_sm: int  # working blocks the tail wave puts on its busiest SM (0: no tail)
    exact_keys: bool  # streaming bounds over the exact keys (whole tiles: the tile chain only)


class StepShape(NamedTuple):
    """Aggregate shape of one step: all any step-time model needs to know about a plan.
    Immutable and hashable (step-time models memoize on it); a named tuple because one is
    built for every priced step and a frozen dataclass costs several times as much to build.
    ``_replace`` / ``_asdict`` / ``_fields`` stand for ``dataclasses.replace`` / ``asdict`` /
    ``fields``."""

    num_tokens: int = 0  # query tokens computed
    num_sampled: int = 0  # rows that sample (LM head rows)
    num_rows: int = 0  # scheduled requests
    prefill_prefix_pairs: int = 0  # prefill rows: padded chunk x cached (query, key) pairs
    prefill_diag_pairs: int = 0  # prefill rows: padded chunk x padded chunk (the causal square)
    prefill_kv_tokens: int = 0  # prefill rows: KV tokens read (cached + chunk)
    prefill_q_tokens: int = 0  # prefill rows: query tokens
    num_prefill: int = 0  # prefill rows
    decode_ctx: int = 0  # decode rows: KV tokens read (context incl. the new token)
    decode_max_ctx: int = 0  # decode rows: the longest context (the critical thread block)
    num_decode: int = 0  # decode rows (one query over a non-empty cache)
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0  # swap-ins and offload-tier loads (both host -> device, priced alike)
    prefill_prefix_pairs_exact: int = 0  # as prefill_prefix_pairs, chunk not padded (tile 1)
    prefill_diag_pairs_exact: int = 0  # chunk x chunk, not padded (tile 1)


def block_decode_context(block: DecodeBlock) -> tuple[int, int, int]:
    """A decode block's rows as ``step_shape`` counts them: (rows, total context and longest
    context, each with the new token)."""
    n = len(block)
    return n, block.ctx_sum + n, block.ctx_max + 1


def step_shape(plan: StepPlan) -> StepShape:
    """The shape of a plan. A row is "decode" exactly when ``ScheduledRequest.is_decode``.

    Prefill attention is counted in whole query tiles (``ATTENTION_TILE``) over the row's whole
    context: the chunk's padded queries x cached keys (``prefill_prefix_pairs``) plus the padded
    chunk squared (``prefill_diag_pairs``). Kernels work in whole tiles along the causal
    diagonal, torch's reference attention computes the masked score matrix in full, and Vidur's
    measured A100 profile tracks the square, not the triangle; the diagonal is kept apart
    because masked tiles run at their own rate (docs/calibration.md). The ``*_exact`` pairs
    are the same without padding, for a decomposer with ``attention_tile=1``.
    """
    n_tokens = n_sampled = prefix = diag = pf_kv = pf_q = n_pf = dec_ctx = dec_max = n_dec = 0
    n_rows = 0
    prefix_exact = diag_exact = 0
    tile = ATTENTION_TILE
    for s in plan.parts:
        if isinstance(s, DecodeBlock):  # decode rows as columns (sim/decode_run.py)
            n, ctx, mx = block_decode_context(s)
            n_rows += n
            n_tokens += n
            n_sampled += n
            dec_ctx += ctx
            dec_max = max(dec_max, mx)
            n_dec += n
            continue
        n_rows += 1
        n = s.num_new_tokens
        n_tokens += n
        n_sampled += s.sample
        if n == 1 and s.start_position > 0:
            ctx = s.start_position + 1
            dec_ctx += ctx
            if ctx > dec_max:
                dec_max = ctx
            n_dec += 1
        else:
            padded = -(-n // tile) * tile
            prefix += padded * s.start_position
            diag += padded * padded
            prefix_exact += n * s.start_position
            diag_exact += n * n
            pf_kv += s.start_position + n
            pf_q += n
            n_pf += 1
    return StepShape(n_tokens, n_sampled, n_rows, prefix, diag, pf_kv, pf_q, n_pf,
                     dec_ctx, dec_max, n_dec, len(plan.swap_out),
                     len(plan.swap_in) + plan.num_offload_loads,
                     prefix_exact, diag_exact)


@dataclass(frozen=True, slots=True)
class StepDrivers:
    """Physical drivers of a step's time on one rank, summed over layers.

    Decode attention runs in waves of thread blocks (``StepDecomposer`` explains the split):
    ``decode_waves`` full waves of ``decode_wave_*`` work each, then ``decode_tail`` (0 or 1)
    partial wave of ``decode_tail_*`` work. Every wave is bounded by its HBM traffic and FLOPs,
    by one block streaming its KV alone (``decode_cta_bytes``) and by the busiest SM streaming
    the KV of all its resident blocks (``decode_sm_bytes`` / ``decode_tail_sm_bytes``).
    Two costs add to the waves: one per split-KV partial output (``decode_partials``: each
    (sequence, KV head, split) block writes one, the combine kernel reads them all back) and one
    per KV tile iteration along the busiest SM's blocks (``decode_chain_tiles``: a block's
    loop over its tiles waits for each tile's loads in turn).
    """

    nonempty: float = 0.0  # 1 if the step runs anything (fixed per-step overhead)
    rows: float = 0.0  # per-sequence overhead (input prep, sampling bookkeeping)
    tokens: float = 0.0  # per-token work outside the GEMMs and attention (element-wise ops)
    linear_flops: float = 0.0  # QKV, output, gate/up, down projections
    linear_bytes: float = 0.0  # their weight bytes (+ activations in and out)
    lm_head_flops: float = 0.0  # sampled rows only
    lm_head_bytes: float = 0.0
    prefill_flops: float = 0.0  # attention of prefill rows over their cached prefix
    prefill_diag_flops: float = 0.0  # attention of prefill rows over their own chunk
    prefill_bytes: float = 0.0  # KV read + Q/O traffic of prefill rows
    decode_flops: float = 0.0  # totals of decode attention (reporting; waves price them)
    decode_bytes: float = 0.0
    decode_waves: float = 0.0  # full waves of decode thread blocks
    decode_wave_flops: float = 0.0  # one full wave, all layers
    decode_wave_bytes: float = 0.0
    decode_sm_bytes: float = 0.0  # KV the busiest SM streams in a full wave, all layers
    decode_tail: float = 0.0  # 1 if a partial wave follows the full ones
    decode_tail_flops: float = 0.0
    decode_tail_bytes: float = 0.0
    decode_tail_sm_bytes: float = 0.0
    decode_cta_bytes: float = 0.0  # KV of the longest thread block, all layers
    decode_wave_count: float = 0.0  # waves run, all layers (fixed cost per wave)
    prefill_kernels: float = 0.0  # attention kernel launches (one per layer)
    prefill_rows: float = 0.0  # prefill rows, all layers (per-sequence attention set-up)
    decode_kernels: float = 0.0  # one per layer, plus the split-KV combine kernel
    decode_partials: float = 0.0  # split-KV partial outputs written and merged, all layers
    decode_chain_tiles: float = 0.0  # KV tiles the busiest SM's blocks loop over, all layers
    elementwise_bytes: float = 0.0  # norms, RoPE, SiLU, residual adds, KV store
    comm_calls: float = 0.0  # all-reduces (TP only)
    comm_bytes: float = 0.0  # ring traffic per rank
    swap_calls: float = 0.0  # swap-out and swap-in batches
    swap_bytes: float = 0.0  # KV bytes over PCIe


class StepDecomposer:
    """Turns a ``StepShape`` into ``StepDrivers`` for one model on ``tensor_parallel`` ranks.

    Decode attention: a paged decode kernel gives each (sequence, KV head) pair a thread block
    (``units``) and may split each sequence's KV into ``splits`` pieces (a combine kernel then
    merges them). ``split_rule`` picks how many (``SPLIT_RULES``):

    * ``fill``: with fewer units than SMs, enough pieces to fill the ``num_sms x ctas_per_sm``
      slots; a block reads its exact share of the context.
    * ``flash``: FlashAttention's heuristic (``flash_num_splits``) over the KV tiles of
      ``decode_tile_keys`` keys the kernel sees: the block table's width, ``split_kv_len``
      tokens when tables are padded to a fixed width (CUDA graphs; Vidur's profile: its
      ``max_model_len``), else the longest context in whole KV blocks. Blocks read whole
      tiles, each split a run of them; splits past the end of a shorter context do no work.
      Below 0.8 x the SM count the split count then depends on the longest context's tiles
      (``decode_geometry_key``).

    Blocks run in waves of ``slots``: a wave with few blocks is bound by one block's streaming
    rate, a full one by HBM. ``num_sms=None`` (e.g. a CPU) runs every block in one wave.

    Prefill attention is priced over query tiles of ``attention_tile`` rows (one of
    ``ATTENTION_TILES``): ``ATTENTION_TILE`` for GPU kernels, 1 where attention runs untiled.
    """

    def __init__(self, model: ModelSpec, tensor_parallel: int = 1, block_size: int = 16,
                 num_sms: int | None = None, ctas_per_sm: int = 2,
                 pipeline_parallel: int = 1, attention_tile: int = ATTENTION_TILE,
                 split_rule: str = "fill", split_kv_len: int | None = None,
                 decode_placement: str = "launch") -> None:
        if split_rule not in SPLIT_RULES:
            raise ValueError(f"split_rule must be one of {SPLIT_RULES}, got {split_rule!r}")
        if decode_placement not in DECODE_PLACEMENTS:
            raise ValueError(f"decode_placement must be one of {DECODE_PLACEMENTS}, got "
                             f"{decode_placement!r}")
        self.decode_placement = decode_placement
        if split_kv_len is not None and split_kv_len < 1:
            raise ValueError(f"split_kv_len must be >= 1 or None, got {split_kv_len}")
        self.split_rule, self.split_kv_len, self.block_size = split_rule, split_kv_len, block_size
        if attention_tile not in ATTENTION_TILES:
            raise ValueError(f"attention_tile must be one of {ATTENTION_TILES}, got "
                             f"{attention_tile}")
        self.attention_tile = attention_tile
        t, m = tensor_parallel, model
        # Layers a batch crosses: under pipeline parallelism every stage counts as its largest
        # (ceil) share, since stages run in lockstep.
        layers = m.num_layers if pipeline_parallel == 1 else (
            pipeline_parallel * -(-m.num_layers // pipeline_parallel))
        self.model, self.tp, self.layers = m, t, layers
        self.num_sms, self.ctas_per_sm = num_sms, ctas_per_sm
        h, a, wb = m.hidden_size, m.act_bytes, m.weight_bytes_per_element
        q, inter = m.q_size // t, m.intermediate_size // t
        kv = m.head_dim * m.kv_heads_per_rank(t)  # split, or one replicated head per rank
        # (in_features, out_features) of each projection on one rank
        linears = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
        self._lin_flops_per_token = sum(2.0 * fi * fo for fi, fo in linears)
        self._lin_weight_bytes = sum(fi * fo * wb for fi, fo in linears)
        self._lin_act_bytes_per_token = sum((fi + fo) * a for fi, fo in linears)
        self._heads = m.num_heads // t
        self._kv_width = kv  # kv_heads x head_dim on one rank
        self._kv_heads = kv // m.head_dim
        self._kvb = m.kv_bytes_per_element
        self._ab = a
        # Element-wise bytes per token per layer: 2 RMSNorms with residual add (read x and
        # residual, write both), RoPE on q and k (read+write), SiLU-and-mul (read 2I, write I),
        # and the KV store of the new token.
        self._ew_bytes_per_token = a * (2 * 4 * h + 2 * (q + kv) + 3 * inter) + 2 * kv * self._kvb
        self._kv_block_bytes = m.kv_bytes_per_token_per_rank(t, pipeline_parallel) * block_size

    def decode_tile_keys(self) -> int:
        """Keys per KV tile of the split-KV decode kernel (FlashAttention's ``block_n``: 256
        for head dim <= 64, 128 up to 128, 64 above)."""
        d = self.model.head_dim
        return 256 if d <= 64 else 128 if d <= 128 else 64

    def decode_splits_vary(self, num_decode: int) -> bool:
        """True when the decode geometry of ``num_decode`` rows depends on the longest
        context (the ``flash`` rule below 0.8 x the SM count): callers pricing many steps at
        once group them by ``decode_geometry_key`` first."""
        return (self.split_rule == "flash" and self.num_sms is not None
                and num_decode * self._kv_heads < FLASH_NO_SPLIT_FILL * self.num_sms)

    def decode_geometry_key(self, num_decode: int, max_ctx: int) -> tuple[int, int] | None:
        """What the decode geometry depends on besides the batch size: (KV tiles of the
        longest context, KV tiles of the block table the kernel sees) under a split that
        varies with them (``decode_splits_vary``), else None. ``max_ctx`` may be an array:
        then a pair of arrays (callers cut a run of steps where either changes)."""
        if not self.decode_splits_vary(num_decode):
            return None
        bn, bs = self.decode_tile_keys(), self.block_size
        if isinstance(max_ctx, np.ndarray):
            m = max_ctx.astype(np.int64)
            table = np.maximum(self.split_kv_len or 0, -(-m // bs) * bs)
            return -(-m // bn), -(-table // bn)
        m = int(max_ctx)
        return -(-m // bn), -(-max(self.split_kv_len or 0, -(-m // bs) * bs) // bn)

    def decode_wave_geometry(self, num_decode: int, max_ctx: int = 0,
                             key: tuple[int, int] | None = None) -> DecodeGeometry:
        """How a decode batch of ``num_decode`` rows whose longest context is ``max_ctx``
        runs: one thread block per (sequence, KV head) ``unit``, split along the KV by
        ``split_rule``, in waves of ``num_sms x ctas_per_sm`` slots (see the class doc).
        ``key``: ``decode_geometry_key(num_decode, max_ctx)`` when known (then ``max_ctx``
        is not read)."""
        units = num_decode * self._kv_heads
        if self.num_sms is None:  # every block in one (tail) wave, one per SM
            return DecodeGeometry(1, units, units, 0, units, units, 0, 0, 1 if units else 0,
                                  False)
        sms = self.num_sms
        slots = sms * self.ctas_per_sm
        if self.split_rule == "fill":
            splits = max(1, slots // units) if units < sms else 1
            full, rem = divmod(units * splits, slots)
            return DecodeGeometry(splits, slots, sms, full, rem, units * splits, 0, 0,
                                  -(-rem // sms), False)
        bn = self.decode_tile_keys()
        launch = self.decode_placement == "launch"
        if not self.decode_splits_vary(num_decode):  # no split: a block reads whole tiles
            full, rem = divmod(units, slots)
            # After full waves the tail's blocks take slots as they free, one per SM, instead
            # of waiting for a whole wave (the profile has no jump at 82 sequences).
            tail_sm = 1 if launch and full and rem else -(-rem // sms)
            return DecodeGeometry(1, slots, sms, full, rem, units, bn, 0, tail_sm, launch)
        if key is None:
            if isinstance(max_ctx, np.ndarray):
                raise ValueError("decode geometry varies with the context: group the steps "
                                 "by decode_geometry_key first")
            key = self.decode_geometry_key(num_decode, max_ctx)
        # Tiles of the longest context, and of the block table the kernel sees (its width in
        # whole KV blocks, at least split_kv_len tokens when tables are padded to that).
        tiles, n_blocks = key
        splits = flash_num_splits(units, sms, n_blocks)
        per_split = -(-n_blocks // splits)  # tiles each split owns
        working = -(-tiles // per_split)  # splits past the context exit at once
        ctas = units * working
        if launch:  # one pass in launch order; the busiest SM by where the blocks land
            return DecodeGeometry(splits, slots, sms, 0, ctas, ctas, bn, min(per_split, tiles),
                                  busiest_sm_blocks(units, splits, working, sms,
                                                    self.ctas_per_sm), True)
        full, rem = divmod(ctas, slots)
        return DecodeGeometry(splits, slots, sms, full, rem, ctas, bn, min(per_split, tiles),
                              -(-rem // sms), False)

    def decode_cta_keys(self, g: DecodeGeometry, max_ctx):
        """Keys the longest thread block reads: its share of the longest context (``fill``,
        or no SMs known), or its whole KV tiles (``flash``). ``max_ctx`` may be an array."""
        if not g.tile_keys:
            return max_ctx / g.splits
        if g.cta_tiles:
            return float(g.tile_keys * g.cta_tiles)
        if isinstance(max_ctx, np.ndarray):
            return g.tile_keys * np.ceil(max_ctx / g.tile_keys)
        return float(g.tile_keys * -(-int(max_ctx) // g.tile_keys))

    def decode_stream_keys(self, g: DecodeGeometry, max_ctx):
        """Keys the longest thread block streams, as the streaming bounds price them: its
        exact keys (``g.exact_keys``: the longest context, or its split's share of whole
        tiles), else ``decode_cta_keys``. The whole-tile padding is priced by the tile chain
        alone. ``max_ctx`` may be an array."""
        if not g.exact_keys:
            return self.decode_cta_keys(g, max_ctx)
        if isinstance(max_ctx, np.ndarray):
            mx = max_ctx.astype(np.float64)
            return np.minimum(float(g.tile_keys * g.cta_tiles), mx) if g.cta_tiles else mx
        if g.cta_tiles:
            return float(min(g.tile_keys * g.cta_tiles, max_ctx))
        return float(max_ctx)

    def decode_partials(self, num_decode: int, g: DecodeGeometry) -> float:
        """Split-KV partial outputs of a step, all layers: every launched split writes one
        (splits past a short context write an empty one) and the combine kernel reads them
        all back; 0 without a split."""
        if g.splits <= 1:
            return 0.0
        return float(self.layers * num_decode * self._kv_heads * g.splits)

    def decode_chain_per_key(self, g: DecodeGeometry) -> float:
        """KV tile iterations along the busiest SM, all layers, per key of the longest block
        (times ``decode_cta_keys``: the tiles the busiest SM's blocks loop over). The busiest SM
        runs ``ctas_per_sm`` blocks per full wave and ``g.tail_sm`` in the tail wave; their tile
        loops run one tile at a time, each waiting for its K and V loads, so the step pays a
        latency per tile along them. 0 for untiled kernels."""
        if not g.tile_keys:
            return 0.0
        blocks = g.full * self.ctas_per_sm + (g.tail_sm if g.rem else 0)
        return self.layers * blocks / g.tile_keys

    def _decode_waves(self, s: StepShape, out: dict[str, float]) -> None:
        """Decode attention as waves of thread blocks. ``decode_ctx`` and ``decode_max_ctx``
        may be arrays (decode jumps) of steps with one geometry (``decode_geometry_key``);
        the batch size is the same for every step of a jump."""
        L, d, kvb = self.layers, self.model.head_dim, self._kvb
        g = self.decode_wave_geometry(s.num_decode, s.decode_max_ctx)
        total_flops, total_bytes = out["decode_flops"], out["decode_bytes"]
        out["decode_waves"] = float(g.full)
        out["decode_tail"] = float(g.rem > 0)
        out["decode_wave_count"] = float(L * (g.full + (g.rem > 0)))
        # One block's KV (K and V of one head over its share of the longest context).
        cta = L * 2 * d * kvb * self.decode_stream_keys(g, s.decode_max_ctx)
        out["decode_cta_bytes"] = cta
        if g.full:
            out["decode_wave_flops"] = total_flops * g.slots / g.ctas
            out["decode_wave_bytes"] = total_bytes * g.slots / g.ctas
            out["decode_sm_bytes"] = self.ctas_per_sm * cta
        if g.rem:
            out["decode_tail_flops"] = total_flops * g.rem / g.ctas
            out["decode_tail_bytes"] = total_bytes * g.rem / g.ctas
            out["decode_tail_sm_bytes"] = g.tail_sm * cta
        if g.splits > 1:
            out["decode_kernels"] += L  # the combine kernel that merges the split pieces
            out["decode_partials"] = self.decode_partials(s.num_decode, g)
        if g.tile_keys:  # tiled kernels (flash): the busiest SM runs its blocks' tile loops
            out["decode_chain_tiles"] = (self.decode_chain_per_key(g)
                                         * self.decode_cta_keys(g, s.decode_max_ctx))

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
                out["prefill_kernels"] = float(L)
                out["prefill_rows"] = float(L * s.num_prefill)
                if self.attention_tile == 1:
                    prefix, diag = s.prefill_prefix_pairs_exact, s.prefill_diag_pairs_exact
                else:
                    prefix, diag = s.prefill_prefix_pairs, s.prefill_diag_pairs
                out["prefill_flops"] = L * 4.0 * hq * d * prefix
                out["prefill_diag_flops"] = L * 4.0 * hq * d * diag
                out["prefill_bytes"] = L * (2 * kvw * kvb * s.prefill_kv_tokens
                                            + 2 * hq * d * ab * s.prefill_q_tokens)
            if s.num_decode:
                out["decode_flops"] = L * 4.0 * hq * d * s.decode_ctx
                out["decode_bytes"] = L * (2 * kvw * kvb * s.decode_ctx
                                           + 2 * hq * d * ab * s.num_decode)
                out["decode_kernels"] = float(L)
                self._decode_waves(s, out)
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
    pipeline: float = 0.0  # stage-to-stage sends (pipeline parallelism)
    overhead: float = 0.0
    swap: float = 0.0

    @property
    def total(self) -> float:
        return (self.linear + self.attention_prefill + self.attention_decode + self.elementwise
                + self.lm_head + self.communication + self.pipeline + self.overhead
                + self.swap)


def knee(*terms: float | np.ndarray, sharpness: float) -> float | np.ndarray:
    """Roofline of one term over its bounds (compute, memory, latency...): ``max`` when
    ``sharpness`` is inf, else their p-norm, which rounds the ridge where several bounds are
    significant and overlap imperfectly. Element-wise over arrays (decode jumps, fitting)."""
    for t in terms:  # a plain loop: the pricing hot path calls this with two floats
        if isinstance(t, np.ndarray):
            return knee_array([np.asarray(t, dtype=float) for t in terms], sharpness)
    if len(terms) == 2:
        return knee2(terms[0], terms[1], sharpness)
    hi = max(terms)
    if math.isinf(sharpness) or hi == 0.0:
        return hi
    p = sharpness  # scale first: the p-th powers of tiny seconds underflow
    return hi * sum((t / hi) ** p for t in terms) ** (1.0 / p)


def knee2(x: float, y: float, p: float) -> float:
    """``knee(x, y, sharpness=p)`` for two floats (the per-step pricing hot path): the
    p-norm's sum unrolled, 0 + a + b being a + b, so the same float as ``sum``."""
    hi = max(x, y)
    if hi == 0.0 or p == math.inf:
        return hi
    return hi * ((x / hi) ** p + (y / hi) ** p) ** (1.0 / p)


def knee_array(terms: list[np.ndarray], sharpness: float) -> np.ndarray:
    hi = terms[0]
    for t in terms[1:]:
        hi = np.maximum(hi, t)
    if math.isinf(sharpness):
        return hi
    hi = np.maximum(hi, 1e-300)
    return hi * sum((t / hi) ** sharpness for t in terms) ** (1.0 / sharpness)


#: Coefficient name -> what it prices. Knee terms combine a FLOP, a byte and latency bounds.
COEFFICIENT_DOCS: dict[str, str] = {
    "s_per_step": "fixed overhead of a non-empty step (scheduler, launches, sync)",
    "s_per_seq": "per scheduled request (input preparation, sampling)",
    "s_per_first_seq": "per scheduled request among a step's first seq_knee, on top of s_per_seq "
                       "(per-request set-up that a larger batch amortizes)",
    "s_per_token": "per query token outside GEMMs and attention (element-wise work)",
    "s_per_flop": "per GEMM FLOP (projections and LM head), compute side of their roofline",
    "s_per_weight_byte": "per GEMM byte (weights + activations), memory side of their roofline",
    "s_per_attn_flop": "per attention FLOP over cached keys (prefill prefix, decode)",
    "s_per_diag_flop": "per attention FLOP of a prefill chunk over itself (causal square)",
    "s_per_kv_byte": "per attention byte through HBM (KV read + Q/O), memory side",
    "s_per_cta_byte": "per KV byte one decode thread block streams alone (latency-bound rate)",
    "s_per_sm_byte": "per KV byte the busiest SM streams for its resident decode blocks",
    "s_per_attn_wave": "per wave of decode thread blocks (block start-up and write-back)",
    "s_per_attn_kernel": "per attention kernel launch (launch, ramp-up and tail floor)",
    "s_per_split_partial": "per split-KV partial output (written by a split, merged by combine)",
    "s_per_kv_tile": "per KV tile iteration along the busiest SM's decode blocks (load latency)",
    "s_per_prefill_row": "per prefill row and layer (per-sequence attention set-up: masks, ...)",
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
    s_per_diag_flop: float = 0.0
    s_per_kv_byte: float = 0.0
    s_per_cta_byte: float = 0.0
    s_per_sm_byte: float = 0.0
    s_per_attn_wave: float = 0.0
    s_per_attn_kernel: float = 0.0
    s_per_split_partial: float = 0.0
    s_per_kv_tile: float = 0.0
    s_per_prefill_row: float = 0.0
    s_per_first_seq: float = 0.0
    sharpness: float = math.inf
    # How many of a step's requests ``s_per_first_seq`` prices (0: none). With it the
    # per-request cost is piecewise linear in the batch: s_per_seq + s_per_first_seq for each
    # of the first seq_knee requests, s_per_seq for the rest. A fit chooses it from
    # SEQ_KNEE_GRID (executors/calibration.py), as it chooses the sharpness.
    seq_knee: int = 0

    def __post_init__(self) -> None:
        for name in self.names():
            v = getattr(self, name)
            if not (v >= 0 and not math.isnan(v)):
                raise ValueError(f"coefficient {name} must be >= 0, got {v}")
        if not (self.sharpness >= 1):
            raise ValueError(f"sharpness must be >= 1 (1: compute and memory add), "
                             f"got {self.sharpness}")
        knee = self.seq_knee
        if isinstance(knee, bool) or not isinstance(knee, int) or knee < 0:
            raise ValueError(f"seq_knee must be an integer >= 0, got {knee!r}")
        if self.s_per_first_seq > 0 and knee == 0:
            raise ValueError("s_per_first_seq prices a step's first seq_knee requests: it "
                             "needs seq_knee >= 1")

    #: Fields that are not prices (shape parameters of the model).
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("sharpness", "seq_knee")

    @classmethod
    def names(cls) -> list[str]:
        """The prices, in ``predict_array``'s order."""
        return [f.name for f in fields(cls) if f.name not in cls.SHAPE_FIELDS]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def scaled(self, factor: float) -> Coefficients:
        """Every price times ``factor`` (the knee kept): every term a profile prices is a price
        times a driver or a p-norm of such products, so it scales by exactly ``factor`` (a
        host that runs ``factor`` times slower). Time priced outside the profile does not:
        TP communication, pipeline sends and swap copies (the hardware spec's)."""
        factor = float(factor)  # a numpy float would not survive the profile's YAML
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"scale factor must be positive and finite, got {factor}")
        return Coefficients(**{name: getattr(self, name) * factor for name in self.names()},
                            sharpness=self.sharpness, seq_knee=self.seq_knee)

    def breakdown(self, d: StepDrivers, tokens_priced_by_bytes: float | None = None,
                  ) -> StepBreakdown:
        """Seconds per term, without communication and swap (priced from the spec).

        ``tokens_priced_by_bytes``: seconds per element-wise byte; when given, element-wise
        work is ``elementwise_bytes x`` it (the roofline) instead of ``tokens x s_per_token``.
        """
        p = self.sharpness
        b = StepBreakdown()
        b.linear = knee(self.s_per_flop * d.linear_flops,
                        self.s_per_weight_byte * d.linear_bytes, sharpness=p)
        b.lm_head = knee(self.s_per_flop * d.lm_head_flops,
                         self.s_per_weight_byte * d.lm_head_bytes, sharpness=p)
        b.attention_prefill = knee(
            self.s_per_attn_flop * d.prefill_flops + self.s_per_diag_flop * d.prefill_diag_flops,
            self.s_per_kv_byte * d.prefill_bytes, sharpness=p,
        ) + self.s_per_attn_kernel * d.prefill_kernels + self.s_per_prefill_row * d.prefill_rows
        decode = self.s_per_attn_kernel * d.decode_kernels
        if _nonzero(d.decode_kernels):
            cta = self.s_per_cta_byte * d.decode_cta_bytes
            if d.decode_waves:
                decode = decode + d.decode_waves * knee(
                    self.s_per_attn_flop * d.decode_wave_flops,
                    _max(self.s_per_kv_byte * d.decode_wave_bytes, cta,
                         self.s_per_sm_byte * d.decode_sm_bytes), sharpness=p)
            if d.decode_tail:
                decode = decode + knee(
                    self.s_per_attn_flop * d.decode_tail_flops,
                    _max(self.s_per_kv_byte * d.decode_tail_bytes, cta,
                         self.s_per_sm_byte * d.decode_tail_sm_bytes), sharpness=p)
            decode = decode + self.s_per_attn_wave * d.decode_wave_count
            decode = (decode + self.s_per_split_partial * d.decode_partials
                      + self.s_per_kv_tile * d.decode_chain_tiles)
        b.attention_decode = decode
        if tokens_priced_by_bytes is None:
            b.elementwise = self.s_per_token * d.tokens
        else:
            b.elementwise = tokens_priced_by_bytes * d.elementwise_bytes
        b.overhead = self.s_per_step * d.nonempty + self.s_per_seq * d.rows
        if self.s_per_first_seq:  # (a zero price adds nothing, not even a rounding)
            b.overhead = b.overhead + self.s_per_first_seq * first_rows(d.rows, self.seq_knee)
        return b


def _max(*terms: float | np.ndarray) -> float | np.ndarray:
    """The binding one of a wave's memory-side bounds (HBM, one block, the busiest SM)."""
    a, b, c = terms
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or isinstance(c, np.ndarray):
        return np.maximum(np.maximum(a, b), c)
    return max(terms)


def _nonzero(x: float | np.ndarray) -> bool:
    return bool(np.any(x)) if isinstance(x, np.ndarray) else x != 0


#: Driver columns of the design matrix the fitter uses, in ``predict_array`` order.
DRIVER_COLUMNS = ("nonempty", "rows", "tokens", "linear_flops", "linear_bytes", "lm_head_flops",
                  "lm_head_bytes", "prefill_flops", "prefill_diag_flops", "prefill_bytes",
                  "prefill_kernels", "decode_waves", "decode_wave_flops", "decode_wave_bytes",
                  "decode_sm_bytes", "decode_tail", "decode_tail_flops", "decode_tail_bytes",
                  "decode_tail_sm_bytes", "decode_cta_bytes", "decode_wave_count",
                  "decode_kernels", "decode_partials", "decode_chain_tiles", "prefill_rows")


def driver_matrix(drivers: list[StepDrivers]) -> np.ndarray:
    """Rows of drivers as an (n, len(DRIVER_COLUMNS)) float array."""
    return np.array([[getattr(d, c) for c in DRIVER_COLUMNS] for d in drivers], dtype=float)


def first_rows(rows: float | np.ndarray, seq_knee: int) -> float | np.ndarray:
    """How many of a step's ``rows`` scheduled requests ``s_per_first_seq`` prices: the
    first ``seq_knee`` of them."""
    return np.minimum(rows, seq_knee) if isinstance(rows, np.ndarray) else min(rows, seq_knee)


def predict_array(x: np.ndarray, X: np.ndarray, sharpness: float,
                  seq_knee: int = 0) -> np.ndarray:
    """Vectorised ``Coefficients.breakdown(...).total`` (without comm/swap) for fitting.

    ``x`` is in ``Coefficients.names()`` order; ``X`` from ``driver_matrix``. With
    ``sharpness`` 1 every knee is a sum, so the model is linear in ``x`` (the fit's start).
    ``predict_jacobian`` is its derivative.
    """
    (step, seq, tok, flop, wbyte, aflop, dflop, kvbyte, ctab, smb, wave, kern, part, tile, prow,
     first) = x
    c = {name: X[:, i] for i, name in enumerate(DRIVER_COLUMNS)}
    p = sharpness

    def linear(lhs: str, rhs: str) -> np.ndarray:
        return knee_array([flop * c[lhs], wbyte * c[rhs]], p)

    def prefill() -> np.ndarray:
        return knee_array([aflop * c["prefill_flops"] + dflop * c["prefill_diag_flops"],
                           kvbyte * c["prefill_bytes"]], p)

    def decode(count: str, flops: str, kv: str, sm: str) -> np.ndarray:
        cta = ctab * c["decode_cta_bytes"]
        return c[count] * knee_array([aflop * c[flops], np.maximum(np.maximum(
            kvbyte * c[kv], cta), smb * c[sm])], p)

    return (step * c["nonempty"] + seq * c["rows"] + tok * c["tokens"]
            + first * first_rows(c["rows"], seq_knee)
            + linear("linear_flops", "linear_bytes")
            + linear("lm_head_flops", "lm_head_bytes")
            + prefill()
            + decode("decode_waves", "decode_wave_flops", "decode_wave_bytes", "decode_sm_bytes")
            + decode("decode_tail", "decode_tail_flops", "decode_tail_bytes",
                     "decode_tail_sm_bytes")
            + wave * c["decode_wave_count"]
            + kern * (c["prefill_kernels"] + c["decode_kernels"])
            + part * c["decode_partials"] + tile * c["decode_chain_tiles"]
            + prow * c["prefill_rows"])


def knee_gradient(terms: list[np.ndarray], sharpness: float) -> list[np.ndarray]:
    """``d knee_array(terms) / d terms[i]`` for each term, the derivative from the right
    (the side a finite difference with a positive step takes): with ``p = sharpness`` it is
    ``(t_i / knee)^(p - 1)``; at p = inf (a max) 1 for every term at the maximum, ties
    included; where every term is 0 the knee grows like the one term moved, so 1."""
    hi = terms[0]
    for t in terms[1:]:
        hi = np.maximum(hi, t)
    p = sharpness
    if math.isinf(p):
        return [(t >= hi).astype(float) for t in terms]
    if p == 1.0:
        return [np.ones_like(hi) for _ in terms]
    zero = hi <= 0.0
    any_zero = bool(zero.any())
    h = np.where(zero, 1.0, hi) if any_zero else hi
    ratios = [t / h for t in terms]
    powers = [r ** p for r in ratios]
    # (t_i / knee)^(p-1) = r_i^p / r_i * S^(1/p) / S with r_i = t_i / hi and S = sum r_i^p
    # (>= 1 where hi > 0): the p-th powers serve the value and the derivative alike.
    total = sum(powers)
    if any_zero:
        total = np.where(zero, 1.0, total)
    factor = total ** (1.0 / p) / total
    out = []
    for r, rp in zip(ratios, powers):
        g = np.divide(rp, r, out=np.zeros_like(r), where=r > 0.0)
        g *= factor
        out.append(np.where(zero, 1.0, g) if any_zero else g)
    return out


def predict_jacobian(x: np.ndarray, X: np.ndarray, sharpness: float, seq_knee: int = 0,
                     columns: Sequence[int] | None = None) -> np.ndarray:
    """``d predict_array(x, X, ...) / d x``: one row per row of ``X``, one column per price
    (``Coefficients.names()`` order), or per index of ``columns`` (the prices a fit varies:
    the knee terms no such price enters are not differentiated). The fit's solver takes it
    in place of finite differences, which cost one evaluation of the prices' terms per price
    moved. Where a max has ties (the knee at p = inf, the decode bytes' bound) each tied term
    gets the derivative from the right, as a forward difference would."""
    _, _, _, flop, wbyte, aflop, dflop, kvbyte, ctab, smb, *_ = x  # predict_array's order
    c = {name: X[:, i] for i, name in enumerate(DRIVER_COLUMNS)}
    p = sharpness
    want = set(range(len(x)) if columns is None else columns)
    J = np.zeros((X.shape[0], len(x)))
    J[:, 0] = c["nonempty"]
    J[:, 1] = c["rows"]
    J[:, 2] = c["tokens"]
    for lhs, rhs in (("linear_flops", "linear_bytes"), ("lm_head_flops", "lm_head_bytes")):
        if not want & {3, 4} or not (c[lhs].any() or c[rhs].any()):
            continue  # nothing asked for, or nothing to differentiate (attention-only rows)
        g_flop, g_byte = knee_gradient([flop * c[lhs], wbyte * c[rhs]], p)
        J[:, 3] += g_flop * c[lhs]
        J[:, 4] += g_byte * c[rhs]
    if want & {5, 6, 7}:
        g_flop, g_byte = knee_gradient([aflop * c["prefill_flops"]
                                        + dflop * c["prefill_diag_flops"],
                                        kvbyte * c["prefill_bytes"]], p)
        J[:, 5] += g_flop * c["prefill_flops"]
        J[:, 6] += g_flop * c["prefill_diag_flops"]
        J[:, 7] += g_byte * c["prefill_bytes"]
    for count, flops, kv, sm in (("decode_waves", "decode_wave_flops", "decode_wave_bytes",
                                  "decode_sm_bytes"),
                                 ("decode_tail", "decode_tail_flops", "decode_tail_bytes",
                                  "decode_tail_sm_bytes")):
        if not want & {5, 7, 8, 9} or not c[count].any():
            continue
        by_kv, by_cta, by_sm = kvbyte * c[kv], ctab * c["decode_cta_bytes"], smb * c[sm]
        memory = np.maximum(np.maximum(by_kv, by_cta), by_sm)
        g_flop, g_mem = knee_gradient([aflop * c[flops], memory], p)
        g_flop *= c[count]
        g_mem *= c[count]
        J[:, 5] += g_flop * c[flops]
        J[:, 7] += g_mem * (by_kv >= memory) * c[kv]
        J[:, 8] += g_mem * (by_cta >= memory) * c["decode_cta_bytes"]
        J[:, 9] += g_mem * (by_sm >= memory) * c[sm]
    J[:, 10] = c["decode_wave_count"]
    J[:, 11] = c["prefill_kernels"] + c["decode_kernels"]
    J[:, 12] = c["decode_partials"]
    J[:, 13] = c["decode_chain_tiles"]
    J[:, 14] = c["prefill_rows"]
    J[:, 15] = first_rows(c["rows"], seq_knee)
    return J if columns is None else J[:, columns]
