"""Drive one Replica over hand-made requests with a recording executor (golden step plans)."""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

import policies
from executors.base import Executor
from sim.kv_manager import KVBlockManager
from sim.metrics import MetricsCollector
from sim.outputs import REQUEST_COLUMNS, STEP_COLUMNS, CsvSink
from sim.plan import StepPlan, StepResult
from sim.replica import Replica
from sim.request import Request


@dataclass
class RecordedStep:
    time: float
    rows: list[tuple[int, int, int, bool]]  # (request id, start, tokens, sample)
    tables: dict[int, list[int]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    recomputed: list[int]
    swapped_out: list[int]
    # Running requests when the policy started this step: id -> tokens pending (1 = decode).
    running_before: dict[int, int] = field(default_factory=dict)
    num_running_after: int = 0  # size of the running set once the plan was built
    # False for a plan that only preempted: the replica re-plans at once without executing
    # it, but its preemptions happened and are recorded here.
    executed: bool = True

    @property
    def grants(self) -> dict[int, int]:
        return {rid: n for rid, _, n, _ in self.rows}


@dataclass
class RecordingExecutor(Executor):
    step_time: float = 1.0
    per_token_time: float = 0.0
    steps: list[RecordedStep] = field(default_factory=list)
    now: object = None
    context: tuple[dict[int, int], int] = ({}, 0)  # set by the policy wrapper per plan

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps.append(RecordedStep(
            self.now() if self.now else 0.0,
            [(s.request_id, s.start_position, s.num_new_tokens, s.sample) for s in plan.scheduled],
            {s.request_id: list(s.block_table) for s in plan.scheduled},
            list(plan.swap_out), list(plan.swap_in), list(plan.recomputed), list(plan.swapped_out),
            *self.context,
        ))
        return StepResult(self.step_time + self.per_token_time * plan.num_tokens)

    def weight_bytes(self) -> float:
        return 0.0

    def activation_reserve_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        return 0.0


@dataclass
class Run:
    steps: list[RecordedStep]
    replica: Replica
    metrics: MetricsCollector
    requests: list[Request]


def run_requests(policy: dict, requests: list[Request], *, num_gpu_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, step_time: float = 1.0, per_token_time: float = 0.0,
                 max_model_len: int = 100_000, check_integrity: bool = True,
                 until: float | None = None, seed: int = 0,
                 enable_prefix_caching: bool = False) -> Run:
    env = simpy.Environment()
    pol = policies.make_policy({"kv_watermark": 0.0, **policy}, seed=seed)
    ex = RecordingExecutor(step_time, per_token_time)
    ex.now = lambda: env.now
    decide = pol.schedule

    def observed(step):  # record what the policy saw and left, for the step's checks
        before = {r.request_id: r.num_pending_tokens for r in step.running}
        plan = decide(step)
        ex.context = (before, len(step.running))
        if plan.is_empty and (plan.recomputed or plan.swapped_out):
            ex.steps.append(RecordedStep(env.now, [], {}, [], [], list(plan.recomputed),
                                         list(plan.swapped_out), *ex.context, executed=False))
        return plan

    pol.schedule = observed
    kv = KVBlockManager(num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching)
    metrics = MetricsCollector()
    replica = Replica(env, 0, pol, ex, kv, metrics, CsvSink(None, REQUEST_COLUMNS),
                      CsvSink(None, STEP_COLUMNS), max_model_len=max_model_len,
                      check_integrity=check_integrity)

    def arrivals():
        for r in sorted(requests, key=lambda r: r.arrival_time):
            if r.arrival_time > env.now:
                yield env.timeout(r.arrival_time - env.now)
            replica.add_request(r)

    env.process(arrivals())
    env.run(until=until)
    return Run(ex.steps, replica, metrics, requests)
