"""The executor interface the engine drives: run one StepPlan, return how long it took.

It lives in ``sim/`` because the replica calls it; implementations (the cost model, the real
executor) live in ``executors/`` and register there (``executors.base.EXECUTORS``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sim.plan import StepPlan, StepResult
from sim.specs import HardwareSpec

if TYPE_CHECKING:
    import numpy as np


class Executor(ABC):
    """Executes plans. Cost models predict the duration; real executors measure it."""

    #: True if ``execute`` samples real tokens (``StepResult.sampled_token_ids`` is set).
    produces_tokens: bool = False
    #: True if ``decode_durations`` gives closed-form durations (decode jumps are possible).
    closed_form_decode: bool = False
    #: True, in an executor class's own body, if the array core (sim/array_core.py) may price
    #: its steps through ``decode_step_pricer`` / ``decode_stretch_durations`` and ``execute``
    #: on pricing-only plans (``DecodeBlock.for_pricing``): the roofline cost model.
    prices_on_arrays: bool = False

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Must not mutate the plan."""

    @abstractmethod
    def weight_bytes(self) -> float:
        """Bytes of weights this executor holds on one device."""

    @abstractmethod
    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Peak activation/workspace bytes for the largest step the limits allow."""

    def decode_durations(self, plan: StepPlan, num_steps: int) -> "np.ndarray | None":
        """Closed-form durations of ``num_steps`` repeats of a decode-only plan whose contexts
        grow by one token per step, or None if this executor must run step by step (a real
        executor always does). Lets the replica take many decode steps in one event."""
        return None

    def decode_run_durations(self, num_decode: int, ctx: int, max_ctx: int,
                             num_steps: int) -> "np.ndarray | None":
        """``decode_durations`` for a decode-only batch given by its numbers: ``num_decode``
        rows whose contexts (new token included) total ``ctx`` in the first step, the longest
        ``max_ctx``: one stretch of equal membership of a decode run whose members finish
        one after another (``decode_stretch_durations`` prices a jump's stretches with it
        unless the executor prices them jointly). None: step by step."""
        return None

    def decode_step_pricer(self, num_decode: int) -> Callable[[int, int], float] | None:
        """The duration of one decode-only step of ``num_decode`` rows as a plain function of
        the total and the longest context (new token included), for pricing a decode jump
        one step at a time as far as the next event; None: price it in arrays
        (``decode_durations``, or by stretches: ``decode_stretch_durations``)."""
        return None

    def decode_stretch_durations(self, stretches: list[tuple[int, int, int, int]],
                                 ) -> list[float] | None:
        """``decode_run_durations`` of each stretch (num_decode, ctx, max_ctx, num_steps),
        one after the other, as one list (a decode jump's stretches of equal membership);
        None: step by step. Executors may price them all at once (the cost model does)."""
        out: list[float] = []
        for nd, ctx, mx, m in stretches:
            priced = self.decode_run_durations(nd, ctx, mx, m)
            if priced is None:
                return None
            out += priced.tolist()
        return out

    # Optional hooks for executors that run on a real device (the real executor does).
    def kv_cache_dtype(self) -> str | None:
        """The dtype (a ``sim.specs`` name) of the KV cache this executor allocates, or None
        for the model spec's ``kv_cache_dtype``. The memory planner sizes blocks with it."""
        return None

    def device_spec(self, hardware: HardwareSpec) -> HardwareSpec:
        """The device this executor really runs on (its name and memory): the configured
        spec for a cost model, the CPU or GPU at hand for the real executor."""
        return hardware

    # Optional hooks for executors that hold state (the real executor does).
    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                      num_offload_blocks: int = 0) -> None:
        """The memory planner fixed the pool sizes; allocate the KV storage: GPU blocks,
        the swap pool and the offload tier (host memory)."""

    def add_request(self, request_id: int, prompt_token_ids: Sequence[int] | None) -> None:
        """A request became known to the replica (before its first step)."""

    def free_request(self, request_id: int) -> None:
        """A request finished or was rejected; drop anything held for it."""
