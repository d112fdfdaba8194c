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

**step_mode=fast** (a closed-form executor, a policy that states
``Policy.supports_decode_jumps``, no handoff; closed loops included, since nothing here
passes another process's event) takes the same micro-batches at a fraction of the cost, in
two ways:

* The decoding requests not in flight form the builder's decode run (sim/decode_run.py),
  which the policy grants as one block; the run leaves with its micro-batch
  (``StepBuilder.detach_run``) and, once the batch has run, its members rejoin those not in
  flight (``attach_run``). A micro-batch's decodes cost one block, not a row each.
* Repeats: once the policy has planned a micro-batch that is one block of every request not
  in flight (a steady decode), and nothing has changed since (no arrival, transfer,
  admission or preemption, no finish while requests wait; ``_steady`` holds such runs), the
  policy's statement (``supports_decode_jumps``: a decode-only plan is planned again, one
  more token each, and while nothing waits a finish only removes the finished request) says
  what it would plan when that run is free again: the same block. ``_repeat`` then takes
  the pipeline's iterations itself, without asking the policy, each block priced ahead up to
  its run's first finish (``Executor.decode_run_durations``), up to the first iteration that
  could differ: the next arrival, or the policy's own deadline as of its last plan
  (``horizon``, ``Policy.next_decision_time``); a micro-batch leaving that is not such a
  block, or whose members finish while requests wait; new KV blocks that do not fit; an
  event of another process first (it only moves the clock with ``advance``). An instant
  when every running request is in flight and nothing waits is repeated too (the policy
  would plan nothing). The policy hears how many plans were taken for it
  (``StepBuilder.repeated_steps``).

The plans, block ids and times are those of step_mode=exact (one plan per micro-batch).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from sim import stop as run_stop
from sim.clock import advance
from sim.decode_run import DecodeRun
from sim.fast_forward import is_steady_decode
from sim.plan import DecodeBlock, StepPlan, StepResult
from sim.policy import Policy
from sim.replica import Replica, SimulationStalled
from sim.request import Request

_request_id = attrgetter("request_id")
_min = np.minimum.reduce
_NO_PLAN = StepPlan()  # what a repeated micro-batch's row reads besides its decode rows
# Where the loop goes on after ``_repeat`` took something: at its top, or asleep (an instant
# when everything was in flight, taken without the policy, needs no plan).
_LOOP, _SLEEP = "loop", "sleep"


@dataclass(slots=True)
class _Batch:
    """A micro-batch in the pipeline. A repeated one (``_repeat``) has no plan: it is the
    block of ``run`` at run step ``run_step``, ``rows`` requests."""

    leave: float
    start: float
    plan: StepPlan | None
    requests: list[Request] | None
    result: StepResult | None
    run: DecodeRun | None
    run_step: int
    rows: int
    steady: bool  # one block of every request not in flight when planned


class _Steady:
    """A run the policy last planned as a steady micro-batch, with nothing changed since:
    the run step up to which the policy's order holds (``Policy.decode_order_steps``), the
    first run step after which a member has sampled its last token (``DecodeRun.end``'s
    minimum), and the prices of its next blocks from run step ``prices_from`` (they hold
    while its members do)."""

    __slots__ = ("first_end", "order_until", "prices", "prices_from", "run")

    def __init__(self, run: DecodeRun, order_until: int) -> None:
        self.run = run
        self.order_until = order_until
        self.first_end = int(_min(run.end))
        self.prices: list[float] = []
        self.prices_from = 0


# Blocks priced ahead at a time (``Executor.decode_run_durations``): a repeated run's next
# ones, up to its first finish.
_PRICED_AHEAD = 32
# Requests preempted by recompute in a row while no micro-batch samples a token: past this, a
# replica is taken to churn for ever (``PipelinedReplica._churn``).
_CHURN_LIMIT = 10_000


class PipelinedReplica(Replica):
    def __init__(self, *args: Any, pipeline_parallel: int, **kwargs: Any) -> None:
        if pipeline_parallel < 2:
            raise ValueError(f"a pipelined replica needs >= 2 stages, got {pipeline_parallel}")
        self.stages = pipeline_parallel
        # Runs the policy last planned as a steady micro-batch, with nothing changed since,
        # by id (``_repeat``).
        self._steady: dict[int, _Steady] = {}
        self.num_repeats = 0  # micro-batches (and empty instants) taken without the policy
        self._deadline = float("inf")  # the policy's next_decision_time at its last plan
        # Requests recomputed since a micro-batch last sampled a token. A request in flight
        # cannot be preempted, so two that cannot both hold their blocks may preempt
        # themselves in turn and restart their prefills for ever (every micro-batch holds a
        # chunk, so no plan is empty): past ``_CHURN_LIMIT`` the run stops and says so.
        self._churn = 0
        # Requests whose chunk in flight leaves prompt tokens to compute: still mid-prefill
        # once it lands (``StepBuilder.num_pending_after_step``).
        self._mid_prefill: set[int] = set()
        super().__init__(*args, **kwargs)
        policy = self.policy
        self._repeats = self.fast_forward and not self.check_integrity
        # A policy whose running order may move as its requests decode (SJF's remaining
        # work) says how far it holds (``Policy.decode_order_steps``).
        self._order_moves = (type(policy).decode_order_steps
                             is not Policy.decode_order_steps)

    # Repeats stop at every arrival and transfer here (they clear ``_steady``): no lazy
    # decode.
    def enable_lazy_decode(self) -> bool:
        return False

    def _churn_message(self, plan: StepPlan) -> str:
        q = self.queues
        return (f"replica {self.replica_id}: {self._churn} requests preempted by recompute in a "
                f"row with no token sampled (the last: {plan.recomputed}); with "
                f"{self.stages} pipeline stages a request in flight cannot be preempted, so "
                f"requests that cannot hold their KV blocks together restart their prefills "
                f"for ever ({len(q.running)} running, {len(q.waiting)} waiting, "
                f"{self.kv.num_gpu_blocks} GPU blocks). Give the pool more blocks "
                f"(kv.num_gpu_blocks_override, kv.gpu_memory_utilization) or run fewer "
                f"requests at once (policy.max_num_seqs)")

    # ---- what ends the policy's repeats -------------------------------------------------
    def notify(self) -> None:
        """Something came from outside (an arrival, a transfer, blocks freed by one that
        left or was dropped, an abort): the policy plans again."""
        self._steady.clear()
        super().notify()

    def reserve_transfer(self, req: Request) -> bool:
        self._steady.clear()  # (blocks taken for a transfer: wakes nobody)
        return super().reserve_transfer(req)

    # ---- the loop -----------------------------------------------------------------------
    def _run(self):
        env, pp = self.env, self.stages
        stage_free = [0.0] * pp  # when each stage finishes its last accepted micro-batch
        builder, policy = self.builder, self.policy
        in_flight: deque[_Batch] = deque()  # in issue order = leave order
        busy: set[int] = set()
        steady = self._steady
        empty_plans = 0
        idled = False  # no request at all since the last plan
        while True:
            if run_stop.requested:  # a signal asked the run to stop
                run_stop.check()
            now = env.now
            while in_flight and in_flight[0].leave <= now:
                self._leave(in_flight.popleft(), busy)
                if self.check_integrity:
                    self.verify()
            if self._aborts:
                steady.clear()
                self._apply_aborts(busy)
            if len(in_flight) < pp and stage_free[0] <= now and self._has_work():
                repeats = self.num_repeats
                goes_on = (self._repeat(in_flight, stage_free, busy)
                           if steady and self._repeats else None)
                if self.num_repeats != repeats:  # a stretch taken in one go (a "jump")
                    self.num_jumps += 1
                if goes_on is _LOOP:
                    continue
                now = env.now  # (asleep from where the repeats left the clock)
                if goes_on is None:  # the policy plans
                    builder.reset(now, busy, repeated_steps=self._repeated, idled=idled,
                                  mid_prefill=self._mid_prefill)
                    idled = False
                    self._repeated = 0
                    plan = policy.schedule(builder)
                    # Its own next deadline as of this plan (SJF's aging): repeats stop there
                    # even once the clock has passed it (the policy may not name it again).
                    self._deadline = policy.next_decision_time(now)
                    if plan.recomputed:
                        self._churn += len(plan.recomputed)
                        if self._churn > _CHURN_LIMIT:
                            raise SimulationStalled(self._churn_message(plan))
                    if not plan.is_empty:
                        empty_plans = 0
                        self._issue(plan, in_flight, stage_free, busy, now)
                        continue
                    if plan.recomputed or plan.swapped_out:
                        steady.clear()
                        if self.check_integrity:  # a plan that only preempted changed state
                            self.verify()
                        empty_plans += 1
                        if empty_plans > 10_000:
                            raise SimulationStalled(self._stall_message())
                        continue
            # Sleep until the next batch leaves, stage 0 frees up, or something arrives.
            wake_at = [in_flight[0].leave] if in_flight else []
            if len(in_flight) < pp and stage_free[0] > now:
                wake_at.append(stage_free[0])
            # The next handoff can only come when a micro-batch leaves (what a disaggregated
            # decode replica's horizon reads: Replica.busy_until).
            self.busy_until = in_flight[0].leave if in_flight else float("inf")
            if wake_at:
                # The instant a timeout of that delay made now fires at; with nothing else
                # scheduled by then, nothing can wake or read this replica before it.
                if advance(env, now + (min(wake_at) - now)):
                    continue
                self._wakeup = env.event()
                yield env.any_of([self._wakeup, env.timeout(min(wake_at) - now)])
            else:
                if not self._has_work():
                    idled = True
                self._wakeup = env.event()
                yield self._wakeup
            self._wakeup = None

    def _issue(self, plan: StepPlan, in_flight: deque[_Batch], stage_free: list[float],
               busy: set[int], now: float) -> None:
        """The policy's ``plan`` enters the pipeline now, with the decode run if it holds the
        run's block; a steady one (the block of every request not in flight) may be repeated
        until something changes (``_repeat``)."""
        builder, steady = self.builder, self._steady
        requests = builder.scheduled_requests
        run, run_step = None, 0
        if builder.run_in_plan:
            if plan.num_blocks:  # the run goes into the pipeline with its block
                run = builder.detach_run()
                run_step = run.steps
            else:  # someone expanded the block into rows
                builder.dissolve_run()
        is_steady = (run is not None and plan.decode_block is not None
                     and is_steady_decode(plan)
                     and len(busy) + len(run) == len(self.queues.running))
        if is_steady:
            steady[id(run)] = _Steady(run, self._order_holds(run))  # type: ignore[arg-type]
        else:
            steady.clear()
        result = self.executor.execute(plan)
        if result.duration < 0:
            raise ValueError(f"executor returned a negative duration {result.duration}")
        self._enter(in_flight, stage_free, now, result.duration, _Batch(
            0.0, now, plan, requests, result, run, run_step, len(requests), is_steady))
        busy.update(map(_request_id, requests))
        # (The plan's parts: reading ``plan.scheduled`` would expand its block into rows.)
        self._mid_prefill.update(part.request_id for part in plan.parts
                                 if not isinstance(part, DecodeBlock) and not part.sample)

    def _enter(self, in_flight: deque[_Batch], stage_free: list[float], now: float,
               duration: float, batch: _Batch) -> None:
        """``batch``, of that duration, enters stage 0 now and goes through the flow shop."""
        share = duration / self.stages
        t = now
        for k in range(self.stages):
            t = max(t, stage_free[k]) + share
            stage_free[k] = t
        batch.leave = t
        in_flight.append(batch)
        self.busy_time += share

    def _leave(self, b: _Batch, busy: set[int]) -> None:
        """Micro-batch ``b`` leaves the last stage: its tokens are applied, its row recorded.
        A run that left with it rejoins the requests not in flight; the policy's repeats end
        unless it was a steady block whose members all go on, rejoining nobody."""
        run, builder = b.run, self.builder
        unfinished = self.num_unfinished
        if self._churn and (b.plan is None or b.plan.num_blocks
                            or any(s.sample for s in b.plan.scheduled)):
            self._churn = 0  # a token sampled
        if b.plan is None:  # repeated: the block of ``run``
            busy.difference_update(run.ids)  # type: ignore[union-attr]
            entry = self._steady.get(id(run))
            if (entry is not None and entry.run is run and run.steps == b.run_step
                    and entry.first_end > b.run_step + 1):  # nobody finishes
                run.take_steps((self.env.now,))  # type: ignore[union-attr]
            else:
                self._apply_block(self.env.now, (run, b.run_step))  # type: ignore[arg-type]
        else:
            busy.difference_update(map(_request_id, b.requests))  # type: ignore[arg-type]
            if self._mid_prefill:
                self._mid_prefill.difference_update(
                    map(_request_id, b.requests))  # type: ignore[arg-type]
            self._apply(b.plan, b.requests, b.result,  # type: ignore[arg-type]
                        None if run is None else (run, b.run_step))
        merged = False
        if run is not None:
            merged = bool(builder.run.members)  # type: ignore[union-attr]
            builder.attach_run(run)
        steady = self._steady
        if merged or not b.steady:
            steady.clear()
        elif self.num_unfinished != unfinished:
            # Members finished. With nothing waiting or swapped out, that changes the plans
            # only by their leaving (``Policy.supports_decode_jumps``): nobody can take the
            # seats or blocks they freed.
            q = self.queues
            entry = steady.pop(id(run), None)
            if q.waiting or q.swapped:
                steady.clear()
            elif entry is not None and entry.run is run and run.members:  # type: ignore[union-attr]
                steady[id(run)] = _Steady(run, entry.order_until)  # type: ignore[arg-type]
        if b.plan is None:
            self._record_step(b.start, b.leave - b.start, _NO_PLAN, b.rows)
        else:
            self._record_step(b.start, b.leave - b.start, b.plan)

    def _price_block(self, entry: _Steady, n: int, s: int) -> float | None:
        """The duration of run ``entry.run``'s block at run step ``s`` (``n`` members),
        pricing the blocks ahead up to its first finish; None where the executor has no
        closed form for it."""
        run, ex = entry.run, self.executor
        ctx, longest = run.ctx0_sum + n * (s + 1), run.ctx0_max + s + 1  # new tokens in
        ahead = ex.decode_run_durations(n, ctx, longest,
                                        max(1, min(entry.first_end - s, _PRICED_AHEAD)))
        if ahead is not None:
            entry.prices = ahead.tolist()
            entry.prices_from = s
            return entry.prices[0]
        price = ex.decode_step_pricer(n)
        if price is not None:
            return price(ctx, longest)
        if not ex.prices_on_arrays:
            return None
        shape = StepPlan()  # the block's shape, priced as the plan holding it would be
        shape.add_block(DecodeBlock.for_pricing(n, ctx - n, longest - 1))
        return ex.execute(shape).duration

    def _order_holds(self, run: DecodeRun) -> int:
        """The run step up to which the policy gives ``run``'s members their tokens in the
        run's order (its block planned at run step ``run.steps``)."""
        if not self._order_moves:
            return 1 << 62
        return run.steps + self.policy.decode_order_steps(run.members, 1 << 16)

    def _repeat(self, in_flight: deque[_Batch], stage_free: list[float],
                busy: set[int]) -> str | None:
        """Take the loop's iterations from now as the policy would plan them (the module
        docstring's repeats), up to the first that needs the policy or another process.
        Returns None if it took nothing (the policy plans now), else where the loop goes on
        (``_LOOP``: at its top; ``_SLEEP``: asleep, after an instant when every running
        request was in flight). It leaves the state the loop's own iterations would: the
        clock at the last instant taken, the micro-batches that left then applied."""
        env, pp, builder, kv = self.env, self.stages, self.builder, self.kv
        running, waiting, swapped = self.queues.running, self.queues.waiting, self.queues.swapped
        steady = self._steady
        now = env.now
        # The horizon is read once: what comes later and sooner (a closed loop's next turn,
        # brought by a finish here) is a simpy event queued when it is known (the turn's
        # arrival process starts at once), which ``advance`` never passes.
        horizon = min(self.horizon(), self._deadline,  # type: ignore[misc]
                      self.policy.next_decision_time(now))
        caching = kv.enable_prefix_caching
        took: str | None = None
        while now < horizon:
            # Micro-batches leaving now: each a steady block whose members all go on, the
            # only requests not in flight once it has left.
            while in_flight and in_flight[0].leave <= now:
                b = in_flight[0]
                run = b.run
                entry = steady.get(id(run))
                if (not b.steady or entry is None or entry.run is not run
                        or builder.run.members  # type: ignore[union-attr]
                        or (entry.first_end == run.steps + 1  # type: ignore[union-attr]
                            and (waiting or swapped))):
                    return took
                in_flight.popleft()
                self._leave(b, busy)
                took = _LOOP
            if len(in_flight) < pp and stage_free[0] <= now:
                run = builder.run  # type: ignore[assignment]
                if not run.members:
                    if (not steady or len(busy) != len(running) or not running or waiting
                            or swapped):
                        return took
                    # Every running request is in flight and nothing waits: the policy
                    # would plan nothing; the loop sleeps.
                    self._repeated += 1
                    self.num_repeats += 1
                    took = _SLEEP
                else:
                    entry = steady.get(id(run))
                    if (entry is None or entry.run is not run or run.steps >= entry.order_until
                            or len(busy) + len(run) != len(running)):
                        return took
                    n, s = len(run), run.steps
                    k = s - entry.prices_from
                    if 0 <= k < len(entry.prices):
                        duration = entry.prices[k]
                    else:
                        duration = self._price_block(entry, n, s)
                        if duration is None:
                            return took
                    need = run.members_needing_blocks()
                    if need is not None:
                        free = (kv.free_without_eviction() if caching and waiting
                                else kv.num_free_blocks)
                        if len(need) > free:
                            return took
                        ids = run.ids
                        kv.grow([ids[i] for i in need.tolist()])
                        run.add_block_each(need)
                    builder.detach_run(planned=False)
                    self._enter(in_flight, stage_free, now, duration,
                                _Batch(0.0, now, None, None, None, run, s, n, True))
                    busy.update(run.ids)
                    self._repeated += 1
                    self.num_repeats += 1
                    took = _LOOP
                    continue
            # Asleep, as the loop would be, until the next batch leaves or stage 0 frees up.
            if in_flight:
                wake = in_flight[0].leave
                if len(in_flight) < pp and now < stage_free[0] < wake:
                    wake = stage_free[0]
            elif stage_free[0] > now:
                wake = stage_free[0]
            else:
                return took
            t = now + (wake - now)
            if t >= horizon or not advance(env, t):
                return took
            now = t
            took = _LOOP
        return took
