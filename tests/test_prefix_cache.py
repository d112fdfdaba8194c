"""Automatic prefix caching (``kv.enable_prefix_caching``): which blocks a request with a
cached prefix is handed, what is evicted first, reference counts of shared blocks, a
preempted request's blocks, the hit rate on a Mooncake trace against a count made directly
from its hash ids, and runs with caching on that keep every request and the KV books."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.simulation import Simulation
from sim.kv_manager import KVBlockManager
from sim.prefix_cache import _Chains, own_block_key, own_block_keys, shared_block_hashes
from sim.request import Request, RequestStatus
from sim.step_builder import ReplicaQueues, StepBuilder
from tests.helpers import SHARED, compose_cfg
from tests.test_cluster_fast_exact import assert_fast_equals_exact

MOONCAKE = SHARED / "traces" / "mooncake_conversation.jsonl"


# ---- content keys ---------------------------------------------------------------------------
def test_block_hashes_chain_the_whole_prefix():
    a = shared_block_hashes(((7, 8), (9, 8)), 4)
    assert len(a) == 4
    assert shared_block_hashes(((7, 8), (5, 8)), 4)[:2] == a[:2]  # same first span
    assert shared_block_hashes(((7, 8), (5, 8)), 4)[2:] != a[2:]
    # The same span after a different one is different content in context.
    assert shared_block_hashes(((5, 8), (9, 8)), 4)[2:] != a[2:]
    # A block is hashed only when the shared spans fill it.
    assert len(shared_block_hashes(((7, 6),), 4)) == 1
    # Spans split across blocks: the pieces name (key, first offset, end offset).
    assert shared_block_hashes(((1, 3), (2, 3)), 2) == shared_block_hashes(
        ((1, 3), (2, 3)), 2)
    assert own_block_key(5, 2) == (5, 2)
    assert own_block_keys(5, 1, 4) == [own_block_key(5, k) for k in (1, 2, 3)]
    assert own_block_keys(5, 3, 3) == [] == own_block_keys(5, 4, 3)


def _chain_from_scratch(spans: tuple[tuple[int, int], ...], block_size: int) -> list[int]:
    """The hashes computed block by block from the first span (a chain memo that keeps
    nothing)."""
    return _Chains(max_items=0).hashes(spans, block_size)


@settings(max_examples=60, deadline=None)
@given(base=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 40)), min_size=1, max_size=12),
       tails=st.lists(st.tuples(st.integers(0, 12), st.lists(
           st.tuples(st.integers(0, 4), st.integers(1, 40)), max_size=3)), min_size=1,
           max_size=12),
       block_size=st.sampled_from([1, 2, 3, 16]), keep=st.sampled_from([0, 5, 40, 1 << 19]))
def test_block_hashes_that_extend_a_hashed_list_are_the_chain_from_scratch(base, tails,
                                                                         block_size, keep):
    """Span lists that extend one hashed before (a conversation's turns, a trace's shared
    hash ids) go on from where it ended: the same hashes as computed from the first span,
    whatever the memo kept, and never more than its bound kept."""
    chains = _Chains(max_items=keep)
    for cut, tail in tails:
        spans = tuple(base[:cut]) + tuple(tail)
        got = chains.hashes(spans, block_size)
        assert got == _chain_from_scratch(spans, block_size)
        got.append(0)  # the caller's own list
        assert chains.hashes(spans, block_size) == _chain_from_scratch(spans, block_size)
        assert chains.kept <= keep
        # An entry costs its hashes, its spans and one more: spans that fill no block (or
        # many spans) count too.
        assert chains.kept == sum(len(v[0]) + len(k[1]) + 1 for k, v in chains._states.items())


# ---- the block manager on a tiny pool -------------------------------------------------------
def test_a_hit_hands_out_the_very_blocks_and_eviction_is_least_recently_freed():
    kv = KVBlockManager(6, 4, 0, enable_prefix_caching=True)
    assert kv.allocate_slots("a", 10) == [0, 1, 2]
    kv.register("a", ["k0", "k1"], 2)
    kv.free("a")  # tail first: 2, 1, 0 join the back of the queue
    assert kv._gpu.free_blocks() == [3, 4, 5, 2, 1, 0]
    hits = kv.match(["k0", "k1", "k2"])
    assert hits == [0, 1] and kv.num_free_among(hits) == 2
    kv.attach("b", hits)
    assert kv.block_tables["b"] == [0, 1] and kv._gpu.free_blocks() == [3, 4, 5, 2]
    assert kv.allocate_slots("b", 10) == [3]
    kv.check_integrity()
    # A second holder of the same prefix shares the blocks (one reference more).
    kv.attach("d", kv.match(["k0", "k1"]))
    assert kv._gpu.shared == {0: 1, 1: 1}
    kv.free("b")
    assert kv._gpu.free_blocks() == [4, 5, 2, 3] and kv.cached == {"k0": 0, "k1": 1}
    kv.free("d")
    assert kv._gpu.free_blocks() == [4, 5, 2, 3, 1, 0]
    kv.check_integrity()
    # Taking blocks evicts the cached ones reached at the front: block 1 (k1) before 0 (k0).
    assert kv.allocate_slots("c", 20) == [4, 5, 2, 3, 1]
    assert kv.num_evictions == 1 and kv.cached == {"k0": 0}
    assert kv.match(["k0", "k1"]) == [0]
    kv.check_integrity()


def test_free_blocks_before_an_eviction_count_the_queue_front_without_content():
    """What a decode jump may take while requests wait: the free queue's front up to the
    first block whose cached content taking it would evict."""
    kv = KVBlockManager(6, 4, 0, enable_prefix_caching=True)
    assert kv.free_without_eviction() == 6  # nothing cached yet
    kv.allocate_slots("a", 12)  # blocks 0, 1, 2
    kv.register("a", ["k0"], 1)  # block 0 holds k0
    kv.free("a")
    assert kv._gpu.free_blocks() == [3, 4, 5, 2, 1, 0]
    assert kv.free_without_eviction() == 5  # 3, 4, 5, 2, 1; then 0 (k0)
    kv.attach("b", kv.match(["k0"]))  # block 0 leaves the queue from the middle
    assert kv.free_without_eviction() == kv.num_free_blocks == 5
    kv.allocate_slots("c", 8)  # 3, 4
    kv.free("b")  # 0 (k0) returns to the back
    assert kv.free_without_eviction() == 3 and kv.num_free_blocks == 4


def _front_without_content(kv: KVBlockManager) -> int:
    """The free queue's front before its first block with cached content, counted afresh."""
    n = 0
    for b in kv._gpu.free_blocks():
        if b in kv.block_key:
            break
        n += 1
    return n


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["alloc", "register", "free", "hit", "count"]),
                          st.integers(0, 5), st.integers(1, 12)), min_size=20, max_size=80))
def test_the_front_without_content_read_on_from_the_last_call_matches_a_fresh_count(ops):
    """``free_without_eviction`` reads the queue on from where it stopped (blocks gain content
    only while held): after any mix of allocations, registrations, frees and cache hits it
    counts what a scan of the whole queue counts."""
    kv = KVBlockManager(10, 2, 0, enable_prefix_caching=True)
    key_of = {}  # request -> the keys it registered, in table order
    for op, r, n in ops:
        rid = f"r{r}"
        if op == "alloc":  # (nothing changes where the pool is too small)
            held = len(kv.block_table(rid)) if kv.has_blocks(rid) else 0
            kv.allocate_slots(rid, held * kv.block_size + n)
        elif op == "register" and kv.has_blocks(rid):
            table = kv.block_table(rid)
            keys = [(rid, n, i) for i in range(len(table))]
            kv.register(rid, keys, len(table))
            key_of[rid] = keys
        elif op == "free" and kv.has_blocks(rid):
            kv.free(rid)
        elif op == "hit" and not kv.has_blocks(rid):
            donor = key_of.get(f"r{n % 6}")
            blocks = kv.match(donor) if donor else []
            if blocks:
                kv.attach(rid, blocks)
        assert kv.free_without_eviction() == _front_without_content(kv)
        kv.check_integrity()


def test_register_keeps_the_first_block_of_a_key():
    kv = KVBlockManager(8, 2, 0, enable_prefix_caching=True)
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 4)
    kv.register("a", ["x", "y"], 2)
    kv.register("b", ["x", "z"], 2)  # x is a's; b's first block stays unnamed
    assert kv.cached == {"x": 0, "y": 1, "z": 3}
    kv.check_integrity()


def test_caching_off_keeps_no_contents():
    kv = KVBlockManager(4, 2, 0)
    kv.allocate_slots("a", 4)
    kv.free("a")
    assert kv.cached == {} and kv.match(["x"]) == []
    assert kv._gpu.free_blocks() == [2, 3, 1, 0]


# ---- the step builder: admission with a hit -------------------------------------------------
def _builder(blocks: int = 16, size: int = 4):
    q = ReplicaQueues()
    kv = KVBlockManager(blocks, size, 0, enable_prefix_caching=True)
    return q, kv, StepBuilder(q, kv)


def _finish_prefill(step: StepBuilder, req: Request, n: int) -> None:
    req.num_computed_tokens += n
    step.register_computed(req)


def test_a_second_request_starts_from_the_first_ones_prefix_blocks():
    q, kv, step = _builder()
    prefix = ((42, 10),)  # 10 shared tokens: two full blocks of 4
    a = Request(0, 0.0, 13, 4, prefix=prefix)
    b = Request(1, 0.0, 11, 4, prefix=prefix)
    q.waiting.extend([a, b])
    step.reset(0.0)
    assert step.pending_tokens(a) == 13 and step.pending_tokens(b) == 11  # nothing cached
    assert step.schedule(a, 13)
    assert kv.block_tables[0] == [0, 1, 2, 3]
    _finish_prefill(step, a, 13)  # its step ended: blocks 0 and 1 are findable
    step.reset(0.1)
    assert step.pending_tokens(b) == 3 and step.blocks_needed(b, 3) == 1
    assert step.schedule(b, 3)
    assert kv.block_tables[1] == [0, 1, 4] and b.num_computed_tokens == 8
    assert b.num_cached_tokens == 8 and kv._gpu.shared == {0: 1, 1: 1}
    assert (kv.prefix_queries, kv.prefix_hits) == (24, 8)
    plan = step.build()
    assert [(r.start_position, r.num_new_tokens, r.sample) for r in plan.scheduled] == [
        (8, 3, True)]
    kv.check_integrity()


def _after_first_prefill(prompt_len: int):
    """Two waiting requests whose prompts of ``prompt_len`` start with the same 8 tokens; the
    first has been prefilled whole (its shared blocks are findable) and a new step begun."""
    q, kv, step = _builder()
    prefix = ((1, 8),)
    a = Request(0, 0.0, prompt_len, 2, prefix=prefix)
    b = Request(1, 0.0, prompt_len, 2, prefix=prefix)
    q.waiting.extend([a, b])
    step.reset(0.0)
    step.schedule(a, prompt_len)
    _finish_prefill(step, a, prompt_len)
    step.reset(0.1)
    return kv, step, b


def test_a_hit_never_covers_the_last_prompt_token():
    kv, step, b = _after_first_prefill(8)
    # Both blocks are cached, but the last token must be computed: one block is a hit.
    assert step.pending_tokens(b) == 4
    assert step.schedule(b, 4) and kv.block_tables[1] == [0, 2]


def test_a_grant_beyond_the_cache_aware_count_takes_no_hit():
    """A policy that sizes grants by the request's own count gets no hits."""
    kv, step, b = _after_first_prefill(9)
    assert step.pending_tokens(b) == 1
    assert step.schedule(b, 9)
    assert kv.block_tables[1] == [3, 4, 5] and b.num_cached_tokens == 0


def test_a_request_preempted_by_recompute_finds_its_own_blocks():
    q, kv, step = _builder(blocks=6)
    a = Request(0, 0.0, 9, 8)
    q.waiting.append(a)
    step.reset(0.0)
    step.schedule(a, 9)
    a.num_computed_tokens = 9
    a.num_output_tokens = 1
    a.num_computed_tokens = 12  # three decode steps later: 12 computed, 3 blocks full
    a.num_output_tokens = 4
    step.reset(0.2)
    step.preempt(a)
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert sorted(kv.cached.values()) == [0, 1, 2]
    step.reset(0.3)
    # 13 tokens to recompute (9 prompt + 4 output): its three full blocks hold the first 12,
    # and only the last token is computed again.
    assert step.pending_tokens(a) == 1
    assert step.schedule(a, 1) and kv.block_tables[0][:3] == [0, 1, 2]
    kv.check_integrity()


# ---- whole runs -----------------------------------------------------------------------------
SHARED_PROMPTS = ["model=tiny", "workload.num_requests=120", "workload.qps=40",
                  "workload.shared_prefix_len=100", "workload.num_prefix_groups=3",
                  "kv.num_gpu_blocks_override=120", "kv.num_cpu_blocks=60", "check_integrity=true"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", [["policy=fcfs"], ["policy=fcfs",
                                                      "policy.preemption_mode=swap"],
                                    ["policy=sjf"], ["policy=priority"],
                                    ["policy=chunked_prefill"], ["policy=static"]])
def test_every_policy_keeps_requests_and_kv_books_with_caching_on(policy):
    s = Simulation(compose_cfg(*SHARED_PROMPTS, *policy, "kv.enable_prefix_caching=true")).run()
    assert s.summary["completed"] + s.summary["rejected"] == 120
    assert s.summary["step_engine"] == "replica"
    if policy != ["policy=static"]:  # static batching reserves whole lengths: no lookups
        assert s.summary["prefix_cache_hits"] > 0
    assert 0 <= s.summary["prefix_cache_hit_rate"] <= 1


def test_caching_off_is_the_run_without_it():
    base = ["model=tiny", "workload.num_requests=80", "workload.qps=30",
            "workload.shared_prefix_len=100", "kv.num_gpu_blocks_override=400", "step_mode=exact"]
    off = Simulation(compose_cfg(*base)).run()
    explicit = Simulation(compose_cfg(*base, "kv.enable_prefix_caching=false")).run()
    on = Simulation(compose_cfg(*base, "kv.enable_prefix_caching=true")).run()
    assert off.steps_sink.rows == explicit.steps_sink.rows
    assert off.summary["prefix_cache_queries"] == 0
    assert on.summary["prefix_cache_hits"] > 0
    assert on.summary["mean_ttft_ms"] < off.summary["mean_ttft_ms"]
    # Each admission looks the prompt up once (nothing is preempted here): the column holds
    # what each request's admission found.
    assert on.summary["num_preemptions"] == 0
    col = on.requests_sink.columns.index("num_cached_tokens")
    assert sum(int(r[col]) for r in on.requests_sink.rows) == on.summary["prefix_cache_hits"]


@pytest.mark.equivalence
@pytest.mark.parametrize("extra", [[], ["policy=sjf"], ["policy=chunked_prefill"],
                                   ["policy.preemption_mode=swap"],
                                   ["cluster.num_replicas=2", "cluster.router=least_kv"],
                                   ["cluster=disaggregated"]])
def test_fast_equals_exact_with_caching_on(extra):
    assert_fast_equals_exact(["model=tiny", "workload.num_requests=60", "workload.qps=60",
                              "workload.shared_prefix_len=64", "workload.num_prefix_groups=2",
                              "kv.num_gpu_blocks_override=90", "kv.enable_prefix_caching=true", *extra])


@pytest.mark.equivalence
def test_a_prompts_last_token_completes_a_block_of_its_shared_prefix():
    """Chunks of 48 tokens leave prompts one token from done, and some prompts are wholly
    shared (48 tokens in 4-token blocks): the step that computes such a last token completes
    the prefix's last block, which the cache names then, in fast mode as step by step (a
    waiting request of the same prefix hits it). Fails if that step is a decode run's."""
    assert_fast_equals_exact([
        "model=mistral_7b", "hardware=h100_sxm", "seed=52157", "workload.qps=10",
        "workload.num_requests=120", "workload.prompt_len.max=300",
        "workload.prompt_len.median=50", "workload.output_len.max=300",
        "workload.shared_prefix_len=48", "workload.num_prefix_groups=4",
        "workload.priorities=[1,1,2]", "policy=vllm_v1", "policy.max_num_batched_tokens=48",
        "policy.max_num_seqs=4", "kv.block_size=4", "kv.enable_prefix_caching=true",
        "policy.scheduling_policy=priority", "cluster.num_replicas=2",
        "cluster.router=round_robin"])


@pytest.mark.equivalence
def test_a_prompts_last_token_in_a_plan_of_rows_takes_one_step():
    """The same in a plan of single rows (the decode run broken up by preemptions under
    priority scheduling): a row that computes a prompt's last token is not repeated in a
    jump, whose steps would leave the block it completes unnamed. Fails if it is."""
    assert_fast_equals_exact([
        "model=tiny", "hardware=a100_80gb", "seed=64322", "workload.qps=2",
        "workload.num_requests=120", "workload.prompt_len.max=300",
        "workload.prompt_len.median=50", "workload.output_len.max=50",
        "workload.shared_prefix_len=48", "workload.num_prefix_groups=4",
        "workload.priorities=[1,1,1,1]", "policy=vllm_v1", "policy.max_num_batched_tokens=24",
        "policy.max_num_seqs=2", "policy.scheduling_policy=priority", "kv.block_size=1",
        "kv.enable_prefix_caching=true", "kv.num_gpu_blocks_override=1126",
        "cluster.num_replicas=3", "cluster.router=random"])


@pytest.mark.skipif(not MOONCAKE.exists(), reason="needs ../shared/traces")
def test_unbounded_cache_hit_rate_on_mooncake_equals_a_count_from_its_hash_ids(tmp_path):
    """Each request arrives after the one before has finished, with a cache that never
    evicts: a request hits every whole 16-token block of the longest run of leading 512-token
    blocks some earlier request held in full, short of its last token."""
    rows = []
    with MOONCAKE.open() as f:
        for line in f:
            r = json.loads(line)
            if r["input_length"] + r["output_length"] <= 32_000:
                rows.append(r)
            if len(rows) == 150:
                break
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps({**r, "timestamp": 100_000 * i}) + "\n"
                             for i, r in enumerate(rows)))
    seen: set[tuple[int, ...]] = set()
    queries = hits = 0
    for r in rows:
        n, ids = r["input_length"], r["hash_ids"]
        full = ids[:n // 512]
        j = max((k for k in range(len(full) + 1) if tuple(full[:k]) in seen), default=0)
        hits += min(j * 512, (n - 1) // 16 * 16)
        queries += n
        seen.update(tuple(full[:k]) for k in range(1, len(full) + 1))
    s = Simulation(compose_cfg(
        "model=tiny", "model.max_model_len=32000", "workload=trace", f"workload.path={trace}",
        "policy.max_num_batched_tokens=32000", "kv.num_gpu_blocks_override=400000",
        "kv.enable_prefix_caching=true")).run().summary
    assert s["completed"] == len(rows) and s["kv_evictions"] == 0
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (queries, hits)
    assert hits > 0


@pytest.mark.slow
@pytest.mark.equivalence
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), qps=st.floats(5.0, 120.0), blocks=st.integers(40, 300),
       prefix=st.integers(1, 250), groups=st.integers(1, 4),
       block_size=st.sampled_from([1, 4, 16]),
       policy=st.sampled_from(["fcfs", "sjf", "priority", "chunked_prefill"]),
       swap=st.booleans(), layout=st.sampled_from(["single", "replicas", "disaggregated"]),
       offload=st.sampled_from([0, 3, 40]))
def test_random_shared_prefixes_fast_equals_exact(seed, qps, blocks, prefix, groups,
                                                  block_size, policy, swap, layout, offload):
    extra = {"fcfs": [], "priority": ["workload.priorities=[1,1,2]"],
             "sjf": ["policy.predictor=noisy"],
             "chunked_prefill": ["policy.max_num_batched_tokens=256"]}[policy]
    cluster = {"single": [], "replicas": ["cluster.num_replicas=2", "cluster.router=prefix_aware"],
               "disaggregated": ["cluster=disaggregated"]}[layout]
    blocks = blocks * 16 // block_size
    # The exact run checks the books after its every step too (check_integrity).
    s = assert_fast_equals_exact([
        "model=tiny", f"seed={seed}", f"workload.qps={qps}", "workload.num_requests=40",
        "workload.prompt_len.max=300", "workload.output_len.max=150",
        f"workload.shared_prefix_len={prefix}", f"workload.num_prefix_groups={groups}",
        f"kv.block_size={block_size}", f"kv.num_gpu_blocks_override={blocks}",
        f"kv.num_cpu_blocks={blocks // 2}", f"policy={policy}", *extra,
        "policy.max_num_seqs=16", f"policy.preemption_mode={'swap' if swap else 'recompute'}",
        "kv.enable_prefix_caching=true", f"kv.num_offload_blocks={offload}", *cluster],
        exact_only=["check_integrity=true"])
    assert s["prefix_cache_hits"] <= s["prefix_cache_queries"]
    assert offload or s["kv_offload_loads"] == s["kv_offload_stores"] == 0
    assert s["completed"] + s["rejected"] == 40


def test_without_shared_prefixes_the_array_core_runs_with_caching_on():
    """No request shares a prefix and the core never preempts: caching changes nothing but
    the count of prompt tokens looked up, and the per-step loop agrees."""
    base = ["model=tiny", "workload.num_requests=50", "workload.qps=40",
            "kv.enable_prefix_caching=true"]
    core = Simulation(compose_cfg(*base)).run()
    loop = Simulation(compose_cfg(*base, "array_core=false")).run()
    assert core.summary["step_engine"] == "array_core"
    assert loop.summary["step_engine"] == "replica"
    for key in ("prefix_cache_queries", "prefix_cache_hits", "kv_evictions", "num_steps",
                "median_ttft_ms"):
        assert core.summary[key] == loop.summary[key], key
    assert core.summary["prefix_cache_queries"] == core.summary["total_input_tokens"]
    shared = Simulation(compose_cfg(*base, "workload.shared_prefix_len=32")).run()
    assert shared.summary["step_engine"] == "replica"


def test_a_prefix_aware_router_sends_a_group_where_its_prefix_is_cached():
    """Four replicas, 16 shared prefixes: prefix_aware routing sends a request where its
    group's prefix is cached while the load allows, so the hit rate is well above round
    robin's (which spreads each group over every replica's cache)."""
    base = ["model=tiny", "policy=vllm_v1", "cluster.num_replicas=4",
            "workload.num_requests=300", "workload.qps=40", "workload.prompt_len.min=600",
            "workload.prompt_len.max=700", "workload.shared_prefix_len=512",
            "workload.num_prefix_groups=16", "kv.num_gpu_blocks_override=400"]
    rr = Simulation(compose_cfg(*base, "cluster.router=round_robin")).run().summary
    pa = Simulation(compose_cfg(*base, "cluster.router=prefix_aware")).run().summary
    approx = Simulation(compose_cfg(*base, "cluster.router=prefix_aware_approx")).run().summary
    assert pa["completed"] == rr["completed"] == approx["completed"] == 300
    assert pa["prefix_cache_hit_rate"] > 1.5 * rr["prefix_cache_hit_rate"]
    # Remembering what it routed where is nearly as good here (nothing is evicted that a
    # group needs while its requests keep coming).
    assert approx["prefix_cache_hit_rate"] > 1.5 * rr["prefix_cache_hit_rate"]


def test_the_report_plots_the_hit_rate_when_caching_is_on(tmp_path):
    from sim.report import write_report

    for on in (True, False):
        out = tmp_path / str(on)
        out.mkdir()
        res = Simulation(compose_cfg("model=tiny", "workload.num_requests=60",
                                     "workload.shared_prefix_len=64",
                                     f"kv.enable_prefix_caching={str(on).lower()}"), out).run()
        html = write_report(out, res.summary).read_text()
        assert ("Prefix cache hit rate" in html) == on
        assert ("prefix cache: hit rate" in html) == on  # the printed summary on the page
