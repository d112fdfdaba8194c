"""What a policy may rely on and what it may touch: a subclass does not inherit its parent's
fast-path certificates (decode jumps, jumps past finishes, the array core), a policy sees the
KV pool only through a read-only view (every change goes through the step builder), and
``check_integrity`` names a request whose state was changed behind the builder's back."""

from __future__ import annotations

import pytest
import simpy

import policies
from experiments.simulation import Simulation
from policies.base import Policy, PolicyConfig
from policies.budget import Budget, admit
from policies.fcfs import FCFSPolicy
from sim.kv_manager import KVBlockManager, KVIntegrityError, KVView
from sim.metrics import MetricsCollector
from sim.outputs import REQUEST_COLUMNS, STEP_COLUMNS, CsvSink
from sim.replica import Replica
from sim.request import Request, RequestStatus
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.harness import RecordingExecutor, run_requests
from tests.helpers import small_cfg


class NewestFirst(FCFSPolicy):
    """A newcomer's policy: FCFS's hooks, one changed, no flags restated."""

    def admit_waiting(self, step: StepBuilder, budget: Budget) -> list[Request]:
        return admit(step, budget, list(reversed(step.waiting)))  # not FCFS's head rule


class Certified(FCFSPolicy):
    supports_decode_jumps = True


def test_a_subclass_restates_the_fast_path_flags_or_has_none() -> None:
    assert FCFSPolicy.supports_decode_jumps and FCFSPolicy.array_core
    for flag in Policy.FAST_PATH_FLAGS:
        assert getattr(NewestFirst, flag) is False, flag
    assert Certified.supports_decode_jumps
    assert Certified.array_core is False  # not restated: not certified


def test_inconsistent_certificates_are_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match="Core: array_core = True needs a head_admissions"):
        type("Core", (Policy,), {"array_core": True, "schedule": None})


class _ClosedForm(RecordingExecutor):
    closed_form_decode = True


@pytest.mark.parametrize("cls, jumps", [(NewestFirst, False), (Certified, True)])
def test_an_uncertified_subclass_takes_the_per_step_loop_in_fast_mode(cls, jumps) -> None:
    env = simpy.Environment()
    kv = KVBlockManager(64, 4)
    replica = Replica(env, 0, cls(PolicyConfig()), _ClosedForm(), kv,
                      MetricsCollector(), CsvSink(None, REQUEST_COLUMNS),
                      CsvSink(None, STEP_COLUMNS), max_model_len=1000,
                      horizon=lambda: float("inf"), fast_forward=True)
    assert replica.fast_forward is jumps


def test_a_policy_reads_the_pool_through_a_view_that_cannot_change_it() -> None:
    kv = KVBlockManager(8, 4)
    step = StepBuilder(ReplicaQueues(), kv)
    assert isinstance(step.kv, KVView)
    for name in ("allocate_slots", "free", "grow", "swap_out", "swap_in", "fork",
                 "block_tables", "_gpu"):
        assert not hasattr(step.kv, name), name
    kv.allocate_slots("a", 6)
    table = step.kv.block_table("a")
    assert table == (0, 1) and isinstance(table, tuple)  # a copy: the live list stays put
    assert (step.kv.num_free_blocks, step.kv.num_used_blocks, step.kv.usage) == (6, 2, 0.25)
    assert step.kv.blocks_needed("a", 9) == 1 and step.kv.can_allocate(6)
    assert not step.kv.can_allocate(6, watermark_blocks=1)
    assert (step.kv.block_size, step.kv.num_gpu_blocks, step.kv.num_cpu_blocks) == (4, 8, 0)
    with pytest.raises(AttributeError):
        step.kv.num_gpu_blocks = 99  # type: ignore[misc]


def test_check_integrity_names_a_request_whose_state_was_changed_behind_the_builder() -> None:
    queues, kv = ReplicaQueues(), KVBlockManager(8, 4)
    step = StepBuilder(queues, kv)
    first, second = Request(0, 0.0, 8, 4), Request(1, 0.0, 8, 4)
    queues.waiting.extend([first, second])
    step.reset(0.0)
    assert step.schedule(first, 8)
    first.num_computed_tokens = 8  # what the replica applies after the step
    step.check_holders()
    first.num_computed_tokens = 9  # a policy skipping a token it holds no slot for
    with pytest.raises(KVIntegrityError, match="running request 0 is RUNNING and holds GPU "
                                               "slots for 8 of its 9 computed tokens"):
        step.check_holders()
    first.num_computed_tokens = 8
    second.status = RequestStatus.RUNNING  # a policy setting state instead of scheduling
    with pytest.raises(KVIntegrityError, match="waiting request 1 is RUNNING and holds none"):
        step.check_holders()


class SetsStatus(FCFSPolicy):
    """Breaks the contract: marks the requests it leaves waiting as RUNNING itself."""

    def schedule(self, step: StepBuilder):
        plan = super().schedule(step)
        for req in step.waiting:
            req.status = RequestStatus.RUNNING
        return plan


def test_a_run_with_check_integrity_stops_at_the_step_a_policy_broke_the_state(monkeypatch):
    monkeypatch.setattr(policies, "make_policy",
                        lambda cfg, seed=0: SetsStatus(PolicyConfig(max_num_seqs=1)))
    reqs = [Request(0, 0.0, 4, 2), Request(1, 0.0, 4, 2)]
    with pytest.raises(KVIntegrityError, match="waiting request 1 is RUNNING"):
        run_requests({}, reqs, num_gpu_blocks=8, block_size=4)
    # And on pipelined replicas (their own step loop).
    cfg = small_cfg("model=llama3_70b", "hardware=h100_sxm", "cluster.tensor_parallel_size=2",
                    "cluster.pipeline_parallel_size=2", "check_integrity=true")
    with pytest.raises(KVIntegrityError, match=r"waiting request \d+ is RUNNING"):
        Simulation(cfg).run()


def test_every_block_holder_is_queued_once_or_in_transit() -> None:
    queues, kv = ReplicaQueues(), KVBlockManager(8, 4)
    step = StepBuilder(queues, kv)
    req = Request(0, 0.0, 4, 2)
    queues.waiting.append(req)
    step.reset(0.0)
    assert step.schedule(req, 4)
    req.num_computed_tokens = 4
    step.release_for_handoff(req)  # disaggregation: its KV is the transfer's source
    step.check_holders()
    step.free_handed_off(req)
    step.check_holders()
    kv.allocate_slots(7, 4)  # held by nobody this replica knows of
    with pytest.raises(KVIntegrityError, match=r"requests \[7\] hold blocks but are in no queue"):
        step.check_holders()
    kv.free(7)
    other = Request(1, 0.0, 4, 2)
    queues.waiting.extend([other, other])
    with pytest.raises(KVIntegrityError, match=r"requests \[1\] are in two queues"):
        step.check_holders()


@pytest.mark.parametrize("name", ["chunked_prefill", "vllm_v1", "sglang"])
def test_a_scheduler_that_always_chunks_refuses_chunked_prefill_off(name):
    """Their schedulers chunk whatever the flag says: false is refused, not ignored."""
    from policies.base import make_policy
    from sim.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^policy\.enable_chunked_prefill: .*must be true "
                                          rf"for the {name} policy"):
        make_policy({"name": name, "enable_chunked_prefill": False})
    assert make_policy({"name": name}).config.enable_chunked_prefill


def test_array_core_refuses_a_class_whose_hooks_its_rules_do_not_follow() -> None:
    """The array core decides through rules on counts that follow FCFS's and OrderedPolicy's
    own hooks: a class stating ``array_core`` with its own running order, victims, swap
    order, requeue or admission is refused when it is defined; one that only changes
    OrderedPolicy's keys is not."""
    from policies.fcfs import FCFSPolicy
    from policies.sjf import SJFPolicy

    with pytest.raises(TypeError, match="Bad: array_core = True, but its running_order"):
        type("Bad", (FCFSPolicy,), {"array_core": True,
                                    "running_order": lambda self, step: step.running})
    with pytest.raises(TypeError, match="its admit_waiting"):
        type("Bad", (FCFSPolicy,), {"array_core": True,
                                    "admit_waiting": FCFSPolicy.admit_waiting})
    with pytest.raises(TypeError, match="its victim_picker"):
        type("Bad", (SJFPolicy,), {"array_core": True,
                                   "victim_picker": lambda self, step, order: None})
    ok = type("Ok", (SJFPolicy,), {"array_core": True, "waiting_key": lambda self, r: 0})
    assert ok.array_core
    # Without the statement a class may override anything (it takes the replica loop).
    assert not type("Free", (FCFSPolicy,), {"running_order": FCFSPolicy.running_order}).array_core
