"""One serving replica as a simpy process: plan, execute, wait, apply, record.

Per step the work is O(requests in the batch): no simpy event per token and no Python object
per token (token timestamps are C doubles in the request's array).

Disaggregation hook: a replica built with ``handoff=callback`` is a prefill replica. When a
step samples a request's first token and the request is not finished, the replica takes it out
of its running set, keeping its KV blocks, and calls ``callback(req, replica)``; the cluster
then moves the KV and calls ``release_handoff(req)`` here once the transfer is done. On the
decode side the cluster calls ``accept_transferred(req)``. See ``sim/cluster/disaggregated.py``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import numpy as np
import simpy

from sim import stop as run_stop
from sim.clock import ChainEnvironment, StepChain, advance, timeout_at
from sim.decode_run import DecodeRun, is_decoding
from sim.executor import Executor
from sim.fast_forward import (
    MAX_JUMP_STEPS,
    Jump,
    is_steady_decode,
    plan_jump,
    plan_run_jump,
)
from sim.kv_manager import KVBlockManager, blocks_for
from sim.metrics import MetricsCollector
from sim.outputs import STEP_ROW_FORMAT, CsvSink, DecodeStepRows, request_row
from sim.plan import DecodeBlock, StepPlan, StepResult
from sim.policy import Policy
from sim.request import Request, RequestStatus, full_length
from sim.step_builder import ReplicaQueues, StepBuilder


class SimulationStalled(RuntimeError):
    """The run cannot go on: the policy keeps producing empty plans while requests wait (a
    policy bug), or a pipelined replica's requests keep restarting their prefills with no
    token sampled (a pool too small for them)."""


class Replica:
    def __init__(
        self,
        env: simpy.Environment,
        replica_id: int,
        policy: Policy,
        executor: Executor,
        kv: KVBlockManager,
        metrics: MetricsCollector,
        requests_sink: CsvSink,
        steps_sink: CsvSink,
        *,
        max_model_len: int,
        check_integrity: bool = False,
        on_finished: Callable[[Request], None] | None = None,
        horizon: Callable[[], float] | None = None,
        fast_forward: bool = False,
        handoff: Callable[[Request, Replica], None] | None = None,
    ) -> None:
        self.env = env
        self.replica_id = replica_id
        self.policy = policy
        self.executor = executor
        self.kv = kv
        self.metrics = metrics
        self.requests_sink = requests_sink
        self.steps_sink = steps_sink
        self.step_rows = DecodeStepRows(steps_sink, replica_id, kv.num_gpu_blocks)
        self.max_model_len = max_model_len
        self.check_integrity = check_integrity
        self.on_finished = on_finished
        self.handoff = handoff
        # Time of the next event from outside this replica (an arrival); decode jumps stop
        # before it, or before the policy's own next deadline (Policy.next_decision_time)
        # if that comes first. Without one, jumps are off.
        self.horizon = horizon
        # A prefill replica hands requests off after their first token (disaggregation): every
        # step's membership changes, and the handoff happens in _apply, so no jumps there.
        self.fast_forward = (fast_forward and horizon is not None and handoff is None
                             and executor.closed_form_decode
                             and getattr(policy, "supports_decode_jumps", False))
        self.num_jumps = 0
        self.num_jump_stops = 0  # finishes inside jumps past finishes
        # Steps taken since the last plan by repeating it (a jump's after its first): the
        # next plan's ``StepBuilder.repeated_steps``.
        self._repeated = 0
        # Lazy decode (``enable_lazy_decode``): while the loop sleeps inside a jump, the
        # jump's chain of step ends, the jump (its plan, rows and itself), the steps whose new
        # KV blocks are taken, and the blocks reserved for transfers during it (step, count).
        self.lazy_decode = False
        self._chain: StepChain | None = None
        self._jump_ctx: tuple[StepPlan, list[Request], Jump] | None = None
        self._taken = 0
        self._reserved: list[tuple[int, int]] = []
        # The workload answers finishes with new requests (a closed loop): jumps stop at the
        # first finish, when the next arrival may change (set by the simulation).
        self.finishes_bring_arrivals = False
        cfg = policy.config
        self.queues = ReplicaQueues()
        self.builder = StepBuilder(self.queues, kv, cfg.preemption_mode, cfg.kv_watermark,
                                   hands_off=handoff is not None)
        if self.fast_forward:
            # Decoding requests as one persistent block (sim/decode_run.py).
            self.builder.enable_decode_run(policy.decode_run_key())
        self.num_steps = 0
        self.num_unfinished = 0
        self.busy_time = 0.0
        # End of the single step in progress (inf between steps): a disaggregated decode
        # replica's horizon reads the prefill replicas' (sim/cluster/disaggregated.py).
        self.busy_until = float("inf")
        self._wakeup: simpy.Event | None = None
        # Requests whose clients gave up (``abort``), applied where the loop plans next.
        self._aborts: list[Request] = []
        self.process = env.process(self._run())

    # ---- arrivals -----------------------------------------------------------------------
    def rejection_reason(self, req: Request) -> str | None:
        """Why a request can never be served here, or None. Checked once, at arrival."""
        cfg = self.policy.config
        total = req.prompt_len + req.max_output_len
        if total > self.max_model_len:
            return (f"too_long: prompt {req.prompt_len} + output {req.max_output_len} "
                    f"> model.max_model_len {self.max_model_len}")
        if not cfg.enable_chunked_prefill and req.prompt_len > cfg.max_num_batched_tokens:
            return (f"prompt_exceeds_batch: prompt {req.prompt_len} > "
                    f"policy.max_num_batched_tokens {cfg.max_num_batched_tokens}")
        # The last sampled token never needs a KV slot; a prefill replica (handoff set) only
        # ever holds the prompt (``StepBuilder.held_length``).
        need = blocks_for(self.builder.held_length(req), self.kv.block_size)
        if need > self.kv.num_gpu_blocks:
            return (f"exceeds_kv_pool: needs {need} blocks, the pool has "
                    f"{self.kv.num_gpu_blocks}")
        if blocks_for(req.prompt_len, self.kv.block_size) > (
                self.kv.num_gpu_blocks - self.builder.watermark_blocks):
            return "exceeds_kv_pool: prompt does not fit above the KV watermark"
        return None

    def add_request(self, req: Request) -> None:
        req.replica_id = self.replica_id
        self.metrics.on_arrival(req)
        reason = self.rejection_reason(req)
        if reason is not None:
            req.reject(reason)
            self.metrics.on_rejected(req)
            self.requests_sink.write(request_row(req))
            return
        if self._chain is not None:  # a lazy jump ends with the step in progress
            self._cut_lazy_jump(self._chain.passed + 1)
        self.executor.add_request(req.request_id, req.prompt_token_ids)
        self.queues.waiting.append(req)
        self.policy.on_arrival(req)
        self.num_unfinished += 1
        self.notify()

    def abort(self, req: Request) -> None:
        """``req``'s client gave up (online mode): it leaves before the next step is
        planned, as vLLM aborts a request between two steps (a step already running finishes
        with it), freeing its blocks. Nothing happens if it has finished by then. Only for
        replicas that plan one step at a time with every request a row of its own: a decode
        jump has planned its steps ahead, and a decode run holds its members' counters."""
        if self.builder.run is not None:
            raise ValueError(f"replica {self.replica_id}: aborting requests needs "
                             f"step_mode=exact (a decode run holds its requests' counters, "
                             f"and a decode jump plans its steps ahead)")
        if req.replica_id != self.replica_id:
            raise ValueError(f"request {req.request_id} is not on replica {self.replica_id}")
        if not req.is_finished:
            self._aborts.append(req)
            self.notify()

    def _apply_aborts(self, busy: set[int] | frozenset[int] = frozenset()) -> None:
        """Take the aborted requests out (those in ``busy``, a step still running them,
        stay pending): out of their queue and the policy's indexes, their blocks freed,
        their row written with status ``aborted``."""
        now, kv, queues = self.env.now, self.kv, self.queues
        pending = []
        for req in self._aborts:
            if req.is_finished:
                continue
            if req.request_id in busy:
                pending.append(req)
                continue
            status = req.status
            if status is RequestStatus.RUNNING:  # (no decode run: abort refuses runs)
                queues.remove_running(req)
            elif status is RequestStatus.SWAPPED:
                queues.swapped.remove(req)
            else:  # waiting, never run or recomputed
                queues.waiting.remove(req)
            req.transition(RequestStatus.ABORTED)
            req.finish_time = now
            self.policy.on_abort(req)
            if kv.has_blocks(req.request_id):
                kv.free(req.request_id)
            self.executor.free_request(req.request_id)
            self.num_unfinished -= 1
            self.metrics.on_aborted(req)
            self.requests_sink.write(request_row(req))
            if self.on_finished is not None:
                self.on_finished(req)
        self._aborts = pending

    @property
    def num_outstanding(self) -> int:
        """Requests accepted and not yet finished (what a router may count)."""
        return self.num_unfinished

    @property
    def kv_usage(self) -> float:
        """Fraction of GPU KV blocks in use (what the replica reports to a router): inside a
        lazy jump, once the steps begun have taken their blocks."""
        if self._chain is not None:
            self._take_blocks_through(self._chain.passed + 1)
        return self.kv.usage

    def cached_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens of ``req`` this replica's prefix cache holds now, in whole blocks
        from the first (what a prefix-aware router may ask; 0 with caching off): inside a
        lazy jump, once the steps begun have taken their blocks (which may evict some)."""
        if self._chain is not None:
            self._take_blocks_through(self._chain.passed + 1)
        kv = self.kv
        if not kv.enable_prefix_caching or req.prefix is None:
            return 0
        keys = self.builder.shared_keys(req)[:(req.prompt_len - 1) // kv.block_size]
        return len(kv.match(keys)) * kv.block_size

    @property
    def waking(self) -> bool:
        """True between ``notify`` and the loop resuming: the replica plans its next step at
        this very moment (a disaggregated decode replica's horizon reads it)."""
        return self._wakeup is not None and self._wakeup.triggered

    def enable_lazy_decode(self) -> bool:
        """Sleep through the steps of a jump (``ChainEnvironment``) instead of stopping where
        another replica's step ends; a router reading this replica's KV use or cache first has
        the steps begun take their blocks (``kv_usage``, ``cached_prefix_tokens``). A
        disaggregated decode replica: a transfer reserved here takes those blocks first too
        (``reserve_transfer``), and one arriving here ends the jump with the step in progress
        (``accept_transferred``). A co-located replica in a closed loop (its jumps end at its
        first finish and before the next arrival known when they start): a request routed
        here ends the jump with the step in progress (``add_request``). False where the
        replica takes no jumps."""
        self.lazy_decode = self.fast_forward and isinstance(self.env, ChainEnvironment)
        return self.lazy_decode

    def notify(self) -> None:
        """Wake the loop if it sleeps waiting for work or for free blocks."""
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

    def verify(self) -> None:
        """``check_integrity``: the KV books, then who holds blocks in which state."""
        self.kv.check_integrity()
        self.builder.check_holders()

    # ---- disaggregation -------------------------------------------------------------------
    def reserve_transfer(self, req: Request) -> bool:
        """Decode side: reserve blocks for ``req``'s KV before it moves here; False (nothing
        changes) while they do not fit. A policy that holds every request's whole length
        (static batching) gets that length reserved now, outside the watermark, as its own
        admission does: its decodes never ask for a block.

        Inside a lazy jump the steps that have started take their blocks first (step by step,
        each took them as it started), so the reservation gets the blocks, and sees the free
        count, that stepping gives. The jump goes on while its later steps' blocks fit what
        is left free (its batch is the same); if the reservation fails, it ends with the step
        in progress (a finish here must then reserve for the transfers that wait)."""
        chain = self._chain
        if chain is not None:
            k = chain.passed + 1  # the step in progress
            self._take_blocks_through(k)
            used = self.kv.num_used_blocks
        if self.policy.reserves_full_length:
            ok = self.builder.reserve_transfer(req, full_length(req), use_watermark=False)
        else:
            ok = self.builder.reserve_transfer(req)
        if chain is not None:
            if not ok:
                self._cut_lazy_jump(k)
            else:
                self._reserved.append((k, self.kv.num_used_blocks - used))
                jump = self._jump_ctx[2]  # type: ignore[index]
                steps = jump.block_step_array
                lo = int(steps.searchsorted(k, side="right"))
                free = self.kv.num_free_blocks
                if len(steps) - lo > free:  # end before the first step whose blocks miss
                    self._cut_lazy_jump(int(steps[lo + free]) - 1)
        return ok

    def accept_transferred(self, req: Request) -> None:
        """Decode side: ``req``'s KV arrived in blocks reserved with ``reserve_transfer``;
        it decodes here from the next step (a lazy jump ends with the step in progress)."""
        chain = self._chain
        if chain is not None:
            # The steps begun take their blocks first (which may evict cached ones): the
            # transferred prefix is registered where its content is not cached then.
            self._take_blocks_through(chain.passed + 1)
            self._cut_lazy_jump(chain.passed + 1)
        req.replica_id = self.replica_id
        self.executor.add_request(req.request_id, req.prompt_token_ids)
        self.builder.accept_transferred(req)
        self.policy.on_transferred(req)
        self.num_unfinished += 1
        self.notify()

    def drop_transfer(self, req: Request) -> None:
        """Decode side: ``req``'s KV arrived after it was aborted (online mode, one step at a
        time): its reserved blocks are free again."""
        self.builder.free_handed_off(req)
        self.notify()

    def release_handoff(self, req: Request) -> None:
        """Prefill side: the KV of a handed-off request has left; free its blocks."""
        self.builder.free_handed_off(req)
        self.executor.free_request(req.request_id)
        self.notify()

    def _handoff(self, req: Request) -> None:
        self.builder.release_for_handoff(req)
        self.policy.on_handoff(req)
        self.num_unfinished -= 1
        self.handoff(req, self)

    def _has_work(self) -> bool:
        q = self.queues
        return bool(q.waiting or q.running or q.swapped)

    # ---- the loop -----------------------------------------------------------------------
    def _run(self):
        env = self.env
        builder, queues, kv, executor, policy = (self.builder, self.queues, self.kv,
                                                 self.executor, self.policy)
        waiting, running, swapped = queues.waiting, queues.running, queues.swapped
        inf = float("inf")
        empty_plans = 0
        idled = False  # no request at all since the last plan
        while True:
            if run_stop.requested:  # a signal asked the run to stop
                run_stop.check()
            if self._aborts:
                self._apply_aborts()
            if not (waiting or running or swapped):
                idled = True
                self._wakeup = env.event()
                yield self._wakeup
                self._wakeup = None
                continue
            start = env.now
            builder.reset(start, repeated_steps=self._repeated, idled=idled)
            idled = False
            self._repeated = 0
            plan = policy.schedule(builder)
            if plan.is_empty:
                if self.check_integrity:  # a plan that only preempted changed state too
                    self.verify()
                empty_plans += 1
                if not (plan.recomputed or plan.swapped_out) or empty_plans > 10_000:
                    # Nothing can run until something changes: wait for the next arrival.
                    if empty_plans > 10_000:
                        raise SimulationStalled(self._stall_message())
                    self._wakeup = env.event()
                    yield self._wakeup
                    self._wakeup = None
                continue
            empty_plans = 0
            requests = builder.scheduled_requests
            if self.fast_forward and not self.check_integrity and is_steady_decode(plan):
                jump = self._plan_jump(plan, requests, start)
                if jump is not None:
                    # Queue lengths and blocks in use as the intermediate steps saw them
                    # (arrivals during the final step are processed before this process
                    # resumes).
                    seen = (len(waiting), len(running), len(swapped))
                    used0 = kv.num_used_blocks
                    block = plan.decode_block
                    if block is not None and builder.run.steps != builder.run_block_step:
                        raise AssertionError("a decode jump applied out of step with its run")
                    if self.lazy_decode:
                        yield from self._lazy_decode_jump(plan, requests, jump, start, seen,
                                                          used0)
                        continue
                    done = g = 0  # steps taken, stops passed
                    while True:
                        groups = jump.groups  # members finish at the end of these stops
                        stop = groups[g][0] if g < len(groups) else jump.num_steps
                        # A stretch's new blocks are in use while it runs (a router reading
                        # KV use during the last step sees them, as step by step).
                        self._take_jump_blocks(plan, requests, jump, done, stop)
                        t = float(jump.ends[stop - 1])
                        if not advance(env, t):
                            yield timeout_at(env, t)
                        if stop == jump.num_steps:
                            break
                        self._finish_jump_members(builder.run, jump, done, stop, groups[g][1])
                        self.num_jump_stops += 1
                        done = stop
                        g += 1
                    self._apply_jump(plan, requests, jump, start, seen, used0, done)
                    continue
            result = executor.execute(plan)
            duration = result.duration
            if duration < 0:
                raise ValueError(f"executor returned a negative duration {duration}")
            # The instant a timeout of ``duration`` made now fires at.
            if not advance(env, start + duration):
                self.busy_until = start + duration
                yield env.timeout(duration)
                self.busy_until = inf
            self.busy_time += duration
            self._apply(plan, requests, result)
            self._record_step(start, duration, plan)
            if self.check_integrity:
                self.verify()

    def _lazy_decode_jump(self, plan: StepPlan, requests: list[Request], jump: Jump,
                          start: float, seen: tuple[int, int, int], used0: int):
        """Take ``jump`` as a chain of step ends (``enable_lazy_decode``): the loop resumes
        only at its stops and its end, each where the timeout of that step would fire; a
        transfer reserved or arriving here meanwhile sees which steps have started
        (``StepChain.passed``), takes their blocks or cuts the jump (``reserve_transfer``,
        ``accept_transferred``). A stretch's blocks are taken once it has run, or when a
        reservation needs them first."""
        env = self.env
        chain = StepChain(jump.ends.tolist())
        self._chain = chain
        self._jump_ctx = (plan, requests, jump)
        self._taken = 1  # step 1's blocks are the plan's
        self._reserved = []
        done = g = 0  # steps whose members have finished, stops passed
        while True:
            groups = jump.groups
            stop = groups[g][0] if g < len(groups) else jump.num_steps
            ev = env.wait_chain(chain, stop)  # type: ignore[attr-defined]
            if ev is not None:
                yield ev
                chain.resumed()
            stop = chain.passed  # a cut may have brought the end forward
            self._take_blocks_through(stop)
            if stop == jump.num_steps:
                break
            self._finish_jump_members(self.builder.run, jump, done, stop, groups[g][1])
            self.num_jump_stops += 1
            done = stop
            g += 1
        self._chain = self._jump_ctx = None
        if plan.decode_block is not None:
            self._grant_run_blocks(jump)
        self._apply_jump(plan, requests, jump, start, seen, used0, done, self._reserved)

    def _take_blocks_through(self, k: int) -> None:
        """Allocate the new KV blocks of the lazy jump's steps up to ``k`` not yet taken,
        step by step and rows in order, as single steps would."""
        taken = self._taken
        if k <= taken:
            return
        self._taken = k
        plan, requests, jump = self._jump_ctx  # type: ignore[misc]
        members = jump.block_members
        if members is None or not len(members):
            return
        owners = jump.block_owners or self._set_block_owners(plan, requests, jump)
        steps = jump.block_step_array
        lo = int(steps.searchsorted(taken, side="right"))
        hi = int(steps.searchsorted(k, side="right"))
        if hi > lo and not self.kv.grow(owners[lo:hi]):
            raise AssertionError("decode jump overran the KV pool")  # planned so

    def _cut_lazy_jump(self, k: int) -> None:
        """End the lazy jump with step ``k`` (the step in progress or a later one)."""
        jump = self._jump_ctx[2]  # type: ignore[index]
        if k < jump.num_steps:
            jump.truncate(k)
            self._chain.cut(k)  # type: ignore[union-attr]

    def _plan_jump(self, plan: StepPlan, requests: list[Request], start: float) -> Jump | None:
        """The decode jump that starts with steady decode ``plan`` at ``start``, or None (one
        step at a time)."""
        if plan.decode_block is None and any(r.num_output_tokens == 0 for r in requests):
            # A prompt's last token (its step may complete a block of its shared prefix,
            # which the cache names then): one step.
            return None
        # The next arrival, or the policy's own next deadline if that comes first (a lazy
        # replica's horizon is a few arrivals ahead: what reaches it cuts the jump).
        horizon = min(self.horizon(), self.policy.next_decision_time(start))
        if horizon <= start:  # the next step may see the event: one step at a time
            return None
        return self._size_jump(plan, requests, start, horizon)

    def _size_jump(self, plan: StepPlan, requests: list[Request], start: float,
                   horizon: float) -> Jump | None:
        """The jump of ``_plan_jump`` up to ``horizon``, by the plan's shape."""
        q = self.queues
        # The blocks the jump may take: the free ones, or, while requests wait with prefix
        # caching on, those before the first that would evict cached content (a waiting
        # request's cache hit, and so whether it fits, may change with it).
        free = (self.kv.free_without_eviction() if q.waiting and self.kv.enable_prefix_caching
                else self.kv.num_free_blocks)
        block = plan.decode_block
        if block is None:
            return plan_jump(plan, requests, self.executor.decode_durations, start, horizon,
                             free, self.kv.block_size,
                             order_steps=self.policy.decode_order_steps)
        run, run_step = self.builder.run, self.builder.run_block_step
        # A finish may bring a new arrival (a closed loop): then stop at it.
        past = not q.waiting and not q.swapped and (
            len(run) == len(q.running)) and not self.finishes_bring_arrivals
        max_steps = MAX_JUMP_STEPS
        if run.key is not None:  # a policy's order, which may change as they decode
            max_steps = self.policy.decode_order_steps(run.members, max_steps,
                                                       run.end - run_step)
        executor = self.executor
        return plan_run_jump(
            plan, run, run_step, executor.decode_durations, start, horizon,
            free, max_steps,
            stretch_durations_fn=executor.decode_stretch_durations if past else None,
            step_pricer=executor.decode_step_pricer)

    def _apply(self, plan: StepPlan, requests: list[Request], result: StepResult,
               block_run: tuple[DecodeRun, int] | None = None) -> None:
        """Apply a step's results at its end. ``block_run``: the decode run whose block the
        plan holds and its step when planned, where the run left the builder with the plan
        (a pipelined replica's micro-batch: ``StepBuilder.detach_run``)."""
        now = self.env.now
        sampled = result.sampled_token_ids
        run = self.builder.run
        if run is not None and run.members and not plan.num_blocks and self.builder.run_in_plan:
            # Someone expanded the plan's block into rows: go row by row.
            self.builder.dissolve_run()
        k = 0
        i = 0  # index into requests (parallel to the expanded rows)
        joining: list[Request] = []
        caching = self.kv.enable_prefix_caching
        for part in plan.parts:
            if isinstance(part, DecodeBlock):
                self._apply_block(now, block_run)
                i += len(part)
                continue
            req = requests[i]
            i += 1
            req.num_computed_tokens += part.num_new_tokens
            if caching and req.prefix is not None and part.start_position < req.prompt_len:
                self.builder.register_computed(req)
            if not part.sample:
                if run is not None and run.complete and is_decoding(req):
                    joining.append(req)
                continue
            token = None
            if sampled is not None:
                token = sampled[k]
                k += 1
            req.record_token(now, token)
            if req.num_output_tokens >= req.max_output_len:
                self._finish(req, now)
            elif self.handoff is not None:
                self._handoff(req)
            elif run is not None and run.complete and is_decoding(req):
                joining.append(req)
        for req in joining:  # after the run's own step: they decode from the next one
            run.join(req, self.kv.block_tables[req.request_id])  # type: ignore[union-attr]

    def _apply_block(self, now: float, block_run: tuple[DecodeRun, int] | None = None) -> None:
        """The decode run took one step (the block is the whole run): the builder's, or
        ``block_run``'s (see ``_apply``)."""
        if block_run is None:
            run, step = self.builder.run, self.builder.run_block_step
        else:
            run, step = block_run
        if run.steps != step:
            raise AssertionError("a decode block applied out of step with its run")
        done = run.advance([now])
        if len(done):
            for req in run.remove_at(done.tolist()):
                self._finish(req, now)

    def _take_jump_blocks(self, plan: StepPlan, requests: list[Request], jump: Jump,
                          done: int, stop: int) -> None:
        """Allocate the new KV blocks of jump steps ``done + 1 .. stop``, step by step and
        rows in order, as single steps would."""
        members = jump.block_members
        if members is None or not len(members):
            return
        if done == 0:
            # The owners of all the jump's new blocks, in allocation order, once.
            if plan.decode_block is not None:
                self._grant_run_blocks(jump)
            self._set_block_owners(plan, requests, jump)
        owners = jump.block_owners
        if jump.stops:  # this stretch's share
            steps = jump.block_steps
            lo = bisect_left(steps, done + 1)
            owners = owners[lo:bisect_left(steps, stop + 1, lo)]
        if owners and not self.kv.grow(owners):
            raise AssertionError("decode jump overran the KV pool")  # planned so

    def _set_block_owners(self, plan: StepPlan, requests: list[Request], jump: Jump,
                          ) -> list[int]:
        """The owners of all the jump's new blocks, in allocation order (the run's members
        stay in its arrays until the jump ends, finished or not)."""
        ids = (self.builder.run.ids if plan.decode_block is not None
               else [r.request_id for r in requests])
        jump.block_owners = [ids[m] for m in jump.block_members.tolist()]
        return jump.block_owners

    def _grant_run_blocks(self, jump: Jump) -> None:
        """The decode run's members hold the jump's new blocks (their KV bounds move)."""
        members = jump.block_members
        if members is None or not len(members):
            return
        run = self.builder.run
        if jump.num_steps <= run.block_size:  # at most one block each
            run.add_block_each(members)
        else:
            run.add_blocks(np.bincount(members, minlength=len(run.ids)))

    def _finish_jump_members(self, run: DecodeRun, jump: Jump, done: int, stop: int,
                             members: list[int]) -> None:
        """Take jump steps ``done + 1 .. stop`` in the run (their blocks already taken) and
        finish the members that sampled their last token in step ``stop``, at its end (they
        leave the run's arrays when the jump ends)."""
        run.take_steps(jump.ends[done:stop])
        out = run.release(members)
        free0 = self.kv.num_free_blocks
        now = float(jump.ends[stop - 1])
        for req in out:
            self._finish(req, now)
        # Blocks shared with requests still running (a cached prefix) stay in use.
        jump.freed.append(self.kv.num_free_blocks - free0)

    def _apply_jump(self, plan: StepPlan, requests: list[Request], jump: Jump,
                    start: float, queue_lengths: tuple[int, int, int], used0: int,
                    done: int = 0, reserved: list[tuple[int, int]] | None = None) -> None:
        """Apply decode steps ``done + 1 .. jump.num_steps`` of a jump at once (see
        sim/fast_forward.py; the earlier ones were applied at the jump's stops) and record
        them all. ``reserved``: blocks reserved for transfers during the jump, by the step
        in progress then."""
        k, ends = jump.num_steps, jump.ends
        last = float(ends[-1])
        block = plan.decode_block
        if block is not None:
            run = self.builder.run
            run.take_steps(ends[done:])
            if jump.last_members:
                for req in run.release(jump.last_members):
                    self._finish(req, last)
            if jump.finishing:
                run.drop(jump.finishing)
        else:
            first = float(ends[0])
            times = ends.tobytes()
            for req in requests:
                req.num_computed_tokens += k
                req.num_output_tokens += k
                if req.first_token_time is None:
                    req.first_token_time = first
                req.last_token_time = last
                req.token_times.frombytes(times)
            for req in [r for r in requests if r.num_output_tokens >= r.max_output_len]:
                self._finish(req, last)
        self.busy_time += float(np.add.reduce(jump.durations))
        # Steps 1..k-1 as the step-by-step loop would have recorded them (one C-level pass).
        m = k - 1
        sizes = jump.batch_sizes
        if m and self.steps_sink.enabled:
            waiting, running, swapped = queue_lengths
            change = jump.new_blocks()[:m]
            if jump.stops:  # blocks freed at the stops, after their step's new ones
                change[np.asarray(jump.stops) - 1] -= jump.freed  # distinct steps
            for step, n in reserved or ():
                if step <= m:
                    change[step - 1] += n
            used = (used0 + np.cumsum(change)).tolist()
            if sizes is None:
                rows: int | list[int] = len(requests)
                runs: int | list[int] = running
            else:  # the batch shrinks after each stop, and the running set with it
                rows = sizes[:m]
                gone = sizes[0] - running  # members leave the running set as they finish
                runs = [s - gone for s in sizes[1:k]]
            self.step_rows.write(self.num_steps + 1, [start] + ends[:m - 1].tolist(),
                                 jump.durations[:m].tolist(), rows, waiting, runs, swapped,
                                 used)
        self.num_steps += m
        self._repeated += m
        # A jump cut to one step (an arrival here during its first) records only that step.
        self._record_step(float(ends[-2]) if k > 1 else start, float(jump.durations[-1]), plan,
                          None if sizes is None else sizes[-1])
        self.num_jumps += 1

    def _finish(self, req: Request, now: float) -> None:
        req.finish_time = now
        req.transition(RequestStatus.FINISHED)
        self.queues.remove_running(req)
        rid = req.request_id
        if req.output_key is not None:
            self.builder.register_finished(req)
        self.kv.free(rid)
        self.executor.free_request(rid)
        self.num_unfinished -= 1
        self.metrics.on_finished(req)
        self.requests_sink.write_request(req)
        if self.on_finished is not None:
            self.on_finished(req)

    def _record_step(self, start: float, duration: float, plan: StepPlan,
                     decode_rows: int | None = None) -> None:
        """Write the step's row. ``decode_rows``: the plan is one decode block of which only
        that many rows were left in this step (the last step of a jump past finishes)."""
        self.num_steps += 1
        if not self.steps_sink.enabled:
            return
        q, kv = self.queues, self.kv
        prefill = decode = sampled = rows = 0
        parts = plan.parts if decode_rows is None else ()
        if decode_rows is not None:
            decode = sampled = rows = decode_rows
        for s in parts:
            if isinstance(s, DecodeBlock):
                decode += len(s)
                sampled += len(s)
                rows += len(s)
                continue
            rows += 1
            if s.num_new_tokens == 1 and s.start_position > 0:
                decode += 1
            else:
                prefill += s.num_new_tokens
            sampled += s.sample
        used = kv.num_used_blocks
        self.steps_sink.write_formatted((
            self.num_steps, self.replica_id, repr(start), repr(duration), rows,
            prefill, decode, sampled, len(q.waiting), len(q.running), len(q.swapped), used,
            round(used / kv.num_gpu_blocks, 6), len(plan.recomputed), len(plan.swapped_out),
            len(plan.swap_out), len(plan.swap_in),
        ), STEP_ROW_FORMAT)

    def _stall_message(self) -> str:
        q = self.queues
        head = q.waiting[0] if q.waiting else None
        return (f"replica {self.replica_id}: policy {self.policy.config.name!r} produced empty "
                f"plans with {len(q.waiting)} waiting, {len(q.running)} running, "
                f"{len(q.swapped)} swapped; {self.kv.num_free_blocks} free blocks; head of "
                f"queue: {head}")
