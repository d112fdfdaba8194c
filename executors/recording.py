"""Record the steps an executor runs, and replay them through another executor.

``RecordingExecutor`` wraps any executor (the real one, in ``experiments/validate.py``) and
keeps, per step, the plan's ``StepShape``, the rows' request ids and which of them sampled, and
the duration the wrapped executor reported. ``replay`` prices the same steps with another
executor (a calibrated cost model) and rebuilds the run's timeline with the schedule held fixed:
each step starts when the previous one ends, or when the last of its requests arrives if that is
later (the replica was idle, waiting for it). Comparing the replayed latencies with the measured
ones isolates step-time error; comparing a free simulation with them adds schedule divergence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from executors.base import Executor
from executors.step_terms import StepShape, step_shape
from sim.plan import StepPlan, StepResult
from sim.specs import HardwareSpec


@dataclass(frozen=True, slots=True)
class RecordedStep:
    shape: StepShape
    request_ids: tuple[int, ...]  # scheduled rows, in plan order
    sampled: tuple[bool, ...]  # per row: did it sample a token at the end of the step
    duration: float  # what the wrapped executor reported


def is_serving_step(step: RecordedStep) -> bool:
    """A step that runs rows and moves no KV between pools: what a fit or a speed ratio can
    use (swap copies are priced from the hardware spec, not fitted)."""
    shape = step.shape
    return bool(shape.num_rows) and not (shape.swap_out_blocks or shape.swap_in_blocks)


def serving_rows(table):
    """The rows of a recorded-steps table (``replay_steps.csv``'s columns, a pandas frame)
    that ``is_serving_step`` keeps."""
    return table[(table.num_rows > 0) & (table.swap_out_blocks == 0)
                 & (table.swap_in_blocks == 0)]


class RecordingExecutor(Executor):
    """Delegates everything to ``inner`` and records every executed step."""

    closed_form_decode = False  # step by step: every step is recorded

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.produces_tokens = inner.produces_tokens
        self.steps: list[RecordedStep] = []

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.inner.execute(plan)
        self.steps.append(RecordedStep(step_shape(plan),
                                       tuple(s.request_id for s in plan.scheduled),
                                       tuple(s.sample for s in plan.scheduled),
                                       float(result.duration)))
        return result

    def weight_bytes(self) -> float:
        return self.inner.weight_bytes()

    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        return self.inner.activation_reserve_bytes(max_num_batched_tokens, max_num_seqs)

    def kv_cache_dtype(self) -> str | None:
        return self.inner.kv_cache_dtype()

    def device_spec(self, hardware: HardwareSpec) -> HardwareSpec:
        return self.inner.device_spec(hardware)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                      num_offload_blocks: int = 0) -> None:
        self.inner.init_kv_cache(num_gpu_blocks, num_cpu_blocks, block_size, num_offload_blocks)

    def add_request(self, request_id: int, prompt_token_ids: Sequence[int] | None) -> None:
        self.inner.add_request(request_id, prompt_token_ids)

    def free_request(self, request_id: int) -> None:
        self.inner.free_request(request_id)

    def output_token_ids(self, request_id: int) -> list[int]:
        return self.inner.output_token_ids(request_id)  # type: ignore[attr-defined]


@dataclass
class Replay:
    """Per-step predicted vs measured durations and the replayed token times."""

    steps: Sequence[RecordedStep]
    measured: np.ndarray  # seconds per step, as recorded
    predicted: np.ndarray  # seconds per step, from the other executor
    token_times: dict[int, list[float]] = field(default_factory=dict)  # request id -> times

    @property
    def step_errors(self) -> np.ndarray:
        """Relative error per step (predicted / measured - 1)."""
        return self.predicted / self.measured - 1.0

    def step_mape(self) -> float:
        return float(100.0 * np.mean(np.abs(self.step_errors))) if len(self.measured) else 0.0

    def busy_error(self) -> float:
        """Relative error of the summed step time, in percent."""
        total = float(self.measured.sum())
        return 100.0 * (float(self.predicted.sum()) / total - 1.0) if total else 0.0


def replay(steps: Sequence[RecordedStep], executor: Executor,
           arrivals: Mapping[int, float]) -> Replay:
    """Price ``steps`` with ``executor`` (``breakdown_shape`` when it has one, else it must be
    a cost model that accepts plans of the shape) and rebuild the token times of every request
    in ``arrivals`` with the recorded schedule."""
    price = getattr(executor, "breakdown_shape", None)
    if price is None:
        raise TypeError(f"{type(executor).__name__} cannot price a recorded step shape; "
                        f"replay needs a cost model (breakdown_shape)")
    measured = np.array([s.duration for s in steps], dtype=float)
    predicted = np.array([price(s.shape).total for s in steps], dtype=float)
    times: dict[int, list[float]] = {}
    end = 0.0
    for step, d in zip(steps, predicted):
        ready = max((arrivals[r] for r in step.request_ids if r in arrivals), default=0.0)
        end = max(end, ready) + float(d)
        for rid, sampled in zip(step.request_ids, step.sampled):
            if sampled:
                times.setdefault(rid, []).append(end)
    return Replay(steps, measured, predicted, times)
