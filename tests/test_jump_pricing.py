"""A decode jump's stretches are priced into plain lists (sim/fast_forward.py): the end times
must be the floats numpy's cumulative sum gives (the sequential additions step-by-step
simulation makes), and the horizon cut the same as a search over the array; a jump priced
step by step is the jump priced in arrays."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fast_forward import _price_until, _steps_before

durations_st = st.lists(st.floats(1e-6, 0.2, allow_nan=False), min_size=1, max_size=300)


def _pricer(durations: list[float], calls: list[int]):
    arr = np.array(durations)

    def price(m: int) -> np.ndarray:
        calls.append(m)
        return arr[:m]
    return price


@settings(max_examples=200, deadline=None)
@given(durations=durations_st, start=st.floats(0.0, 1e5, allow_nan=False),
       ahead=st.floats(0.0, 5.0, allow_nan=False),
       d_est=st.one_of(st.just(0.0), st.floats(1e-6, 0.2)))
def test_priced_ends_are_numpys_cumulative_sums(durations, start, ahead, d_est):
    calls: list[int] = []
    horizon = start + ahead
    priced = _price_until(_pricer(durations, calls), start, len(durations), horizon, d_est)
    assert priced is not None
    got, ends = priced
    m = len(got)
    assert 1 <= m <= len(durations) and m == calls[-1]
    assert np.array(got).tobytes() == np.array(durations[:m]).tobytes()
    want = np.cumsum(np.concatenate(([start], np.array(durations[:m]))))[1:]
    assert np.array(ends).tobytes() == want.tobytes()  # bit for bit
    # Short of the whole stretch only once the priced steps reach the horizon, or when the
    # first step's duration said fewer steps start before it.
    if m < len(durations):
        assert ends[-1] >= horizon or m >= int((horizon - start) / got[0]) + 2


def test_a_pricer_giving_up_gives_up_the_stretch():
    calls: list[int] = []
    first = _pricer([0.01] * 8, calls)
    # Enough steps for the first estimate, then none: the stretch is not priced.
    assert _price_until(lambda m: first(m) if not calls else None, 0.0, 100, 10.0) is None
    assert calls == [8]


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(0, 20), min_size=1, max_size=40),
       horizon=st.integers(-1, 400))
def test_steps_before_the_horizon_match_a_search_of_the_array(steps, horizon):
    # Ascending end times with ties, and horizons on, between and beyond them.
    ends = np.cumsum(np.array(steps, dtype=np.float64))
    want = int(min(len(ends), 1 + np.searchsorted(ends[:-1], float(horizon), side="left")))
    assert _steps_before(ends.tolist(), float(horizon)) == want


@settings(max_examples=300, deadline=None)
@given(firsts=st.lists(st.integers(1, 40), min_size=1, max_size=12),
       bs=st.integers(1, 16), k_max=st.integers(2, 120), free=st.integers(0, 60),
       ctx=st.integers(1, 5000), ahead=st.floats(0.0, 3.0, allow_nan=False),
       slope=st.floats(0.0, 1e-5, allow_nan=False))
def test_a_jump_priced_step_by_step_is_the_jump_priced_in_arrays(firsts, bs, k_max, free, ctx,
                                                                 ahead, slope):
    """``_sized_jump`` with ``_stepwise`` (the executor's plain-float step price) takes the
    steps, durations and end times the array pricing takes: the same KV cap, the same horizon
    cut, the same sequential sums."""
    from sim.fast_forward import _sized_jump, _stepwise

    n, mx = len(firsts), ctx // 2 + 1
    first = np.array(firsts, dtype=np.int64)

    def price(c: int, x: int) -> float:
        return 0.01 + slope * c + 1e-7 * x

    def durations(_plan, m: int) -> np.ndarray:
        steps = np.arange(m, dtype=np.float64)
        return 0.01 + slope * (ctx + n * steps) + 1e-7 * (mx + steps)

    start, horizon = 100.0, 100.0 + ahead
    arrays = _sized_jump(None, first, bs, durations, k_max, start, horizon, free)
    stepwise = _sized_jump(None, first, bs, durations, k_max, start, horizon, free,
                           _stepwise(price, ctx, n, mx))
    if arrays is None:
        assert stepwise is None
        return
    assert stepwise is not None and stepwise.num_steps == arrays.num_steps
    assert stepwise.durations.tobytes() == arrays.durations.tobytes()
    assert stepwise.ends.tobytes() == arrays.ends.tobytes()
    assert stepwise.block_members.tolist() == arrays.block_members.tolist()
