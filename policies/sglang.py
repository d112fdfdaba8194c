"""SGLang's scheduler (``python/sglang/srt/managers/scheduler.py`` ``get_next_batch_to_run``,
``schedule_policy.py`` ``SchedulePolicy`` / ``PrefillAdder``, ``schedule_batch.py``
``retract_decode``), with its default ``enable_mixed_chunk=false``.

A step is either a prefill batch or a decode batch, never both:
1. **Prefill first.** If a prompt is mid-chunk or requests wait, a prefill batch is built
   from the budgets of ``PrefillAdder``:
   - ``rem_total``: the pool's free tokens (free blocks, cached ones included: SGLang's
     available + evictable) less what the running requests are expected to still need,
     ``min(remaining output, 4096) x new_token_ratio`` each;
   - ``rem_input``: ``max_prefill_tokens`` (16,384) of prompt per batch;
   - ``rem_chunk``: ``chunked_prefill_size`` per batch.
   The prompt mid-chunk continues first. Then waiting requests in the schedule order
   (``schedule_policy``: ``fcfs``, or ``lpm``, longest cached prefix first, which SGLang
   turns into fcfs while more than 128 wait), each with the prompt tokens its cached prefix
   does not cover: admission stops at the first whose prompt plus ``min(max output, 4096)``
   does not fit ``rem_total`` (SGLang's conservative new-token estimate), at a prompt that
   would exceed ``rem_input`` once one is admitted, or at ``max_num_seqs`` running. A prompt
   longer than ``rem_chunk`` is cut to it and ends the batch (one chunked prompt at a time).
2. **Otherwise decode** every running request one token. When the pool cannot hold that
   step, requests are **retracted** (preempted by recompute; their computed prefix stays in
   the cache): fewest output tokens first, longest prompt first among equals, until the
   rest could decode 20 more steps (``retract_decode_steps``); they rejoin the waiting
   queue at its tail. ``new_token_ratio`` then becomes what the remaining requests have
   decoded, plus 20 steps each, over their maximum outputs (at most 1).
``new_token_ratio`` starts at 0.7 x ``schedule_conservativeness`` and falls with every
decode batch that retracts nobody, by (0.7 - 0.098) x ``schedule_conservativeness`` / 600,
down to 0.098 x it (SGLang's 0.14 x the initial ratio; both at most 1); it starts over when
the engine goes idle: it holds no request at all (``StepBuilder.idled``), or none it can run.
With nothing running, a prompt that fits the free pool is admitted whatever its output
estimate (it would otherwise wait forever in a small pool).

Decode jumps (``step_mode=fast``) repeat a decode batch only while nothing waits and no prompt
is mid-chunk: then no admission is tried, and each repeated batch only lowers
``new_token_ratio`` as a planned one does (``StepBuilder.repeated_steps``). While requests wait,
the falling ratio may admit one at any step, so every step is planned
(``next_decision_time``). On the array core (``fcfs``) the prefill batch is ``prefill_rule``
on plain numbers (``prefill_plan``) and a retraction ``decode_retractions`` on them, the
rules ``schedule`` applies.

Prefix caching is on by default (SGLang's radix cache). SGLang matches prefixes token by
token (page size 1); here hits are whole ``kv.block_size`` blocks (``kv.block_size=1`` is
token-granular). ``chunked_prefill_size`` left null takes SGLang's default for the GPU's
memory (2,048 below 35 GiB, 4,096 below 60, 8,192 below 160, else 16,384); ``max_num_seqs``
stands for ``max_running_requests``, which SGLang derives from its pools. Not modelled:
``lpm``'s in-batch prefix deprioritisation, ``enable_mixed_chunk``, overlap scheduling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from policies.base import POLICIES, Policy, PolicyConfig
from sim.errors import require
from sim.kv_manager import blocks_added, blocks_for
from sim.plan import StepPlan
from sim.request import Request
from sim.step_builder import StepBuilder

# schedule_policy.py / global_config: SGLang's constants.
CLIP_MAX_NEW_TOKENS = 4096  # a request's output counted at most this much in estimates
LPM_MAX_QUEUE = 128  # lpm turns into fcfs while more than this many wait
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # min ratio = init x this (0.1 at conservativeness 1)
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
SCHEDULE_ORDERS = ("fcfs", "lpm")


@dataclass(frozen=True)
class SGLangConfig(PolicyConfig):
    name: str = "sglang"
    max_num_seqs: int = 4096  # SGLang's max_running_requests
    max_num_batched_tokens: int = 16384  # SGLang's max_prefill_tokens
    enable_chunked_prefill: bool = True
    chunked_prefill_size: int = 8192
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    kv_watermark: float = 0.0
    always_chunks: ClassVar[str | None] = "SGLang always chunks prefills (chunked_prefill_size)"
    recompute_only: ClassVar[str | None] = "SGLang retracts requests by recompute only"
    no_watermark: ClassVar[str | None] = "SGLang admits by its token estimate, not a watermark"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.chunked_prefill_size >= 1, "policy.chunked_prefill_size",
                f"must be >= 1, got {self.chunked_prefill_size}")
        # A prefill batch computes at most one chunk's tokens, a decode batch one per seat:
        # both within max_num_batched_tokens (SGLang's max_prefill_tokens), its step bound.
        require(self.chunked_prefill_size <= self.max_num_batched_tokens,
                "policy.chunked_prefill_size",
                f"{self.chunked_prefill_size} exceeds policy.max_num_batched_tokens="
                f"{self.max_num_batched_tokens} (SGLang's max_prefill_tokens)")
        require(self.max_num_seqs <= self.max_num_batched_tokens, "policy.max_num_seqs",
                f"{self.max_num_seqs} exceeds policy.max_num_batched_tokens="
                f"{self.max_num_batched_tokens}: a decode batch of every running request "
                f"would not fit a step")
        require(self.schedule_policy in SCHEDULE_ORDERS, "policy.schedule_policy",
                f"must be one of {SCHEDULE_ORDERS}, got {self.schedule_policy!r}")
        require(self.schedule_conservativeness > 0, "policy.schedule_conservativeness",
                f"must be > 0, got {self.schedule_conservativeness}")


def _estimate(req: Request) -> int:
    """Output tokens ``req`` may still generate, as SGLang's estimates count them."""
    return min(req.max_output_len - req.num_output_tokens, CLIP_MAX_NEW_TOKENS)


@POLICIES.register("sglang")
class SGLangPolicy(Policy):
    # A decode batch is planned again, one more token each, until an arrival, a finish or
    # a shortage, while nothing waits and no prompt is mid-chunk (next_decision_time); its
    # repeats lower new_token_ratio as planned ones do (repeated_steps).
    supports_decode_jumps = True
    implements_chunked_prefill = True
    prefix_caching_default = True
    # The overlap scheduler: the next batch is prepared while this one runs.
    host_overlap_default = True
    # A prompt takes blocks chunk by chunk (``step.schedule`` of each chunk).
    holds_whole_prompt = False
    # ``prefill_plan`` and ``decode_retractions`` below, with the fcfs schedule policy.
    array_core = True

    config_class = SGLangConfig
    config: SGLangConfig

    @classmethod
    def engine_defaults(cls, hardware: Any) -> dict[str, Any]:
        gib = hardware.memory_gib
        size = 2048 if gib < 35 else 4096 if gib < 60 else 8192 if gib < 160 else 16384
        return {"chunked_prefill_size": size}

    def __init__(self, config: PolicyConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        c = self.config.schedule_conservativeness
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * c, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        # The last plan found requests waiting or a prompt mid-chunk: the next step may
        # admit or continue one as the ratio falls, so it must be planned.
        self._admission_pending = False

    def array_core_refusal(self) -> str | None:
        if self.config.schedule_policy != "fcfs":
            return "policy.schedule_policy=lpm (its order reads cache hits)"
        return None

    def next_decision_time(self, now: float) -> float:
        """Now while requests wait or a prompt is mid-chunk (every step is planned), else
        none: a decode batch then repeats until an arrival, a finish or a shortage."""
        return now if self._admission_pending else math.inf

    def schedule(self, step: StepBuilder) -> StepPlan:
        # Decode batches the replica repeated since the last plan (a decode jump): each
        # retracted nobody and lowers the ratio, as the planned one did.
        self._lower_ratio(step.repeated_steps)
        if step.idled:  # the engine went idle since (its loop found no batch)
            self.new_token_ratio = self.init_ratio
        self._admission_pending = bool(step.waiting)
        # The running requests that decode and those with more to prefill (a prefill batch
        # that schedules nothing changes neither).
        decodes, prefills = step.split_running()
        if self._prefill_batch(step, decodes, prefills):
            return step.build()
        if step.running:
            self._decode_batch(step, decodes)
        else:  # idle: no batch at all
            self.new_token_ratio = self.init_ratio
        return step.build()

    # ---- prefill ---------------------------------------------------------------------------
    def waiting_order(self, step: StepBuilder) -> list[Request]:
        """The waiting queue in the schedule order (a stable sort: fcfs among equals)."""
        waiting = list(step.waiting)
        if self.config.schedule_policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
            waiting.sort(key=lambda r: step.pending_tokens(r) - r.num_pending_tokens)
        return waiting

    def _prefill_batch(self, step: StepBuilder, decodes: Sequence[Request],
                       prefills: Sequence[Request]) -> bool:
        """Build a prefill batch; False if it would be empty (then the step decodes)."""
        # Nothing is scheduled yet but micro-batches still in the pipeline, whose requests
        # wait for them.
        chunking = [r for r in prefills if not step.is_scheduled(r)]
        if not chunking and not step.waiting:
            return False
        self._admission_pending = True
        kv, size = step.kv, step.kv.block_size
        # ``_estimate`` of every decoding request (at every planned step while requests
        # wait: in one array operation).
        remaining = int(np.minimum(step.remaining_outputs(decodes), CLIP_MAX_NEW_TOKENS).sum())
        order: list[Request] = []

        def waiting() -> Iterator[tuple[int, int]]:
            order.extend(self.waiting_order(step))
            return ((step.pending_tokens(r), _estimate(r)) for r in order)

        chunks, grants = self.prefill_rule(
            [r.num_pending_tokens for r in chunking],
            # The slots left in the blocks each holds: its chunk fills them before it takes
            # free ones.
            [len(kv.block_table(r.request_id)) * size - r.num_computed_tokens
             for r in chunking],
            waiting, len(step.running), remaining,
            # Live, as SGLang's: the free pool (cached blocks included) after what this
            # batch took (its chunks' blocks and the cached blocks its hits took off it).
            lambda: kv.num_free_blocks * size,
            lambda j, n: step.schedule(chunking[j], n),
            lambda j, n: step.schedule(order[j], n),
            # SGLang keeps one prompt mid-chunk (its ``chunked_req``): while a prompt with
            # tokens left to prefill is in a micro-batch still in the pipeline (it may come
            # back mid-chunk), a new prompt is admitted only whole (two prompts mid-chunk
            # could hold every block between them, neither able to go on).
            chunk_in_flight=len(prefills) > len(chunking))
        return bool(chunks or grants)

    def prefill_rule(self, partials: Sequence[int], slack: Sequence[int],
                     waiting: Callable[[], Iterable[tuple[int, int]]], running: int,
                     remaining: int, free_tokens: Callable[[], int],
                     place_partial: Callable[[int, int], bool],
                     place_new: Callable[[int, int], bool], chunk_in_flight: bool = False,
                     ) -> tuple[list[int], list[int]]:
        """``PrefillAdder`` on plain numbers, for the replica's plan and the array core's
        (sim/array_core.py) alike. ``partials``: the pending tokens of the prompts mid-chunk
        (``slack``: the slots left in the blocks each holds); ``waiting()``: the waiting
        requests' (pending tokens after their cache hit, output estimate) in the schedule
        order, read only once admission starts and only as far as it goes; ``running``:
        requests running; ``remaining``: the decoding requests' output estimates summed;
        ``free_tokens()``: the free pool in tokens, live; ``place_partial(j, n)`` and
        ``place_new(j, n)`` grant ``n`` tokens to the ``j``-th of each (False if the pool
        cannot hold them: the batch ends; so the ``j``-th admitted is the ``j``-th waiting,
        admission stopping at the first it does not admit). Returns the partials' chunks and
        the admitted requests' grants, in order (both empty: the step decodes)."""
        cfg = self.config
        reserved = remaining * self.new_token_ratio
        committed = 0  # output estimates of the requests this batch admitted whole

        def rem_total() -> float:
            return free_tokens() - reserved - committed

        rem_input = cfg.max_num_batched_tokens
        rem_chunk = cfg.chunked_prefill_size
        chunks: list[int] = []
        grants: list[int] = []
        for j, pending in enumerate(partials):  # the prompt mid-chunk goes on first
            # Its chunk fills its own blocks' slots before it takes free ones (without
            # them, a prompt whose last block the free pool cannot follow would never end).
            n = min(pending, rem_chunk, max(int(rem_total()) + slack[j], 0))
            if n <= 0 or not place_partial(j, n):
                return chunks, grants
            chunks.append(n)
            rem_input -= n
            rem_chunk -= n
            if n < pending:
                return chunks, grants  # still chunked: the batch ends
        queue = iter(waiting())
        while running < cfg.max_num_seqs:
            head = next(queue, None)
            if head is None:
                break
            n, estimate = head
            # SGLang's NO_TOKEN stops admission. With nothing running, a prompt that fits is
            # admitted whatever its output estimate, or it would wait forever in a small pool.
            room = rem_total()
            if (n + estimate >= room) if running else n > room:
                break
            if n >= rem_input and (chunks or grants):
                break
            grant = min(n, rem_chunk)
            if grant <= 0 or (grant < n and chunk_in_flight) or not place_new(len(grants),
                                                                              grant):
                break
            grants.append(grant)
            running += 1
            if grant == n:
                committed += estimate
            rem_input -= grant
            rem_chunk -= grant
            if grant < n:
                break  # the new chunked prompt ends the batch
        return chunks, grants

    def prefill_plan(self, decode_batches: int, remaining: Callable[[int], int],
                     partials: Sequence[int], computed: Sequence[int],
                     waiting: Iterable[tuple[int, int]], running: int, free_blocks: int,
                     block_size: int, idled: bool = False,
                     cached_blocks: Callable[[int], int] | None = None,
                     ) -> tuple[list[int], list[int]]:
        """The array core's prefill batch (sim/array_core.py): ``prefill_rule`` on plain
        numbers. ``decode_batches``: the decode batches taken since the last call that
        retracted nobody (each lowers the ratio first, as in ``schedule``; ``idled``: the
        replica held no request at all since, which starts the ratio over);
        ``remaining(cap)``: the decoding requests' outputs still to come, each at most
        ``cap``, summed; ``partials`` and ``computed``: the pending and computed tokens of
        the prompts mid-chunk; ``waiting``: (pending prefill tokens, output tokens left) of
        the waiting requests in queue order (arrivals, and requests retracted at its tail:
        their prompt and sampled tokens, less the blocks they find cached,
        ``cached_blocks(j)`` for the ``j``-th, which its admission takes too);
        ``running``: requests running; ``free_blocks``: the free pool. Returns the partials'
        chunks and the admitted requests' grants (both empty: the step decodes).
        tests/test_array_core.py checks it against ``schedule``."""
        self._lower_ratio(decode_batches)
        if idled:
            self.new_token_ratio = self.init_ratio
        free = free_blocks

        def take(blocks: int) -> bool:
            # (The rule's room check keeps every grant within the free pool.)
            nonlocal free
            free -= blocks
            if free < 0:
                raise AssertionError("prefill_plan granted more blocks than the pool has free")
            return True

        def place_partial(j: int, n: int) -> bool:
            return take(blocks_added(computed[j], n, block_size))

        def place_new(j: int, n: int) -> bool:
            hit = 0 if cached_blocks is None else cached_blocks(j)
            if hit and hit + blocks_for(n, block_size) > free:
                # The blocks a recomputed request's cache hit takes back are beyond the
                # rule's room check: as ``step.schedule``, it does not fit, and the batch ends.
                return False
            return take(hit + blocks_for(n, block_size))

        return self.prefill_rule(
            partials, [blocks_for(c, block_size) * block_size - c for c in computed],
            lambda: ((n, min(o, CLIP_MAX_NEW_TOKENS)) for n, o in waiting), running,
            remaining(CLIP_MAX_NEW_TOKENS), lambda: free * block_size, place_partial,
            place_new)

    # ---- decode ----------------------------------------------------------------------------
    def _decode_batch(self, step: StepBuilder, decodes: Sequence[Request]) -> None:
        """Every decoding request one token (a prompt mid-chunk waits for the next prefill
        batch), after retracting some if the pool cannot hold the step."""
        # The whole decode run as one block where the pool holds its new blocks (a fast
        # run's; what scheduling each row in order would do), else row by row.
        if step.schedule_decode_run(decodes, self.config.max_num_batched_tokens):
            self._lower_ratio()
            return
        decoding = [r for r in step.running
                    if r.num_pending_tokens == 1 and not step.is_scheduled(r)]
        if sum(step.blocks_needed(r, 1) for r in decoding) > step.kv.num_free_blocks:
            decoding = self._retract(step, decoding)
        else:
            self._lower_ratio()
        for req in decoding:
            if not step.schedule(req, 1):  # retraction left room for this step
                raise AssertionError(f"request {req.request_id}: no block after retraction")

    def _lower_ratio(self, batches: int = 1) -> None:
        """``batches`` decode batches that retracted nobody: each lowers ``new_token_ratio``
        by the decay, down to its floor."""
        for _ in range(batches):
            if self.new_token_ratio <= self.min_ratio:
                break
            self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_ratio)

    def _retract(self, step: StepBuilder, running: list[Request]) -> list[Request]:
        """Preempt by recompute those ``decode_retractions`` picks (``retract_decode``); they go
        to the tail of the waiting queue. Returns the requests left to decode."""
        kv = step.kv
        retracted = self.decode_retractions(
            [r.num_output_tokens for r in running], [r.prompt_len for r in running],
            [r.num_computed_tokens for r in running],
            [len(kv.block_table(r.request_id)) for r in running],
            [r.max_output_len for r in running], kv.num_free_blocks, kv.block_size)
        for r in retracted:
            step.preempt(running[r], to_front=False)
        gone = set(retracted)
        return [req for r, req in enumerate(running) if r not in gone]

    def decode_retractions(self, outputs: Sequence[int], prompts: Sequence[int],
                           computed: Sequence[int], held: Sequence[int],
                           max_outputs: Sequence[int], free: int, block_size: int) -> list[int]:
        """``retract_decode`` on plain numbers, for the replica's decode batch and the array
        core's (sim/array_core.py) alike, where the batch's new blocks do not fit. The
        decoding requests in running order: their output tokens, prompt lengths, computed
        tokens, the blocks they hold and their maximum outputs; ``free`` blocks free. Retracts (by recompute, each freeing what it
        holds) fewest outputs first, longest prompt first among equals (the latest in
        running order first among those), until the rest hold ``RETRACT_DECODE_STEPS`` more
        tokens each, and one more if the last left alone cannot take its next token; sets
        ``new_token_ratio`` from those left. Returns the retracted rows, in the order
        retracted."""
        ahead = [max(0, blocks_for(c + RETRACT_DECODE_STEPS, block_size) - h)
                 for c, h in zip(computed, held)]
        next_token = [max(0, blocks_for(c + 1, block_size) - h)
                      for c, h in zip(computed, held)]
        order = sorted(range(len(outputs)), key=lambda r: (outputs[r], -prompts[r]),
                       reverse=True)
        retracted: list[int] = []
        while len(order) > 1 and sum([ahead[r] for r in order]) > free:
            retracted.append(order.pop())
            free += held[retracted[-1]]
        if sum([next_token[r] for r in order]) > free:  # alone, and still no room
            retracted.append(order.pop())
            free += held[retracted[-1]]
        decoded = sum([outputs[r] for r in order])
        total = sum([max_outputs[r] for r in order])
        self.new_token_ratio = min(
            1.0, (decoded + RETRACT_DECODE_STEPS * len(order)) / total) if total else 1.0
        return retracted
