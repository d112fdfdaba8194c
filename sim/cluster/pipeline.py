"""A replica split into pipeline stages, with micro-batches in flight (vLLM's way).

The layers are split into ``stages`` equal stages (one GPU group each). As in vLLM, up to
``stages`` micro-batches are in the pipeline at once, each built by the policy from requests
that are not already in flight (a request is in at most one in-flight micro-batch, so each
request still advances one step at a time; the throughput gain comes from the stages working
on different requests).

Timing: the executor's ``duration`` for a plan is the batch's whole latency through the
pipeline (the cost model charges ``stages`` x the largest stage plus the stage-to-stage
sends), and every stage is taken to need an equal share ``s = duration / stages`` of it. Stage
``k`` starts a batch when the batch has left stage ``k - 1`` and the previous batch has left
stage ``k`` (a flow shop)::

    leave[k](b) = max(leave[k - 1](b), leave[k](b - 1)) + s(b)

A new micro-batch is built when stage 0 is free and fewer than ``stages`` are in flight; a
batch's tokens are applied (sampled, finished, handed off) when it leaves the last stage.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from sim import stop as run_stop
from sim.plan import StepPlan, StepResult
from sim.replica import Replica, SimulationStalled
from sim.request import Request


class PipelinedReplica(Replica):
    def __init__(self, *args: Any, pipeline_parallel: int, **kwargs: Any) -> None:
        if pipeline_parallel < 2:
            raise ValueError(f"a pipelined replica needs >= 2 stages, got {pipeline_parallel}")
        self.stages = pipeline_parallel
        super().__init__(*args, **kwargs)

    def _run(self):
        env, pp = self.env, self.stages
        stage_free = [0.0] * pp  # when each stage finishes its last accepted micro-batch
        # (leave time, plan, requests, result, start time), in issue order = leave order
        in_flight: deque[tuple[float, StepPlan, list[Request], StepResult, float]] = deque()
        busy: set[int] = set()
        empty_plans = 0
        while True:
            if run_stop.requested:  # a signal asked the run to stop
                run_stop.check()
            now = env.now
            while in_flight and in_flight[0][0] <= now:
                leave, plan, requests, result, start = in_flight.popleft()
                busy.difference_update(r.request_id for r in requests)
                self._apply(plan, requests, result)
                self._record_step(start, leave - start, plan)
                if self.check_integrity:
                    self.verify()
            if self._aborts:
                self._apply_aborts(busy)
            if len(in_flight) < pp and stage_free[0] <= now and self._has_work():
                self.builder.reset(now, busy)
                plan = self.policy.schedule(self.builder)
                if not plan.is_empty:
                    empty_plans = 0
                    requests = self.builder.scheduled_requests
                    result = self.executor.execute(plan)
                    if result.duration < 0:
                        raise ValueError(f"executor returned a negative duration {result.duration}")
                    share = result.duration / pp
                    t = now
                    for k in range(pp):
                        t = max(t, stage_free[k]) + share
                        stage_free[k] = t
                    in_flight.append((t, plan, requests, result, now))
                    busy.update(r.request_id for r in requests)
                    self.busy_time += share
                    continue
                if plan.recomputed or plan.swapped_out:
                    if self.check_integrity:  # a plan that only preempted changed state too
                        self.verify()
                    empty_plans += 1
                    if empty_plans > 10_000:
                        raise SimulationStalled(self._stall_message())
                    continue
            # Sleep until the next batch leaves, stage 0 frees up, or something arrives.
            wake_at = [in_flight[0][0]] if in_flight else []
            if len(in_flight) < pp and stage_free[0] > now:
                wake_at.append(stage_free[0])
            # The next handoff can only come when a micro-batch leaves (what a disaggregated
            # decode replica's horizon reads: Replica.busy_until).
            self.busy_until = in_flight[0][0] if in_flight else float("inf")
            self._wakeup = env.event()
            if wake_at:
                yield env.any_of([self._wakeup, env.timeout(min(wake_at) - now)])
            else:
                yield self._wakeup
            self._wakeup = None
