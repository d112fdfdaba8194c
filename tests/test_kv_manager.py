"""KVBlockManager: exact block ids and free order on tiny pools, plus property tests."""

import random
import re
import tracemalloc
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.kv_manager import (
    _BULK,
    KVBlockManager,
    KVIntegrityError,
    _CachingPool,
    _leading,
    blocks_for,
)


def test_allocate_hands_out_ids_in_order_and_returns_new_blocks():
    kv = KVBlockManager(num_gpu_blocks=12, block_size=4)
    assert kv.allocate_slots("a", 9) == [0, 1, 2]
    assert kv.allocate_slots("b", 4) == [3]
    # Growing within the last block needs nothing; crossing a boundary takes the next free id.
    assert kv.allocate_slots("a", 12) == []
    assert kv.allocate_slots("a", 13) == [4]
    assert kv.block_table("a") == [0, 1, 2, 4]
    assert kv.num_free_blocks == 7 and kv.num_used_blocks == 5
    kv.check_integrity()


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 12) == [0, 1, 2]
    assert kv.allocate_slots("b", 8) is None
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots("b", 4) == [3]
    kv.check_integrity()


def test_free_returns_blocks_tail_first_to_the_back_of_the_queue():
    kv = KVBlockManager(num_gpu_blocks=6, block_size=2)
    kv.allocate_slots("a", 6)  # 0 1 2
    kv.allocate_slots("b", 2)  # 3
    kv.free("a")
    # Free queue is now 4 5 | 2 1 0: unused blocks first, then a's blocks tail first.
    assert kv.allocate_slots("c", 10) == [4, 5, 2, 1, 0]
    kv.check_integrity()


def test_double_free_and_unknown_free_are_errors():
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4)
    kv.allocate_slots("a", 4)
    kv.free("a")
    with pytest.raises(KVIntegrityError, match="holds no blocks"):
        kv.free("a")


def test_fork_shares_blocks_with_reference_counts():
    kv = KVBlockManager(num_gpu_blocks=6, block_size=4)
    kv.allocate_slots("a", 8)
    assert kv.fork("a", "b") == [0, 1]
    kv.free("a")
    assert kv.num_free_blocks == 4  # still referenced by b
    kv.check_integrity()
    kv.free("b")
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_shared_blocks_return_tail_first_once_the_last_holder_frees():
    kv = KVBlockManager(num_gpu_blocks=8, block_size=4)
    kv.allocate_slots("a", 8)  # 0 1
    kv.fork("a", "b")
    kv.fork("b", "c")  # blocks 0 and 1 held three times
    assert kv.allocate_slots("b", 9) == [2]
    kv.free("a")
    kv.free("c")
    assert kv.num_free_blocks == 5 and kv._gpu.free_blocks() == [3, 4, 5, 6, 7]
    kv.check_integrity()
    kv.free("b")  # the last holder: its whole table, tail first
    assert kv._gpu.free_blocks() == [3, 4, 5, 6, 7, 2, 1, 0]
    kv.check_integrity()
    # Nothing is shared any more: the next fork starts from one reference again.
    kv.allocate_slots("d", 4)
    kv.fork("d", "e")
    kv.free("d")
    assert kv.num_free_blocks == 7
    kv.free("e")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_integrity_check_catches_a_block_in_two_tables_without_a_fork():
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4)
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 4)
    kv.block_tables["b"].append(0)  # held by a, never shared with b
    with pytest.raises(KVIntegrityError, match="block 0 is held by 2 tables but the pool counts 1 references"):
        kv.check_integrity()


def test_swap_round_trip_returns_copy_pairs():
    kv = KVBlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=4)
    kv.allocate_slots("x", 4)  # 0
    kv.allocate_slots("a", 12)  # 1 2 3
    assert kv.swap_out("a") == [(1, 0), (2, 1), (3, 2)]
    assert kv.num_free_blocks == 7 and kv.num_free_cpu_blocks == 1
    kv.check_integrity()
    with pytest.raises(KVIntegrityError, match="swapped out"):
        kv.allocate_slots("a", 13)
    assert kv.swap_in("a") == [(0, 4), (1, 5), (2, 6)]
    assert kv.block_table("a") == [4, 5, 6]
    assert kv.num_free_cpu_blocks == 4
    kv.check_integrity()


def test_swap_out_fails_cleanly_when_cpu_pool_is_full():
    kv = KVBlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=2)
    kv.allocate_slots("a", 12)
    assert kv.swap_out("a") is None
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_integrity()


def test_integrity_check_catches_corruption():
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4)
    kv.allocate_slots("a", 8)
    kv._gpu.free_queue.append(0)  # block 0 both held and free
    kv._gpu.num_free += 1  # counted free too: the per-block check must find it
    with pytest.raises(KVIntegrityError, match="block 0 is held by 1 tables but the pool counts 0"):
        kv.check_integrity()


def test_integrity_check_catches_a_block_neither_held_nor_free():
    """A leaked block whose reference count dropped to none: the counts agree with the
    tables block for block, and no block is free to compare with (the pool is full)."""
    kv = KVBlockManager(num_gpu_blocks=2, block_size=4)
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 4)
    del kv.block_tables["b"]  # block 1 leaks
    kv._gpu.shared[1] = -1  # and counts no reference
    with pytest.raises(KVIntegrityError, match="block 1 has 0 refs and is not free"):
        kv.check_integrity()


def test_integrity_check_catches_a_free_count_that_drifted():
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4)
    kv.allocate_slots("a", 8)
    kv._gpu.num_free += 1
    with pytest.raises(KVIntegrityError, match="3 blocks counted free, 2 in the free queue"):
        kv.check_integrity()


@pytest.mark.parametrize("fault,message", [
    ("repeat", "gpu: a block is in the free queue twice"),
    ("outside", "gpu: the free queue holds a block id outside the pool"),
    ("held_outside", "gpu: request a holds bad block id 9"),
    ("empty", "gpu: request a has an empty block table"),
    ("swapped_shared", "cpu: block 0 is held by 1 tables but the pool counts 2 references"),
    ("held_unused", "gpu: block 3 is held by 1 tables but the pool counts 0 references"),
    ("shared_unused", "gpu: block 2 is held by 0 tables but the pool counts 1 references"),
    ("fresh_past_pool", "gpu: 5 blocks counted handed out, in a pool of 4"),
])
def test_integrity_check_names_each_fault_of_the_books(fault, message):
    """The check decides in numpy and walks the books only to name the fault: each kind of
    fault is found and named, in the GPU and in the CPU pool."""
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=4)
    kv.allocate_slots("a", 8)  # blocks 0, 1
    kv.check_integrity()
    if fault == "repeat":  # block 3 twice in the queue: one more free than blocks 2 and 3
        kv._gpu.free_queue.append(3)
        kv._gpu.num_free += 1
    elif fault == "outside":
        kv._gpu.free_queue.append(7)
        kv._gpu.num_free += 1
    elif fault == "held_outside":
        kv.block_tables["a"].append(9)
    elif fault == "empty":
        kv.block_tables["a"].clear()
    elif fault == "held_unused":  # a block never handed out, in a table
        kv.block_tables["a"].append(3)
    elif fault == "shared_unused":  # a block never handed out, counted as shared
        kv._gpu.shared[2] = 1
    elif fault == "fresh_past_pool":  # the count of blocks handed out, past the pool
        kv._gpu.fresh = 5
        kv._gpu.num_free = -1
    else:
        kv.allocate_slots("b", 4)
        assert kv.swap_out("b") is not None
        kv._cpu.shared[0] = 1  # a swapped block counted twice, held once
    with pytest.raises(KVIntegrityError, match=f"^{re.escape(message)}"):
        kv.check_integrity()


def test_integrity_check_names_a_cached_key_on_the_wrong_block():
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True)
    kv.allocate_slots("a", 8)
    kv.cached = {"k0": 0, "k1": 1}
    kv.block_key = {0: "k0", 1: "k1"}
    kv.check_integrity()
    kv.block_key = {0: "k0", 1: "k0"}
    with pytest.raises(KVIntegrityError, match="cached key 'k1' names block 1, which holds 'k0'"):
        kv.check_integrity()


def test_usage_and_peak():
    kv = KVBlockManager(num_gpu_blocks=10, block_size=16)
    kv.allocate_slots("a", 50)
    assert kv.usage == pytest.approx(0.4)
    kv.free("a")
    assert kv.usage == 0 and kv.peak_used_blocks == 4


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"num_gpu_blocks": 0}])
def test_bad_sizes_are_refused(bad):
    args = {"num_gpu_blocks": 4, "block_size": 4, **bad}
    with pytest.raises(ValueError, match="block"):
        KVBlockManager(**args)


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "swap_out", "swap_in", "fork"]),
              st.integers(0, 5), st.integers(1, 40)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 16), st.integers(1, 8), st.integers(0, 12))
def test_random_operation_sequences_keep_integrity(seq, gpu, bs, cpu):
    kv = KVBlockManager(num_gpu_blocks=gpu, block_size=bs, num_cpu_blocks=cpu)
    tokens: dict[int, int] = {}
    for op, rid, n in seq:
        if op == "grow" and rid not in kv.cpu_tables:
            target = tokens.get(rid, 0) + n
            before = kv.num_free_blocks
            new = kv.allocate_slots(rid, target)
            if new is None:
                assert kv.num_free_blocks == before
            else:
                tokens[rid] = target
                assert len(kv.block_table(rid)) == blocks_for(target, bs)
        elif op == "free" and kv.has_blocks(rid):
            kv.free(rid)
            tokens.pop(rid, None)
        elif op == "swap_out" and rid in kv.block_tables:
            kv.swap_out(rid)
        elif op == "swap_in" and rid in kv.cpu_tables:
            kv.swap_in(rid)
        elif op == "fork" and rid in kv.block_tables and (rid + 100) not in kv.block_tables:
            kv.fork(rid, rid + 100)
        kv.check_integrity()
    for rid in list(kv.block_tables) + list(kv.cpu_tables):
        if kv.has_blocks(rid):
            kv.free(rid)
    kv.check_integrity()
    assert kv.num_free_blocks == gpu and kv.num_free_cpu_blocks == cpu


def test_a_block_freed_twice_is_an_error_when_the_pool_would_overflow():
    """Reference counts are implicit, so a block that got into two tables without ``fork``
    (a bookkeeping bug) is caught when freeing it twice would leave more blocks free than
    the pool holds (``check_integrity`` finds it per block before that: the test above)."""
    kv = KVBlockManager(num_gpu_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 16) == [0]
    kv.block_tables["b"] = [0]  # the bug: block 0 held twice, unshared
    kv.free("a")
    with pytest.raises(KVIntegrityError, match="double free: 5 blocks free in a pool of 4"):
        kv.free("b")


class _ReferenceQueue:
    """The free-queue discipline spelled out on one explicit deque of every free id: what
    the pool's two-part queue (never-used range, then returned blocks) must equal."""

    def __init__(self, n: int) -> None:
        self.free = deque(range(n))
        self.refs: dict[int, int] = {}

    def take(self, k: int) -> list[int]:
        out = [self.free.popleft() for _ in range(k)]
        for b in out:
            self.refs[b] = 1
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                self.free.append(b)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 16), st.integers(1, 8), st.integers(0, 12))
def test_free_queue_order_equals_one_explicit_queue(seq, gpu, bs, cpu):
    """Every block id handed out, and the whole free queue after each operation, are those
    of a single queue that started as 0 .. n-1 (forks and swaps included)."""
    kv = KVBlockManager(num_gpu_blocks=gpu, block_size=bs, num_cpu_blocks=cpu)
    ref_gpu, ref_cpu = _ReferenceQueue(gpu), _ReferenceQueue(cpu)
    tokens: dict[int, int] = {}
    for op, rid, n in seq:
        if op == "grow" and rid not in kv.cpu_tables:
            need = kv.blocks_needed(rid, tokens.get(rid, 0) + n)
            new = kv.allocate_slots(rid, tokens.get(rid, 0) + n)
            if new is not None:
                tokens[rid] = tokens.get(rid, 0) + n
                assert new == ref_gpu.take(need)
        elif op == "free" and kv.has_blocks(rid):
            ref_gpu.release(kv.block_tables.get(rid, []))
            ref_cpu.release(kv.cpu_tables.get(rid, []))
            kv.free(rid)
        elif op == "swap_out" and rid in kv.block_tables:
            table = list(kv.block_tables[rid])
            pairs = kv.swap_out(rid)
            if pairs is not None:
                assert [c for _, c in pairs] == ref_cpu.take(len(table))
                ref_gpu.release(table)
        elif op == "swap_in" and rid in kv.cpu_tables:
            cpu_table = list(kv.cpu_tables[rid])
            pairs = kv.swap_in(rid)
            if pairs is not None:
                assert [g for _, g in pairs] == ref_gpu.take(len(cpu_table))
                ref_cpu.release(cpu_table)
        elif op == "fork" and rid in kv.block_tables and (rid + 100) not in kv.block_tables:
            for b in kv.fork(rid, rid + 100):
                ref_gpu.refs[b] += 1
        assert kv._gpu.free_blocks() == list(ref_gpu.free)
        assert kv._cpu.free_blocks() == list(ref_cpu.free)


# Few blocks per call (the pool's per-block loops) and many (its bulk path, from _BULK).
pool_ops = st.lists(st.tuples(st.sampled_from(["take", "take_all", "release", "share",
                                              "revive", "attach"]),
                             st.one_of(st.integers(0, 8), st.integers(_BULK, 3 * _BULK))),
                    max_size=150)


@settings(max_examples=300, deadline=None)
@given(pool_ops, st.one_of(st.integers(1, 12), st.integers(_BULK, 6 * _BULK)))
def test_caching_pool_queue_equals_one_explicit_queue(seq, n):
    """The prefix-caching pool, whose free blocks can also leave from the middle of the queue
    (``revive``: a cached block hit), hands out and queues blocks as one explicit queue does,
    shared blocks and stale entries included (the queue's bulk paths and its loops)."""
    pool, ref = _CachingPool(n), _ReferenceQueue(n)
    held: list[list[int]] = []  # each holder's blocks
    for op, k in seq:
        if op == "take_all" and pool.num_free:
            k, op = pool.num_free, "take"
        if op == "take" and 0 < k <= pool.num_free:
            blocks = pool.take(k)
            assert blocks == ref.take(k)
            held.append(blocks)
        elif op == "release" and held:
            blocks = held.pop(k % len(held))
            pool.release(blocks)
            ref.release(blocks)
        elif op == "share" and held:
            blocks = held[k % len(held)]
            pool.share(blocks)
            for b in blocks:
                ref.refs[b] += 1
            held.append(list(blocks))
        elif op == "revive":
            returned = pool.returned_blocks()
            for j in range(min(k, 3)) if returned else ():  # a few from the middle at once
                b = returned[(k + 7 * j) % len(returned)]
                if pool.is_free(b):
                    pool.revive(b)
                    ref.free.remove(b)
                    ref.refs[b] = 1
                    held.append([b])
        elif op == "attach":  # a cache hit: free cached blocks and held ones, as attach takes them
            returned, holders = pool.returned_blocks(), [b for g in held for b in g]
            picked = list(dict.fromkeys(
                [*returned[k % 5::3], *holders[k % 3::2]][:k]))  # distinct, free and held mixed
            free = [b for b in picked if b in ref.free]
            assert pool.count_free(picked) == len(free)
            others = pool.revive_free(picked)
            assert others == [b for b in picked if b not in free]
            if others:
                pool.share(others)
            for b in picked:
                if b in free:
                    ref.free.remove(b)
                    ref.refs[b] = 1
                else:
                    ref.refs[b] += 1
            if picked:
                held.append(picked)
        assert pool.free_blocks() == list(ref.free)
        assert pool.num_free == len(ref.free)
        assert all(pool.is_free(b) == (b in ref.free) for b in range(n) if b < pool.fresh)


def test_caching_pool_keeps_its_order_across_compactions():
    """Thousands of takes and releases move the queue's head past its compaction point
    (entries before it are dropped, positions stay absolute) many times over, with revives
    leaving stale entries on the way and runs of blocks shared by two holders (released in
    bulk with their references): the pool still equals one explicit queue."""
    rng = random.Random(7)
    n = 64
    pool, ref = _CachingPool(n), _ReferenceQueue(n)
    held: list[list[int]] = []
    for _ in range(6000):
        r = rng.random()
        if r < 0.45 and pool.num_free:
            k = rng.choice([1, 2, 3, rng.randint(_BULK, 40)])
            k = min(k, pool.num_free)
            blocks = pool.take(k)
            assert blocks == ref.take(k)
            held.append(blocks)
        elif r < 0.85 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
            ref.release(blocks)
        elif r < 0.9 and held:
            blocks = rng.choice(held)
            pool.share(blocks)
            for b in blocks:
                ref.refs[b] += 1
            held.append(list(blocks))
        else:
            returned = pool.returned_blocks()
            if returned:
                b = rng.choice(returned)
                pool.revive(b)
                ref.free.remove(b)
                ref.refs[b] = 1
                held.append([b])
        assert pool.free_blocks() == list(ref.free)
    assert pool.base > 0 and pool.num_free == len(ref.free)  # (it compacted)


def test_caching_pool_refuses_what_its_callers_never_ask():
    """Reviving a block that is not free is an integrity error; a hit that lists a block
    twice takes it once and shares it the second time, as one block at a time would; a
    queue entry past every block ever handed out (broken books) is no free block."""
    pool = _CachingPool(40)
    blocks = pool.take(40)
    with pytest.raises(KVIntegrityError, match="block 3 revived but not free"):
        pool.revive(3)
    pool.release(blocks[:20])  # blocks 19 .. 0 queued, tail first
    twice = [*range(10), 5, *range(10, 20)]  # 5 twice, 21 blocks: the bulk size
    assert pool.revive_free(twice) == [5]
    assert pool.num_free == 0 and pool.returned_blocks() == []
    pool.free_queue.append(99)  # an id no block has
    pool.num_free += 1
    assert pool.returned_blocks() == []
    kv = KVBlockManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True)
    kv.allocate_slots("a", 8)
    kv._gpu.free_queue.append(7)
    kv._gpu.num_free += 1
    with pytest.raises(KVIntegrityError, match="^gpu: 3 blocks counted free"):
        kv.check_integrity()


def test_a_pool_of_ten_million_blocks_costs_nothing_until_used():
    """A pool holds no per-block state for blocks never handed out: building ten million
    blocks (GPU and CPU) allocates under a kilobyte, ids come out 0, 1, 2 ..., and returned
    blocks queue behind every never-used one."""
    tracemalloc.start()
    kv = KVBlockManager(num_gpu_blocks=10_000_000, block_size=1, num_cpu_blocks=10_000_000)
    built, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert built < 1024
    assert kv.allocate_slots("a", 3) == [0, 1, 2]
    # Checking the books reads the blocks handed out, not the pool (check_integrity=true
    # runs it after every step).
    tracemalloc.start()
    kv.check_integrity()
    _, checked = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert checked < 64 * 1024
    kv.free("a")
    assert kv.num_free_blocks == 10_000_000
    assert kv._gpu.take(9_999_999)[-2:] == [2, 1]
    assert kv._gpu.free_blocks() == [0]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), hit=st.integers(0, 300), later=st.sets(st.integers(0, 300)))
def test_a_match_is_the_cached_run_up_to_the_first_miss(n, hit, later):
    """``_leading`` looks keys up in runs that double: the blocks of the keys up to the
    first one missing, whatever the run boundaries, with keys after that miss cached or
    not."""
    hit = min(hit, n)
    blocks = {k: 1000 + k for k in range(hit)}
    blocks.update((k, 1000 + k) for k in later if k > hit)
    assert _leading(blocks, list(range(n))) == [1000 + k for k in range(hit)]

