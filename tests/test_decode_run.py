"""The decode run (sim/decode_run.py) and the fast cost-model paths behind step_mode=fast:
bulk decode scheduling equals row-by-row scheduling (the same rows, block ids and free queue),
a decode block expands into the rows it stands for, the memoized cost model equals the
term-by-term breakdown bit for bit, and co-located clusters give the same results in fast and
exact mode, down to the block ids handed out."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executors.cost_model import RooflineCostModel
from executors.step_terms import Coefficients, StepShape, step_shape
from experiments.simulation import Simulation
from policies.budget import Budget, schedule_running
from sim.kv_manager import KVBlockManager
from sim.plan import DecodeBlock, ScheduledRequest, StepPlan
from sim.request import Request, RequestStatus
from sim.specs import load_hardware_spec, load_model_spec
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.helpers import assert_approx, compose_cfg, free_queues

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence


def _decoding_replica(contexts: list[int], outputs: list[int], num_blocks: int, bs: int,
                      with_run: bool, order_key=None) -> tuple[StepBuilder, list[Request]]:
    """Running requests that each computed ``contexts[i]`` tokens and sampled ``outputs[i]``
    (so one token is pending), holding exactly the blocks for their context."""
    kv = KVBlockManager(num_blocks, bs)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    if with_run:
        builder.enable_decode_run(order_key)
    reqs = []
    for i, (ctx, out) in enumerate(zip(contexts, outputs)):
        r = Request(i, float(i), ctx + 1 - out, out + 50)
        r.transition(RequestStatus.RUNNING)
        r.num_computed_tokens = ctx
        r.num_output_tokens = out
        assert kv.allocate_slots(i, ctx) is not None
        queues.add_running(r)
        reqs.append(r)
    if with_run:  # as the replica's steps would have made them members
        builder.run.rebuild(queues.running, kv.block_tables)
    return builder, reqs


def _state(builder: StepBuilder, plan: StepPlan, preempted: list[Request]) -> tuple:
    rows = [(s.request_id, s.start_position, s.num_new_tokens, list(s.block_table), s.sample)
            for s in plan.scheduled]
    kv = builder._kv
    return (rows, {k: list(v) for k, v in kv.block_tables.items()}, kv._gpu.free_blocks(),
            [r.request_id for r in preempted], [r.num_computed_tokens for r in builder.running])


@settings(max_examples=60, deadline=None)
@given(contexts=st.lists(st.integers(1, 70), min_size=1, max_size=12),
       bs=st.sampled_from([1, 4, 16]), spare=st.integers(0, 6))
def test_bulk_decode_scheduling_equals_row_by_row(contexts, bs, spare):
    outputs = [min(c, 1 + c % 3) for c in contexts]
    held = sum(-(-c // bs) for c in contexts)
    states = []
    for with_run in (True, False):
        builder, _ = _decoding_replica(contexts, outputs, held + spare, bs, with_run)
        builder.reset(0.0)
        budget = Budget(builder, 4096, 256)
        preempted = schedule_running(builder, budget)
        plan = builder.build()
        if with_run:  # the bulk path runs exactly when every new block fits
            fits = sum(c % bs == 0 for c in contexts) <= spare
            assert (plan.decode_block is not None) == fits
        states.append(_state(builder, plan, preempted))
    assert states[0] == states[1]


def _with_prefill_tail(builder: StepBuilder, prompt: int, computed: int) -> Request:
    """A request mid-prefill (``computed`` of its ``prompt`` tokens in blocks) running after
    the decoding ones: vLLM v1's prompt admitted last with part of its prompt."""
    kv, queues = builder._kv, builder._q
    r = Request(len(queues.running), 100.0, prompt, 20)
    r.transition(RequestStatus.RUNNING)
    r.num_computed_tokens = computed
    if computed:
        assert kv.allocate_slots(r.request_id, computed) is not None
    queues.add_running(r)
    return r


@settings(max_examples=60, deadline=None)
@given(contexts=st.lists(st.integers(1, 70), min_size=1, max_size=10),
       bs=st.sampled_from([1, 4, 16]), spare=st.integers(0, 12),
       prompt=st.integers(3, 200), done=st.floats(0.0, 1.0), budget=st.integers(12, 300))
def test_bulk_decodes_then_a_prompt_mid_prefill_equal_row_by_row(contexts, bs, spare, prompt,
                                                                  done, budget):
    """``running`` with a prompt mid-prefill after the decode run's members: the run's block,
    then the prompt's chunk row by row (budget, blocks and preemptions), is exactly the rows
    in order."""
    outputs = [min(c, 1 + c % 3) for c in contexts]
    computed = 1 + int((prompt - 3) * done)  # at least one chunk done, two tokens left
    held = sum(-(-c // bs) for c in contexts) + -(-computed // bs)
    states = []
    for with_run in (True, False):
        builder, _ = _decoding_replica(contexts, outputs, held + spare, bs, with_run)
        _with_prefill_tail(builder, prompt, computed)
        builder.reset(0.0)
        preempted = schedule_running(builder, Budget(builder, budget, 256))
        plan = builder.build()
        if with_run:  # the bulk path runs exactly when every new block fits
            fits = sum(c % bs == 0 for c in contexts) <= spare
            assert (plan.num_blocks == 1) == fits
        states.append(_state(builder, plan, preempted))
    assert states[0] == states[1]


def test_a_prompt_mid_prefill_between_members_takes_the_rows():
    """The block stands for the first rows in order only: with a request that is not a
    member before a member, ``running`` is scheduled row by row."""
    builder, _ = _decoding_replica([15, 16], [1, 1], 12, 16, True)
    _with_prefill_tail(builder, 40, 8)
    late = Request(3, 101.0, 10, 5)  # decoding, a member, after the prompt mid-prefill
    late.transition(RequestStatus.RUNNING)
    late.num_computed_tokens, late.num_output_tokens = 10, 1
    assert builder._kv.allocate_slots(3, 10) is not None
    builder._q.add_running(late)
    builder.run.rebuild(builder._q.running, builder._kv.block_tables)
    builder.reset(0.0)
    assert not builder.schedule_decode_run(builder.running, 100)
    builder, _ = _decoding_replica([15, 16], [1, 1], 12, 16, True)
    tail = _with_prefill_tail(builder, 40, 8)
    builder.reset(0.0)
    assert builder.schedule_decode_run(builder.running, 100)
    assert list(builder.after_decode_run(builder.running)) == [tail]


@settings(max_examples=40, deadline=None)
@given(contexts=st.lists(st.integers(1, 70), min_size=1, max_size=12),
       bs=st.sampled_from([1, 4, 16]), steps=st.integers(0, 3))
def test_remaining_outputs_from_the_run_equal_each_requests(contexts, bs, steps):
    """``StepBuilder.remaining_outputs`` reads the decode run's arrays where the run holds
    every decode: the same numbers, in the same order, as each request's own counters,
    after run steps too."""
    outputs = [min(c, 1 + c % 3) for c in contexts]
    got = []
    for with_run in (True, False):
        builder, reqs = _decoding_replica(contexts, outputs, 4096, bs, with_run)
        for k in range(steps):  # decode steps, every request one more token
            builder.reset(float(k))
            schedule_running(builder, Budget(builder, 4096, 256))
            builder.build()
            if with_run:
                builder.run.take_steps(np.array([k + 1.0]))
            else:
                for r in reqs:
                    r.num_computed_tokens += 1
                    r.record_token(k + 1.0)
        builder.reset(float(steps))
        remaining = builder.remaining_outputs(builder.split_running()[0])
        assert isinstance(remaining, np.ndarray) == with_run
        got.append([int(x) for x in remaining])
        assert got[-1] == [r.max_output_len - r.num_output_tokens for r in reqs]
    assert got[0] == got[1]


def _longest_context_first(r: Request) -> tuple[int, int]:
    """A policy's own running order (not arrival order) that moves as requests decode."""
    return (-r.num_computed_tokens, r.request_id)


@settings(max_examples=60, deadline=None)
@given(contexts=st.lists(st.integers(1, 70), min_size=1, max_size=12),
       bs=st.sampled_from([1, 4, 16]), spare=st.integers(0, 6))
def test_bulk_scheduling_in_a_policys_order_equals_row_by_row(contexts, bs, spare):
    """A run kept in a policy's order (``Policy.decode_run_key``, e.g. SJF's) is granted as
    one block when the policy passes the running requests in that order: the same rows in
    the same order, the same blocks, as ``schedule(req, 1)`` row by row."""
    outputs = [min(c, 1 + c % 3) for c in contexts]
    held = sum(-(-c // bs) for c in contexts)
    states = []
    for with_run in (True, False):
        builder, _ = _decoding_replica(contexts, outputs, held + spare, bs, with_run,
                                       _longest_context_first)
        builder.reset(0.0)
        order = sorted(builder.running, key=_longest_context_first)
        preempted = schedule_running(builder, Budget(builder, 4096, 256), order=order)
        plan = builder.build()
        if with_run:
            fits = sum(c % bs == 0 for c in contexts) <= spare
            assert (plan.decode_block is not None) == fits
            if fits:
                assert builder.run.members == order
        states.append(_state(builder, plan, preempted))
    assert states[0] == states[1]


def test_a_run_in_a_policys_order_follows_it_when_it_changes():
    """The policy's order moved (here: a key the test changes): the run takes the new order
    and grants it as one block; an order that is not the running set goes row by row."""
    flip = {"on": False}

    def key(r: Request) -> tuple[int, int]:
        return (-r.request_id if flip["on"] else r.request_id, 0)

    builder, reqs = _decoding_replica([16, 20, 32], [1, 1, 1], 12, 16, True, key)
    run = builder.run
    assert run.members == reqs and run.ids == [0, 1, 2]
    flip["on"] = True
    builder.reset(0.0)
    assert not builder.schedule_decode_run(reqs[:2], 100)  # not every running request
    assert not builder.schedule_decode_run(builder.running, 100)  # not a list in its order
    order = sorted(builder.running, key=key)
    assert builder.schedule_decode_run(order, 100)
    assert run.members == order and run.ids == [2, 1, 0]
    assert [t is builder._kv.block_tables[i] for t, i in zip(run.tables, run.ids)] == [True] * 3
    # 2 and 0 hold full blocks: in the new order 2 gets the first free block (5), then 0.
    assert run.ctx0.tolist() == [32, 20, 16]
    assert builder._kv.block_tables[2] == [3, 4, 5] and builder._kv.block_tables[0] == [0, 6]
    assert builder.build().decode_block.start_positions.tolist() == [32, 20, 16]


def test_bulk_path_is_taken_and_a_single_row_operation_dissolves_the_run():
    builder, reqs = _decoding_replica([15, 16, 17], [1, 1, 1], 12, 16, True)
    builder.reset(0.0)
    assert builder.schedule_decode_run(builder.running, 100)
    plan = builder.build()
    block = plan.decode_block
    assert isinstance(block, DecodeBlock) and len(block) == 3
    assert block.start_positions.tolist() == [15, 16, 17] and block.ctx_max == 17
    assert all(builder.is_scheduled(r) and builder.granted(r) == 1 for r in reqs)
    assert builder._kv.block_tables[1] == [1, 4]  # 16 tokens held: the 17th needs a block
    # Preempting a member turns the block back into rows and the run into plain requests.
    builder.preempt(reqs[2])
    assert plan.decode_block is None and [s.request_id for s in plan.scheduled] == [0, 1]
    assert builder.run is not None and len(builder.run) == 0 and not builder.run.complete
    assert reqs[0].num_computed_tokens == 15 and reqs[0]._run is None


def test_run_counters_read_through_and_survive_leaving():
    builder, reqs = _decoding_replica([20, 30], [2, 5], 20, 16, True)
    run = builder.run
    assert len(run) == 2 and reqs[0]._run is run
    done = run.advance(np.array([1.0, 2.0, 3.0]))
    assert len(done) == 0
    assert [r.num_computed_tokens for r in reqs] == [23, 33]
    assert [r.num_output_tokens for r in reqs] == [5, 8]
    assert reqs[1].last_token_time == 3.0 and reqs[1].first_token_time == 1.0
    run.remove_at([0])
    assert reqs[0]._run is None and reqs[0].num_computed_tokens == 23
    assert list(reqs[0].token_times) == [1.0, 2.0, 3.0]
    run.advance([4.0])
    assert list(reqs[1].token_times) == [1.0, 2.0, 3.0, 4.0] and reqs[1].num_output_tokens == 9


@settings(max_examples=60, deadline=None)
@given(contexts=st.lists(st.integers(1, 90), min_size=2, max_size=14),
       split=st.integers(0, 14), steps=st.tuples(st.integers(0, 5), st.integers(0, 5)),
       bs=st.sampled_from([1, 4, 16]), keyed=st.booleans())
def test_a_run_absorbing_another_equals_one_rebuilt_from_both(contexts, split, steps, bs,
                                                              keyed):
    """A pipelined replica's micro-batch run rejoining the others (``DecodeRun.absorb``,
    one by one or in one sort): the members in the run's order with their own counters,
    token times, block tables and KV bounds, as one run rebuilt from all of them holds."""
    from sim.decode_run import DecodeRun
    outputs = [min(c, 1 + c % 3) for c in contexts]
    key = (lambda r: (-r.prompt_len, r.request_id)) if keyed else None
    builder, reqs = _decoding_replica(contexts, outputs, 2000, bs, True, key)
    tables = builder._kv.block_tables
    a, b = DecodeRun(bs, key), DecodeRun(bs, key)
    builder.run.dissolve()
    cut = min(split, len(reqs))
    a.rebuild(reqs[:cut], tables)
    b.rebuild(reqs[cut:], tables)
    for run, k in zip((a, b), steps):  # each its own steps first (times the step index)
        run.advance([float(run.steps + j) for j in range(k)])
    counters = [(r.num_computed_tokens, r.num_output_tokens, list(r.token_times)) for r in reqs]
    bounds = {r.request_id: len(tables[r.request_id]) * bs - r.num_computed_tokens
              for r in reqs}
    a.absorb(b)
    assert len(b) == 0 and not b.ids and all(r._run is a for r in reqs)
    order = sorted(reqs, key=key or (lambda r: (r.arrival_time, r.request_id)))
    assert a.members == order and a.ids == [r.request_id for r in order]
    assert a.tables == [tables[r.request_id] for r in order]
    assert [(r.num_computed_tokens, r.num_output_tokens, list(r.token_times))
            for r in reqs] == counters
    assert (a.ctx0 + a.steps).tolist() == [r.num_computed_tokens for r in order]
    # (the run step from which a member's token no longer fits its blocks)
    assert (a.bound - a.steps).tolist() == [bounds[r.request_id] for r in order]
    assert (a.end - a.steps).tolist() == [r.max_output_len - r.num_output_tokens
                                          for r in order]
    assert (a.ctx0_sum, a.ctx0_max) == (int(a.ctx0.sum()), int(a.ctx0.max()))
    a.advance([99.0])  # one more step for every member, the absorbed ones included
    assert [r.num_output_tokens for r in reqs] == [c[1] + 1 for c in counters]
    assert all(list(r.token_times)[-1] == 99.0 for r in reqs)


def test_decode_block_expands_into_the_rows_it_stands_for():
    tables = [[0], [1, 2], [3]]
    block = DecodeBlock.of_rows([7, 8, 9], [5, 20, 9], tables)
    rows = [ScheduledRequest(7, 5, 1, tables[0], True), ScheduledRequest(8, 20, 1, tables[1], True),
            ScheduledRequest(9, 9, 1, tables[2], True)]
    prefill = ScheduledRequest(3, 0, 40, [4, 5, 6], True)
    plan = StepPlan()
    plan.add_row(prefill)
    plan.add_block(block)
    by_rows = StepPlan([prefill, *rows])
    assert step_shape(plan) == step_shape(by_rows)
    assert (plan.num_tokens, plan.num_decode_tokens, plan.num_sampled, plan.num_rows) == (
        43, 3, 4, 4)
    assert plan.scheduled == [prefill, *rows]  # expanded once, in order
    assert plan.decode_block is None and step_shape(plan) == step_shape(by_rows)


def _cost_models() -> list[RooflineCostModel]:
    m8, a100 = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    fitted = Coefficients(s_per_step=2e-4, s_per_seq=1e-5, s_per_token=3e-7, s_per_flop=4e-15,
                          s_per_weight_byte=5e-13, s_per_attn_flop=7e-15, s_per_diag_flop=9e-15,
                          s_per_kv_byte=6e-13, s_per_cta_byte=1e-10, s_per_sm_byte=2e-11,
                          s_per_attn_wave=2e-6, s_per_attn_kernel=5e-6, s_per_split_partial=3e-8,
                          s_per_kv_tile=1e-6, s_per_prefill_row=4e-6, s_per_first_seq=3e-6,
                          seq_knee=4, sharpness=3.0)
    return [RooflineCostModel(m8, a100),
            RooflineCostModel(load_model_spec("llama3_70b"), load_hardware_spec("h100_sxm"), 4,
                              pipeline_parallel=2),
            RooflineCostModel(load_model_spec("tiny"), a100, coefficients=fitted),
            RooflineCostModel(m8, a100, num_sms=None),
            # A fitted GPU profile: split partials and per-tile latency priced (flash tiles).
            RooflineCostModel(m8, a100, coefficients=fitted),
            # A CPU-fitted profile: no query tiles (torch's reference attention).
            RooflineCostModel(load_model_spec("tiny"), a100, coefficients=fitted, num_sms=None,
                              attention_tile=1)]


MODELS = _cost_models()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(MODELS) - 1), nd=st.integers(0, 300), npf=st.integers(0, 3),
       chunk=st.integers(1, 900), cached=st.integers(0, 5000), ctx=st.integers(1, 8000),
       swap_out=st.sampled_from([0, 0, 4]), swap_in=st.sampled_from([0, 0, 3]))
def test_memoized_duration_is_the_breakdown_total_bit_for_bit(which, nd, npf, chunk, cached,
                                                                ctx, swap_out, swap_in):
    ex = MODELS[which]
    rows = [ScheduledRequest(i, cached, chunk, [], True) for i in range(npf)]
    rows += [ScheduledRequest(100 + i, ctx + 7 * i, 1, [], i % 2 == 0) for i in range(nd)]
    shape = step_shape(StepPlan(rows))._replace(swap_out_blocks=swap_out, swap_in_blocks=swap_in)
    assert ex.duration(shape) == ex.breakdown_shape(shape).total
    assert ex.execute(StepPlan(rows)).duration == ex.breakdown(StepPlan(rows)).total


@pytest.mark.parametrize("which", range(len(MODELS)))
def test_token_terms_are_the_breakdown_terms_bit_for_bit(which):
    # duration's per-token memo is filled without a whole breakdown on one GPU: every token
    # count a step can have (up to a large batch) must give breakdown_shape's floats.
    ex = MODELS[which]
    for n in range(8193):
        b = ex.breakdown_shape(StepShape(num_tokens=n))
        assert ex._token_terms(n) == (b.linear, b.elementwise, b.communication, b.pipeline), n


@pytest.mark.parametrize("which", range(len(MODELS)))
def test_one_step_stretches_price_as_longer_ones_bit_for_bit(which):
    # A one-step stretch is priced in plain floats (numpy's hypot): the same float as the
    # first step of the array path, for every batch size (geometry) and context.
    ex = MODELS[which]
    rng = np.random.default_rng(100 + which)
    for nd in (1, 2, 5, 10, 11, 27, 54, 55, 128, 300):
        for _ in range(20):
            mx = int(rng.integers(1, 9000))
            ctx = nd * mx - int(rng.integers(0, nd))
            one = ex.decode_run_durations(nd, ctx, mx, 1)
            assert one.shape == (1,) and one[0] == ex.decode_run_durations(nd, ctx, mx, 4)[0]


@pytest.mark.parametrize("which", range(len(MODELS)))
def test_decode_durations_follow_the_breakdown_step_by_step(which):
    ex = MODELS[which]
    rng = np.random.default_rng(which)
    for nd in (1, 3, 40, 129, 300):
        ctx = rng.integers(1, 6000, nd)
        plan = StepPlan([ScheduledRequest(i, int(c), 1, [], True) for i, c in enumerate(ctx)])
        got = ex.decode_durations(plan, 40)
        for j in (0, 1, 17, 39):
            step = StepPlan([ScheduledRequest(i, int(c) + j, 1, [], True)
                             for i, c in enumerate(ctx)])
            assert got[j] == pytest.approx(ex.execute(step).duration, rel=1e-14)


def _cluster_run(mode: str, overrides: tuple[str, ...]):
    res = Simulation(compose_cfg(f"step_mode={mode}", *overrides)).run()
    reqs = pd.DataFrame(res.requests_sink.rows, columns=res.requests_sink.columns)
    steps = pd.DataFrame(res.steps_sink.rows, columns=res.steps_sink.columns)
    # Replicas interleave their rows differently when one of them jumps: order per replica.
    steps = steps.sort_values(["replica_id", "step"]).reset_index(drop=True)
    return (res.summary, reqs.sort_values("request_id").reset_index(drop=True), steps,
            free_queues(res))


@pytest.mark.parametrize("policy,router,extra", [
    ("fcfs", "least_outstanding", ()),
    # A request arriving during a jump's last step sees that step's new KV blocks in use
    # (least_kv routes on them), as step-by-step simulation shows.
    *[("chunked_prefill", "least_kv", ("policy.max_num_batched_tokens=256", f"seed={seed}",
                                       f"workload.qps={qps}"))
      for seed, qps in ((0, 13), (1, 16), (2, 18))],
    ("chunked_prefill", "least_kv", ("policy.max_num_batched_tokens=256",)),
    ("sjf", "power_of_two", ("policy.preemptive=true",)),
    ("fcfs", "round_robin", ("model=tiny", "kv.num_gpu_blocks_override=40", "workload.qps=60",
                             "workload.prompt_len.max=200", "workload.output_len.max=120",
                             "policy.preemption_mode=swap", "kv.num_cpu_blocks=64")),
])
def test_colocated_replicas_fast_equals_exact(policy, router, extra):
    qps = () if any(e.startswith("workload.qps=") for e in extra) else ("workload.qps=15",)
    # The replica loop's decode runs (behind count-reading routers the array core would run
    # these: tests/test_array_cluster.py).
    overrides = (f"policy={policy}", "cluster.num_replicas=3", f"cluster.router={router}",
                 "workload.num_requests=150", "array_core=false", *qps, *extra)
    fast, rf, sf, free_f = _cluster_run("fast", overrides)
    exact, re_, se, free_e = _cluster_run("exact", overrides)
    assert fast["num_decode_jumps"] > 0
    cols = ["replica_id", "step", "batch_size", "prefill_tokens", "decode_tokens", "sampled",
            "num_waiting", "num_running", "num_swapped", "kv_blocks_used", "recomputed",
            "swapped_out"]
    assert (sf[cols].to_numpy() == se[cols].to_numpy()).all()
    for c in ("time", "duration"):
        assert_approx(sf[c].astype(float).to_numpy(), se[c].astype(float).to_numpy(),
                      rel=1e-9, abs=1e-12)
    for c in ("replica_id", "output_len", "num_preemptions", "status"):
        assert rf[c].equals(re_[c]), c
    for c in ("first_token_time", "finish_time", "ttft", "tpot", "e2e_latency"):
        assert_approx(pd.to_numeric(rf[c]).to_numpy(dtype=float),
                      pd.to_numeric(re_[c]).to_numpy(dtype=float), rel=1e-9, abs=1e-12,
                      nan_ok=True, what=c)
    # The same block ids, handed out and freed in the same order.
    assert free_f == free_e
