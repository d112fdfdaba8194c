"""A decode jump past finishes prices its steps one at a time
(``Executor.decode_step_pricer``) or its stretches ahead in one call
(``Executor.decode_stretch_durations``): the cost model's joint pass must give, bit for bit,
the floats pricing each stretch on its own gives, the per-step pricer the same curve's
floats (to the last bit but for math.hypot's rounding), and a jump's stops, batch sizes and
finishing members must be what the run's own counters say."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executors.base import Executor
from executors.cost_model import RooflineCostModel
from sim.fast_forward import _Stretches, plan_run_jump
from sim.kv_manager import KVBlockManager
from sim.request import Request, RequestStatus
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.test_decode_run import MODELS, _cost_models


def _joint_models() -> list[RooflineCostModel]:
    """MODELS plus fitted profiles without a tile term (their curves take the joint pass)
    at sharpness 3 (the generic knee) and infinity (max)."""
    fitted = _cost_models()[4]
    out = list(MODELS)
    for p in (3.0, math.inf):
        ex = _cost_models()[4]
        ex._coefficients = replace(fitted._coefficients, s_per_kv_tile=0.0, sharpness=p)
        ex._clear_terms()
        out.append(ex)
    return out


JOINT = _joint_models()


def test_the_joint_pass_covers_every_knee():
    # The default roofline (hypot), and sharpness 3 and infinity: rows for large batches.
    joint = [ex for ex in JOINT if ex._run_curve(128, None).row is not None]
    assert {ex._coefficients.sharpness for ex in joint} >= {2.0, 3.0, math.inf}


stretch_st = st.tuples(st.sampled_from([1, 2, 5, 10, 11, 12, 27, 54, 55, 82, 128, 300]),
                       st.integers(1, 9000), st.integers(0, 50), st.integers(1, 40))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(JOINT) - 1), raw=st.lists(stretch_st, min_size=1, max_size=8))
def test_stretches_priced_at_once_are_priced_one_by_one_bit_for_bit(which, raw):
    ex = JOINT[which]
    # The longest context mx, the total at most nd x mx (the others are shorter).
    stretches = [(nd, nd * mx - min(short, nd - 1), mx, m) for nd, mx, short, m in raw]
    got = ex.decode_stretch_durations(stretches)
    want = Executor.decode_stretch_durations(ex, stretches)  # stretch by stretch
    assert len(got) == sum(m for *_, m in stretches)
    assert np.array(got).tobytes() == np.array(want).tobytes()


def test_the_joint_pass_is_taken_where_every_curve_has_a_row(monkeypatch):
    ex = JOINT[0]
    calls = []
    monkeypatch.setattr(ex, "decode_run_durations", lambda *a: calls.append(a))
    ex.decode_stretch_durations([(45, 45 * 900, 1000, 6), (44, 44 * 900, 1006, 3)])
    assert calls == []  # one pass, not stretch by stretch
    # A batch whose geometry varies (5 rows) goes stretch by stretch (and gives up with the
    # first stretch the executor cannot price).
    assert ex.decode_stretch_durations([(45, 45 * 900, 1000, 6), (5, 5 * 900, 1006, 3)]) is None
    assert calls == [(45, 45 * 900, 1000, 6)]


def _run_of(contexts: list[int], remaining: list[int]) -> tuple[StepBuilder, KVBlockManager]:
    """A builder whose decode run holds requests that computed ``contexts[i]`` tokens (one
    pending) and have ``remaining[i]`` tokens left to sample."""
    kv = KVBlockManager(4000, 16)
    queues = ReplicaQueues()
    builder = StepBuilder(queues, kv)
    builder.enable_decode_run()
    for i, (ctx, left) in enumerate(zip(contexts, remaining)):
        r = Request(i, float(i), ctx, left + 1)
        r.transition(RequestStatus.RUNNING)
        r.num_computed_tokens = ctx
        r.num_output_tokens = 1
        assert kv.allocate_slots(i, ctx) is not None
        queues.add_running(r)
    builder.run.rebuild(queues.running, kv.block_tables)
    return builder, kv


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(remaining=st.lists(st.integers(1, 60), min_size=12, max_size=40),
       horizon=st.one_of(st.just(math.inf), st.floats(0.01, 3.0)), per_step=st.booleans())
def test_a_jumps_stops_batch_sizes_and_finishers_follow_the_runs_counters(remaining, horizon,
                                                                          per_step):
    contexts = [100 + 37 * i for i in range(len(remaining))]
    builder, kv = _run_of(contexts, remaining)
    run = builder.run
    builder.reset(0.0)
    assert builder.schedule_decode_run(builder.running, 4096)
    assert builder.build().decode_block is not None
    s0 = builder.run_block_step
    ex = JOINT[0]
    by_stretches: list[int] = []  # calls of the stretch pricer (the per-step one gave up)

    def stretch_prices(parts):
        by_stretches.append(len(parts))
        return ex.decode_stretch_durations(parts)

    jump = plan_run_jump(None, run, s0, ex.decode_durations, 0.0, horizon,
                         kv.num_free_blocks, stretch_durations_fn=stretch_prices,
                         step_pricer=ex.decode_step_pricer if per_step else None)
    last = (run.end - s0).tolist()  # each member's last jump step
    # Priced one step at a time unless a batch size on the way has no per-step pricer (ten
    # rows or fewer here: their decode geometry varies with the context).
    gave_up = per_step and bool(by_stretches)
    if gave_up:
        assert any(ex.decode_step_pricer(sum(f >= j for f in last)) is None
                   for j in range(1, max(last) + 1))
    per_step = per_step and not gave_up
    if jump is None:
        # No second step: nobody decodes past the first, or the second would start at or
        # after the horizon (the pool is large enough for every token here).
        ctx = sum(int(c) + s0 + 1 for c in run.ctx0)
        mx = max(int(c) for c in run.ctx0) + s0 + 1
        first_end = (ex.decode_step_pricer(len(last))(ctx, mx) if per_step
                     else ex.decode_run_durations(len(last), ctx, mx, 1)[0])
        assert max(last) < 2 or first_end >= horizon
        return
    k = jump.num_steps
    assert jump.finishing == [i for i, f in enumerate(last) if f <= k]
    assert jump.last_members == [i for i, f in enumerate(last) if f == k]
    stops = sorted({f for f in last if f < k})
    assert jump.stops == stops
    assert jump.groups == [(s, [i for i, f in enumerate(last) if f == s]) for s in stops]
    if stops:
        assert jump.batch_sizes == [sum(f >= j for f in last) for j in range(1, k + 1)]
    # The durations: each step priced alone by its batch (members still there).
    for j in (1, k // 2 + 1, k):
        alive = [i for i, f in enumerate(last) if f >= j]
        ctx = sum(int(run.ctx0[i]) + s0 + j for i in alive)
        mx = max(int(run.ctx0[i]) for i in alive) + s0 + j
        want = (ex.decode_step_pricer(len(alive))(ctx, mx) if per_step
                else ex.decode_run_durations(len(alive), ctx, mx, 1)[0])
        assert jump.durations[j - 1] == want
    ends = np.cumsum(jump.durations)  # left to right, as the jump adds them from 0.0
    assert np.array_equal(ends, jump.ends) and (k < 2 or ends[k - 2] < horizon)
    if per_step:  # every step that starts before the horizon, and none after
        assert ends[k - 1] >= horizon or k == max(last)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(remaining=st.lists(st.integers(1, 40), min_size=1, max_size=30),
       steps=st.integers(1, 60))
def test_next_bound_stays_a_lower_bound_and_grants_find_exactly_who_needs_a_block(remaining,
                                                                                  steps):
    # Grants, steps and members finishing: next_bound never exceeds the smallest bound, so
    # the O(1) check never skips a member that needs a block.
    contexts = [16 * (i % 3) + 5 + i for i in range(len(remaining))]
    builder, kv = _run_of(contexts, remaining)
    run = builder.run
    for _ in range(steps):
        if not len(run):
            break
        bound = run.bound.copy()
        assert run.next_bound <= bound.min()
        want = np.flatnonzero(bound <= run.steps)
        need = run.members_needing_blocks()
        assert (need.tolist() if need is not None else []) == want.tolist()
        builder.reset(0.0)
        assert builder.schedule_decode_run(builder.running, 4096)
        assert builder.build().decode_block is not None
        assert run.bound.min() > run.steps  # every member holds a slot for its token
        done = run.advance([float(builder.run_block_step + 1)])
        if len(done):
            out = run.remove_at(done.tolist())
            for req in out:
                builder._q.remove_running(req)
                kv.free(req.request_id)


@pytest.mark.parametrize("which", range(len(JOINT)))
def test_the_per_step_pricer_is_the_run_curve_step_by_step(which):
    # decode_step_pricer evaluates decode_run_durations' folded curve one step at a time:
    # the same floats but for math.hypot's rounding (p = 2: an ulp or two; max: exactly),
    # and no pricer where the curve has no plain-float form.
    ex = JOINT[which]
    p = ex._coefficients.sharpness
    rng = np.random.default_rng(7 + which)
    equal = total = 0
    for nd in (1, 2, 5, 10, 11, 12, 27, 44, 45, 54, 55, 82, 128, 300):
        pricer = ex.decode_step_pricer(nd)
        plain = (not ex.decomposer.decode_splits_vary(nd)
                 and ex._run_curve(nd, None).row is not None and p in (2.0, math.inf))
        assert (pricer is not None) == plain, nd
        if pricer is None:
            continue
        assert ex.decode_step_pricer(nd) is pricer  # memoized
        for _ in range(10):
            mx = int(rng.integers(1, 9000))
            ctx = nd * mx - int(rng.integers(0, nd))
            want = ex.decode_run_durations(nd, ctx, mx, 6)
            got = [pricer(ctx + nd * i, mx + i) for i in range(6)]
            assert got == pytest.approx(want.tolist(), rel=5e-16, abs=0)
            if p == math.inf:
                assert got == want.tolist()
            equal += sum(a == b for a, b in zip(got, want.tolist()))
            total += 6
    assert total == 0 or equal / total > 0.95  # apart only where the hypots round apart


def test_new_coefficients_give_new_per_step_pricers():
    ex = _cost_models()[0]  # its own instance: the shared ones stay as they are
    before = ex.decode_step_pricer(45)(45 * 900, 1000)
    ex.coefficients = replace(ex.coefficients, s_per_attn_kernel=ex.coefficients.s_per_attn_kernel
                              + 1e-3)
    after = ex.decode_step_pricer(45)(45 * 900, 1000)
    assert after == pytest.approx(before + 1e-3 * ex._decode_constants(45, None)[6], rel=1e-9)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(remaining=st.lists(st.integers(1, 40), min_size=1, max_size=30),
       horizon=st.one_of(st.just(math.inf), st.floats(0.0, 0.5)), s0_steps=st.integers(0, 5),
       k_cap=st.integers(2, 50), rows_without=st.integers(0, 12))
def test_priced_step_by_step_every_step_that_starts_before_the_horizon(
        remaining, horizon, s0_steps, k_cap, rows_without):
    # price_steps against a brute force: step j's batch is the members whose last step is j
    # or later, their contexts ctx0 + s0 + j; steps are priced until one ends at or after
    # the horizon (or k_max), each end the sum of the ones before; a batch of up to
    # ``rows_without`` rows has no pricer, and then nothing is priced.
    contexts = [50 + 29 * i for i in range(len(remaining))]
    builder, kv = _run_of(contexts, [r + s0_steps for r in remaining])
    run = builder.run
    run.take_steps([0.001 * (i + 1) for i in range(s0_steps)])  # a run some steps along
    last = run.end - run.steps
    k_max = min(int(last.max()), k_cap)

    def pricer_for(nd):
        if nd <= rows_without:
            return None
        return lambda ctx, mx: 1e-3 * nd + 1e-7 * ctx + 3e-7 * mx

    st_ = _Stretches(run, last, run.steps, k_max, None, 1.0)
    priced = st_.price_steps(pricer_for, 1.0 + horizon)
    want, ends, t = [], [], 1.0
    for j in range(1, k_max + 1):
        alive = [i for i, f in enumerate(last.tolist()) if f >= j]
        if len(alive) <= rows_without:
            assert not priced and st_.durations == [] and st_.ends == []
            return
        ctx = sum(int(run.ctx0[i]) + run.steps + j for i in alive)
        mx = max(int(run.ctx0[i]) for i in alive) + run.steps + j
        want.append(pricer_for(len(alive))(ctx, mx))
        t += want[-1]
        ends.append(t)
        if t >= 1.0 + horizon:
            break
    assert priced and st_.durations == want and st_.ends == ends


def test_a_step_ending_exactly_at_the_horizon_is_the_last_priced():
    # The next step would start at the horizon, where an arrival may change the batch.
    builder, _ = _run_of([100 + 29 * i for i in range(20)], [30] * 20)
    run = builder.run
    last = run.end - run.steps
    price = {20: lambda ctx, mx: 0.25}.get  # exact binary fractions: ends 1.25, 1.5, ...
    for horizon, k in ((1.5, 2), (1.5000001, 3), (1.25, 1)):
        st_ = _Stretches(run, last, run.steps, 30, None, 1.0)
        assert st_.price_steps(price, horizon)
        assert st_.ends == [1.0 + 0.25 * j for j in range(1, k + 1)], horizon
