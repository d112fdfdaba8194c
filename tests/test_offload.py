"""The offload tier (``kv.kv_offloading_size``): cached blocks evicted from the GPU are copied to
host memory, kept there least recently used first, and loaded back into new GPU blocks for
a later hit; the copies a step makes, in order; pricing at PCIe cost; runs that keep every
request and the books; and the config errors."""

from __future__ import annotations

import pytest

from executors.step_terms import step_shape
from experiments.simulation import Simulation
from sim.errors import ConfigError
from sim.kv_manager import KVBlockManager
from sim.request import Request
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.helpers import compose_cfg
from tests.test_cluster_fast_exact import assert_fast_equals_exact


def _manager(gpu: int, offload: int, size: int = 4) -> KVBlockManager:
    kv = KVBlockManager(gpu, size, 0, enable_prefix_caching=True, num_offload_blocks=offload)
    kv.copy_log = []
    return kv


def test_evicted_cached_blocks_are_stored_and_the_least_recently_used_is_overwritten():
    kv = _manager(gpu=4, offload=2)
    kv.allocate_slots(0, 12)  # blocks 0, 1, 2
    kv.register(0, ["ka", "kb", "kc"], 3)
    kv.free(0)  # free queue: 3 (never used), then 2, 1, 0 (tail first)
    assert kv.allocate_slots(1, 16) == [3, 2, 1, 0]
    # Evicted in the order taken: kc, kb, ka. The tier holds two: ka overwrites kc's block.
    assert kv.copy_log == [("store", [(2, 0), (1, 1), (0, 0)])]
    assert kv.offloaded == {"kb": 1, "ka": 0} and kv.cached == {}
    assert (kv.num_evictions, kv.num_offload_stores) == (3, 3)
    kv.check_integrity()


def test_content_already_offloaded_is_not_copied_again():
    kv = _manager(gpu=2, offload=2)
    kv.allocate_slots(0, 4)
    kv.register(0, ["k"], 1)
    kv.free(0)
    kv.allocate_slots(1, 8)  # takes 1 then 0: k is stored
    assert kv.copy_log == [("store", [(0, 0)])]
    kv.free(1)
    kv.load(2, kv.match_offloaded(["k"]), ["k"])  # back on the GPU in a new block
    table = kv.block_tables[2]
    assert kv.cached == {"k": table[0]}
    kv.free(2)
    kv.copy_log.clear()
    kv.allocate_slots(3, 8)  # evicts k from the GPU again: the tier still holds it
    assert kv.copy_log == [] and kv.num_offload_stores == 1
    assert kv.offloaded == {"k": 0}
    kv.check_integrity()


def test_a_load_pins_the_blocks_it_reads():
    """The GPU blocks a load takes may evict cached blocks whose stores want a tier block:
    never one the load is reading (here the tier's only block), so that content is lost."""
    kv = _manager(gpu=2, offload=1)
    kv.allocate_slots(0, 4)
    kv.register(0, ["k0"], 1)
    kv.free(0)
    kv.allocate_slots(1, 8)  # takes 1, 0: k0 -> tier block 0
    kv.register(1, ["kz", "ky"], 2)
    kv.free(1)  # free queue: 0 (ky), 1 (kz)
    kv.copy_log.clear()
    assert kv.load(2, [0], ["k0"]) == [0]  # evicts ky; its store finds no free tier block
    assert kv.copy_log == [("load", [(0, 0)])]
    assert kv.offloaded == {"k0": 0} and kv.cached == {"kz": 1, "k0": 0}
    assert (kv.num_offload_stores, kv.num_offload_loads, kv.num_evictions) == (1, 1, 2)
    kv.check_integrity()


def _builder(gpu: int, offload: int, size: int = 4):
    q = ReplicaQueues()
    kv = KVBlockManager(gpu, size, 0, enable_prefix_caching=True, num_offload_blocks=offload)
    return q, kv, StepBuilder(q, kv)


def test_a_prefix_evicted_from_the_gpu_is_loaded_back_into_new_blocks():
    q, kv, step = _builder(gpu=4, offload=2)
    prefix = ((7, 8),)  # two full blocks of 4 shared tokens
    a = Request(0, 0.0, 9, 2, prefix=prefix)
    c = Request(1, 0.0, 16, 2)
    b = Request(2, 0.0, 9, 2, prefix=prefix)
    q.waiting.extend([a, c, b])
    step.reset(0.0)
    assert step.schedule(a, 9) and kv.block_tables[0] == [0, 1, 2]
    a.num_computed_tokens = 9
    step.register_computed(a)
    step._q.remove_running(a)
    kv.free(0)  # free queue: 3, then 2, 1, 0
    step.reset(0.1)
    assert step.schedule(c, 16) and kv.block_tables[1] == [3, 2, 1, 0]
    plan = step.build()
    assert plan.swaps == [("store", [(1, 0), (0, 1)])]  # a's prefix blocks, in take order
    assert plan.num_offload_loads == 0
    step._q.remove_running(c)
    kv.free(1)  # free queue: 0, 1, 2, 3
    step.reset(0.2)
    # b's prefix is all in the tier: one token left to compute, three GPU blocks to take.
    assert step.pending_tokens(b) == 1 and step.blocks_needed(b, 1) == 3
    assert step.schedule(b, 1)
    assert kv.block_tables[2] == [0, 1, 2] and b.num_computed_tokens == 8
    plan = step.build()
    assert plan.swaps == [("load", [(1, 0), (0, 1)])]  # tier block 1 held the first block
    assert plan.num_offload_loads == 2
    assert [(r.start_position, r.num_new_tokens) for r in plan.scheduled] == [(8, 1)]
    assert b.num_cached_tokens == 8
    assert (kv.prefix_queries, kv.prefix_hits, kv.num_offload_loads) == (9 + 16 + 9, 0, 2)
    # Loaded blocks are GPU-cached again, findable by the next request.
    assert kv.match(step.shared_keys(b)) == [0, 1]
    # The cost model prices the loads as host -> device copies.
    assert step_shape(plan).swap_in_blocks == 2
    kv.check_integrity()


BASE = ("model=tiny", "workload=multi_turn", "workload.num_sessions=40", "workload.qps=4",
        "workload.think_time_s=2", "workload.system_prompt_len=200",
        "workload.user_len.max=400", "workload.max_prompt_len=1000", "policy=vllm_v1",
        "kv.num_gpu_blocks_override=500", "kv.block_size=4", "kv.num_cpu_blocks=0")


@pytest.mark.slow
def test_a_tight_pool_loads_from_the_tier_instead_of_recomputing():
    off = Simulation(compose_cfg(*BASE)).run().summary
    on = Simulation(compose_cfg(*BASE, "kv.num_offload_blocks=4000",
                                "check_integrity=true")).run().summary
    assert off["kv_offload_loads"] == off["kv_offload_stores"] == 0
    assert on["kv_num_offload_blocks"] == 4000
    assert on["kv_offload_stores"] > 0 and on["kv_offload_loads"] > 0
    assert on["completed"] == off["completed"] == 74
    # Hits served from host memory come on top of the GPU's.
    def hit(s):
        return s["prefix_cache_hit_rate"] + s["kv_offload_hit_rate"]
    assert hit(on) > hit(off) + 0.05
    assert on["kv_offload_hit_rate"] == pytest.approx(
        on["kv_offload_loads"] * 4 / on["prefix_cache_queries"])


@pytest.mark.parametrize("extra", [[], ["policy=fcfs", "kv.enable_prefix_caching=true",
                                        "policy.preemption_mode=swap", "kv.num_cpu_blocks=100"],
                                   ["cluster.num_replicas=2", "cluster.router=prefix_aware"]])
def test_fast_equals_exact_with_an_offload_tier(extra):
    s = assert_fast_equals_exact([*BASE, "workload.num_sessions=20", "kv.num_gpu_blocks_override=300",
                                  "kv.num_offload_blocks=60", *extra])
    assert s["kv_offload_loads"] > 0 and s["kv_offload_stores"] > 0


def test_offload_gib_sets_the_tier_from_the_block_size():
    s = Simulation(compose_cfg("model=tiny", "workload.num_requests=5",
                               "kv.enable_prefix_caching=true", "kv.kv_offloading_size=0.001"))
    per_block = s.memory.kv_bytes_per_block
    assert s.memory.num_offload_blocks == int(0.001 * 2**30 // per_block) > 0


@pytest.mark.parametrize("overrides,field", [
    (["kv.kv_offloading_size=1", "kv.enable_prefix_caching=false"], "kv.kv_offloading_size"),
    (["kv.num_offload_blocks=10", "policy=fcfs"], "kv.num_offload_blocks"),
    (["kv.kv_offloading_size=-1"], "kv.kv_offloading_size"),
    (["kv.kv_offloading_size=inf", "policy=vllm_v1"], "kv.kv_offloading_size"),
    (["kv.num_offload_blocks=-3"], "kv.num_offload_blocks"),
])
def test_bad_offload_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        Simulation(compose_cfg("model=tiny", *overrides))
    assert e.value.field == field
