"""Policies written from docs/adding-a-policy.md alone, defined here and handed to the
engine through its components (not registered). The docs' example, an ``OrderedPolicy``
stating ``array_core``, runs on the array core; a variant of FCFS's hooks runs the replica
loop's decode jumps. Both run fast and exactly as step by step, on one replica under KV
pressure with either preemption mode, behind a router, disaggregated and with pipeline
stages, on random small workloads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import BuiltIn
from policies.budget import Budget, admit
from policies.fcfs import FCFSPolicy
from policies.ordered import OrderedPolicy
from sim.policy import Policy, PolicyConfig
from sim.request import Request
from sim.step_builder import StepBuilder
from tests.test_cluster_fast_exact import _run, _workload, assert_fast_equals_exact

# Every test here holds a fast engine to step-by-step simulation, or to its own
# step (`python -m pytest -m equivalence` runs them all).
pytestmark = pytest.mark.equivalence

NAME = "shortest_prompt_first"
HOOKS_NAME = "shortest_prompt_first_hooks"


class ShortestPromptFirst(OrderedPolicy):
    """The docs' example: waiting requests are admitted shortest pending prefill first;
    running requests keep arrival order."""

    supports_decode_jumps = True
    array_core = True

    def waiting_key(self, req: Request) -> tuple[int, float, int]:
        return (req.num_pending_tokens, req.arrival_time, req.request_id)

    def running_key(self, req: Request) -> tuple[float, int]:
        return (req.arrival_time, req.request_id)


class ShortestPromptFirstHooks(FCFSPolicy):
    """The same admission through FCFS's ``admit_waiting`` hook (sorting the queue each
    step): the array core does not follow a hook it does not know, so this one takes the
    replica loop."""

    # Only admission changed, and admission can only get harder while a decode batch grows
    # (free blocks shrink; seats and budget stay): a decode-only step repeats until an
    # arrival, a finish or a KV shortage, and with nothing waiting a finish frees a seat and
    # blocks nobody takes.
    supports_decode_jumps = True

    def admit_waiting(self, step: StepBuilder, budget: Budget) -> list[Request]:
        order = sorted(step.waiting, key=lambda r: (r.num_pending_tokens, r.arrival_time,
                                                    r.request_id))
        return admit(step, budget, order, strict_order=False)


class LongestPromptFirst(OrderedPolicy):
    """Longest pending prefill first: where the head does not fit, strict admission waits
    for it and ``strict_order = False`` lets shorter ones behind it go ahead."""

    supports_decode_jumps = True
    array_core = True

    def waiting_key(self, req: Request) -> tuple[int, float, int]:
        return (-req.num_pending_tokens, req.arrival_time, req.request_id)

    def running_key(self, req: Request) -> tuple[float, int]:
        return (req.arrival_time, req.request_id)


class LongestPromptFirstBypass(LongestPromptFirst):
    supports_decode_jumps = True
    array_core = True
    strict_order = False


class WithTheNewPolicies(BuiltIn):
    """The built-in components plus the policies here, under their names."""

    POLICIES: ClassVar[dict[str, type[Policy]]] = {
        NAME: ShortestPromptFirst, HOOKS_NAME: ShortestPromptFirstHooks,
        "lpf": LongestPromptFirst, "lpf_bypass": LongestPromptFirstBypass}

    def make_policy(self, section: dict[str, Any], seed: int) -> Policy:
        cls = self.POLICIES.get(section.get("name"))
        if cls is not None:
            return cls(PolicyConfig.from_dict(section), seed=seed)
        return super().make_policy(section, seed)


COMPONENTS = WithTheNewPolicies()


def _check(overrides: list[str], name: str = NAME) -> dict:
    return assert_fast_equals_exact(["policy=fcfs", f"policy.name={name}", *overrides],
                                    COMPONENTS)


SETUP = [*_workload(1, 30.0, 60), "kv.num_gpu_blocks_override=150", "policy.max_num_seqs=16"]


def test_the_docs_example_runs_on_the_array_core_and_is_not_fcfs():
    s = _check(SETUP)
    assert s["step_engine"] == "array_core" and s["policy"] == NAME
    ours = _run("fast", ["policy=fcfs", f"policy.name={NAME}", *SETUP], COMPONENTS)[1]
    fcfs = _run("fast", ["policy=fcfs", *SETUP])[1]
    assert not ours["first_scheduled_time"].equals(fcfs["first_scheduled_time"])


def test_the_docs_examples_are_the_ones_here():
    """The code in docs/adding-a-policy.md, run as written (less its registration), schedules
    as the classes above."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "adding-a-policy.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)
    assert len(blocks) == 2
    for code, name in zip(blocks, (NAME, HOOKS_NAME)):
        namespace: dict[str, Any] = {}
        exec(re.sub(r"@POLICIES\.register\(.*\)\n", "", code), namespace)  # noqa: S102
        cls = next(v for k, v in namespace.items()
                   if isinstance(v, type) and k.startswith("ShortestPromptFirst"))

        class FromTheDocs(WithTheNewPolicies):
            POLICIES: ClassVar[dict[str, type[Policy]]] = {
                **WithTheNewPolicies.POLICIES, "docs": cls}

        docs = _run("fast", ["policy=fcfs", "policy.name=docs", *SETUP], FromTheDocs())
        ours = _run("fast", ["policy=fcfs", f"policy.name={name}", *SETUP], COMPONENTS)
        assert docs[0]["step_engine"] == ours[0]["step_engine"]
        assert docs[1].drop(columns="policy", errors="ignore").equals(
            ours[1].drop(columns="policy", errors="ignore"))


def test_the_hook_variant_jumps_and_admits_as_the_docs_example():
    s = _check(SETUP, HOOKS_NAME)
    assert s["num_decode_jumps"] > 0 and s["policy"] == HOOKS_NAME
    assert "does not decide on arrays" in s["array_core_skipped"]  # (it states no rule)
    hooks = _run("fast", ["policy=fcfs", f"policy.name={HOOKS_NAME}", *SETUP], COMPONENTS)[1]
    ordered = _run("fast", ["policy=fcfs", f"policy.name={NAME}", *SETUP], COMPONENTS)[1]
    assert hooks["first_scheduled_time"].equals(ordered["first_scheduled_time"])


def test_strict_order_decides_whether_shorter_ones_go_ahead():
    first = {}
    for name in ("lpf", "lpf_bypass"):
        assert _check(SETUP, name)["step_engine"] == "array_core"
        out = _run("fast", ["policy=fcfs", f"policy.name={name}", *SETUP], COMPONENTS)[1]
        first[name] = out.set_index("request_id")["first_scheduled_time"].astype(float)
    # Some request was admitted earlier with the bypass, ahead of a longer one.
    assert (first["lpf_bypass"] < first["lpf"]).any()


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 80.0), blocks=st.integers(40, 400),
       swap=st.booleans(),
       name=st.sampled_from([NAME, HOOKS_NAME, "lpf_bypass"]),
       layout=st.sampled_from([(), ("cluster.num_replicas=2", "cluster.router=least_kv"),
                               ("cluster=disaggregated", "cluster.num_decode_replicas=2"),
                               ("cluster.pipeline_parallel_size=2",)]))
def test_fast_equals_exact_on_random_small_workloads(seed, qps, blocks, swap, name, layout):
    _check([*_workload(seed, qps, 50), f"kv.num_gpu_blocks_override={blocks}", "policy.max_num_seqs=16",
            f"policy.preemption_mode={'swap' if swap else 'recompute'}", *layout], name)
