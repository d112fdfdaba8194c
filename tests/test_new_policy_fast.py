"""A policy written from docs/adding-a-policy.md alone, defined here and handed to the
engine through its components (not registered): it runs fast (decode jumps, through finishes)
and exactly as step by step, on one replica under KV pressure with either preemption mode,
behind a router, disaggregated and with pipeline stages, on random small workloads."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import BuiltIn
from policies.budget import Budget, admit
from policies.fcfs import FCFSPolicy
from sim.policy import Policy, PolicyConfig
from sim.request import Request
from sim.step_builder import StepBuilder
from tests.test_cluster_fast_exact import _run, _workload, assert_fast_equals_exact

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

NAME = "shortest_prompt_first"


class ShortestPromptFirst(FCFSPolicy):
    """FCFS's steps, but waiting requests are admitted shortest pending prefill first, and a
    request that does not fit lets later, shorter ones go ahead."""

    # Only admission changed, and admission can only get harder while a decode batch grows
    # (free blocks shrink; seats and budget stay): a decode-only step repeats until an
    # arrival, a finish or a KV shortage, and with nothing waiting a finish frees a seat and
    # blocks nobody takes.
    supports_decode_jumps = True

    def admit_waiting(self, step: StepBuilder, budget: Budget) -> list[Request]:
        order = sorted(step.waiting, key=lambda r: (r.num_pending_tokens, r.arrival_time,
                                                    r.request_id))
        return admit(step, budget, order, strict_order=False)


class WithTheNewPolicy(BuiltIn):
    """The built-in components plus the policy above, under its name."""

    def make_policy(self, section: dict[str, Any], seed: int) -> Policy:
        if section.get("name") == NAME:
            return ShortestPromptFirst(PolicyConfig.from_dict(section), seed=seed)
        return super().make_policy(section, seed)


COMPONENTS = WithTheNewPolicy()


def _check(overrides: list[str]) -> dict:
    return assert_fast_equals_exact(["policy=fcfs", f"policy.name={NAME}", *overrides],
                                    COMPONENTS)


def test_it_jumps_and_is_not_fcfs():
    setup = [*_workload(1, 30.0, 60), "kv.num_gpu_blocks_override=150", "policy.max_num_seqs=16"]
    s = _check(setup)
    assert s["num_decode_jumps"] > 0 and s["policy"] == NAME
    assert "does not decide on arrays" in s["array_core_skipped"]  # (it states no rule)
    ours = _run("fast", ["policy=fcfs", f"policy.name={NAME}", *setup], COMPONENTS)[1]
    fcfs = _run("fast", ["policy=fcfs", *setup])[1]
    assert not ours["first_scheduled_time"].equals(fcfs["first_scheduled_time"])


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 80.0), blocks=st.integers(40, 400),
       swap=st.booleans(),
       layout=st.sampled_from([(), ("cluster.num_replicas=2", "cluster.router=least_kv"),
                               ("cluster=disaggregated", "cluster.num_decode_replicas=2"),
                               ("cluster.pipeline_parallel_size=2",)]))
def test_fast_equals_exact_on_random_small_workloads(seed, qps, blocks, swap, layout):
    _check([*_workload(seed, qps, 50), f"kv.num_gpu_blocks_override={blocks}", "policy.max_num_seqs=16",
            f"policy.preemption_mode={'swap' if swap else 'recompute'}", *layout])
