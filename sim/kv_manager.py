"""Paged KV-cache block manager (vLLM-style), the only one in the project.

Block ids are real: the real executor indexes its KV tensor rows with them, and the CPU swap
pool's ids index its CPU swap tensor. Blocks are handed out from the front of a free queue and
returned to its back, tail block first (as vLLM frees), so the most recently used blocks of a
finished request are reused last.

::

    GPU pool  [0 .. num_gpu_blocks)   free queue: FIFO of ids (no references)
    CPU pool  [0 .. num_cpu_blocks)   swap space, same discipline
    block_tables[request_id] -> [gpu block ids], logical order
    cpu_tables[request_id]   -> [cpu block ids] while swapped

With ``enable_prefix_caching`` (vLLM v1's automatic prefix caching) full blocks are also
content-addressed: ``cached[key] -> block`` for blocks whose content a later request may
reuse (keys from sim/prefix_cache.py). A freed block keeps its content and its key in the
free queue until it is handed out again (then it is evicted: the least recently freed cached
block goes first, tail blocks of a request before its prefix); a request whose prompt
starts with cached blocks is handed those very blocks (``match`` / ``attach``), taken out of
the free queue or shared with the requests that hold them.

With an offload tier (``num_offload_blocks``: vLLM's CPU offloading connector, LMCache,
SGLang's HiCache) a cached block evicted from the GPU is first copied to a block of a third
pool in host memory, kept there by content in least-recently-used order, and a later request
whose prefix continues in that tier gets new GPU blocks loaded from it (``load``) instead of
computing them again. The copies a step must make, in the order the manager made them, go
to ``copy_log`` (the step plan's ``swaps``)::

    offload pool [0 .. num_offload_blocks)   LRU of content: front = next to be overwritten
    offloaded[key] -> offload block id
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np


class KVIntegrityError(AssertionError):
    """The manager's bookkeeping is inconsistent (leak, double free, bad ref count)."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def blocks_added(held_tokens: int, new_tokens: int, block_size: int) -> int:
    """The blocks a table holding ``held_tokens`` tokens takes to hold ``new_tokens`` more."""
    return blocks_for(held_tokens + new_tokens, block_size) - blocks_for(held_tokens, block_size)


def _leading(blocks: dict[Hashable, int], keys: Sequence[Hashable]) -> list[int]:
    """The blocks ``blocks`` maps ``keys`` to, from the first key up to the first it lacks
    (keys looked up in C, in runs that double from 8: a prompt of one-token blocks has
    hundreds, and a short hit looks up few more than it finds)."""
    get = blocks.get
    found: list[int] = []
    start, n, run = 0, len(keys), 8
    while start < n:
        part = list(map(get, keys[start:start + run]))
        try:
            found += part[:part.index(None)]
            return found
        except ValueError:  # every key of the run is there
            found += part
        start += run
        run += run
    return found


class _Pool:
    """A pool of blocks with reference counts and a FIFO free queue.

    The free queue is held in two parts, front to back: the blocks never handed out yet, a
    range ``[fresh, num_blocks)`` kept as two integers, then the blocks returned since, a list
    read from ``head`` (taking n blocks is one slice; the list is compacted now and then).
    Blocks are taken from the front and returned to the back, so every never-used block comes
    before every returned one, exactly as in one queue that started as ``0 .. num_blocks-1``;
    but a pool of any size builds in O(1) time and memory.

    Reference counts are implicit where they can be: a block in the free queue has none, a
    block taken from it has one, and only blocks shared by several tables (``share``, from
    ``fork``) have an entry in ``shared``: their references beyond the first. So taking and
    releasing blocks nobody shares (nearly all of them) is a slice and an ``extend``, with no
    per-block Python work."""

    __slots__ = ("num_blocks", "fresh", "free_queue", "head", "shared", "num_free")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.fresh = 0  # blocks [fresh, num_blocks) were never handed out
        self.free_queue: list[int] = []  # returned blocks, read from ``head``
        self.head = 0
        self.shared: dict[int, int] = {}
        # The queue's length, kept as a count (read on every allocation).
        self.num_free = num_blocks

    def free_blocks(self) -> list[int]:
        """The free queue, front first (O(free blocks): for checks and tests)."""
        return [*range(self.fresh, self.num_blocks), *self.returned_blocks()]

    def returned_blocks(self) -> list[int]:
        """The free queue past its never-used blocks ``[fresh, num_blocks)``, front first."""
        return self.free_queue[self.head:]

    def ref_counts(self, free: list[int] | None = None) -> list[int]:
        """Every block's reference count (0 for a free block), for integrity checks;
        ``free``: the free queue if the caller has it already."""
        refs = [1] * self.num_blocks
        for b in self.free_blocks() if free is None else free:
            refs[b] = 0
        for b, extra in self.shared.items():
            refs[b] += extra
        return refs

    def take(self, n: int) -> list[int]:
        """The first ``n`` blocks of the free queue (the caller checked ``num_free``)."""
        self.num_free -= n
        fresh = self.fresh
        if fresh < self.num_blocks:  # never-used blocks first: they are the queue's front
            k = min(n, self.num_blocks - fresh)
            self.fresh = fresh + k
            if k == n:
                return list(range(fresh, fresh + k))
            return [*range(fresh, fresh + k), *self._take_returned(n - k)]
        return self._take_returned(n)

    def _take_returned(self, n: int) -> list[int]:
        h = self.head
        out = self.free_queue[h:h + n]
        h += n
        if h > 1024 and 2 * h > len(self.free_queue):
            del self.free_queue[:h]
            h = 0
        self.head = h
        return out

    def _drop_references(self, blocks: list[int]) -> list[int]:
        """Drop one reference to each of ``blocks``, tail first; those left with none, in
        that order (to go back to the free queue)."""
        shared = self.shared
        freed = []
        for b in reversed(blocks):
            extra = shared.get(b)
            if extra is None:
                freed.append(b)
            elif extra == 1:
                del shared[b]
            else:
                shared[b] = extra - 1
        return freed

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (held blocks)."""
        shared = self.shared
        for b in blocks:
            shared[b] = shared.get(b, 0) + 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; those left with none go to the back of
        the free queue, tail first (the prefix stays cached longest)."""
        shared = self.shared
        if not shared:  # nothing is shared: every block was this table's alone
            self.free_queue.extend(reversed(blocks))
            self.num_free += len(blocks)
        else:
            freed = self._drop_references(blocks)
            self.free_queue.extend(freed)
            self.num_free += len(freed)
        # Per-block double frees are found by ``check_integrity`` (counts are implicit); this
        # O(1) guard catches those that leave more blocks free than the pool has.
        if self.num_free > self.num_blocks:
            raise KVIntegrityError(
                f"double free: {self.num_free} blocks free in a pool of "
                f"{self.num_blocks} after releasing {blocks}")


class _CachingPool(_Pool):
    """A ``_Pool`` whose returned blocks can also leave the free queue from the middle: a
    cached block handed to a request that hits it (``revive``). Each returned block's
    position in the queue is kept (``pos[block]``, absolute: ``base`` counts the entries
    compacted away; -1 for a block that is not a free returned one); an entry whose block
    has left since, or was returned again later, is stale and skipped when the queue is
    read. Blocks never handed out hold no content, so they never leave from the middle and
    stay a range.

    The queue and the positions are C arrays, read and written in bulk through numpy views
    where a call moves many blocks (``_BULK``): a pool of one-token blocks (SGLang's page
    size) returns a thousand blocks per request and hands them out again a run at a time.
    ``pos`` covers the blocks handed out so far (``fresh``), so an unused pool holds none.

    ``front_without`` remembers how far it has read: the entries from the front up to
    ``clean_end`` (absolute) hold ``clean_live`` live blocks, none with content. A free block
    gains no content (only held blocks are registered) and such a block leaves only from the
    front, so the next call reads on from there: a pool that runs without evicting for a
    long while reads each returned block about once, not the whole queue at every call."""

    __slots__ = ("base", "pos", "clean_end", "clean_live")

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.free_queue: array = array("q")  # type: ignore[assignment]
        self.base = 0
        self.pos = array("q")  # block -> its live queue entry (absolute), or -1
        self.clean_end = 0
        self.clean_live = 0

    def take(self, n: int) -> list[int]:
        grown = min(self.fresh + n, self.num_blocks) - len(self.pos)
        if grown > 0:  # blocks handed out for the first time: not in the queue (-1)
            self.pos.frombytes(b"\xff" * (8 * grown))
        return super().take(n)

    def returned_blocks(self) -> list[int]:
        h = self.head
        n = len(self.free_queue) - h
        if not n:
            return []
        at = self.base + h
        entries = np.frombuffer(self.free_queue, np.int64)[h:]
        positions = np.frombuffer(self.pos, np.int64)
        # (An id past the blocks ever handed out is no live entry: books an integrity
        # check is looking at may hold one.)
        known = (entries >= 0) & (entries < len(positions))
        live = known & (positions[np.where(known, entries, 0)] == np.arange(at, at + n))
        out = entries[live].tolist()
        del entries, positions  # (an array exporting its buffer cannot grow)
        return out

    def is_free(self, block: int) -> bool:
        return block < len(self.pos) and self.pos[block] >= 0

    def front_without(self, keyed: Mapping[int, Any]) -> int:
        """How many blocks the free queue's front holds before the first one in ``keyed``
        (the owner's blocks with cached content, always the same mapping): those can be
        handed out without evicting anything. Reads on from where the last call stopped
        (class docstring)."""
        q, pos = self.free_queue, self.pos
        at = self.clean_end
        live = self.clean_live
        for i in range(at - self.base, len(q)):
            b = q[i]
            if pos[b] == at:  # a live entry
                if b in keyed:
                    break
                live += 1
            at += 1
        self.clean_end, self.clean_live = at, live
        return self.num_blocks - self.fresh + live  # never handed out: no content either

    def check_clean(self, keyed: Mapping[int, Any]) -> None:
        """Raise ``KVIntegrityError`` unless the front ``front_without`` read clean holds
        ``clean_live`` live blocks, none in ``keyed``."""
        q, pos = self.free_queue, self.pos
        start = self.base + self.head
        if self.clean_end < start:
            raise KVIntegrityError(f"the free queue read clean up to {self.clean_end}, "
                                   f"behind its front at {start}")
        live = [q[i - self.base] for i in range(start, self.clean_end)
                if pos[q[i - self.base]] == i]
        if len(live) != self.clean_live or any(b in keyed for b in live):
            raise KVIntegrityError(f"the free queue's front read clean holds {len(live)} "
                                   f"live blocks, counted {self.clean_live}, or cached ones")

    def revive(self, block: int) -> None:
        """Take the free ``block`` out of the queue, wherever it is (one reference now)."""
        if not self.is_free(block):
            raise KVIntegrityError(f"block {block} revived but not free")
        if self.pos[block] < self.clean_end:  # (a block with content never is)
            self.clean_live -= 1
        self.pos[block] = -1
        self.num_free -= 1

    def _take_returned(self, n: int) -> list[int]:
        q, pos, h = self.free_queue, self.pos, self.head
        at = self.base + h
        out: list[int] | None = None
        if n >= _BULK and len(q) - h >= n:
            # The common case, in bulk: the next n entries are all live (no block left the
            # queue from among them, none came back later).
            entries = np.frombuffer(q, np.int64)[h:h + n]
            positions = np.frombuffer(pos, np.int64)
            if (positions[entries] == np.arange(at, at + n)).all():
                positions[entries] = -1
                out = entries.tolist()
                h += n
            del entries, positions  # (an array exporting its buffer cannot shrink)
        if out is None:
            out = []
            while len(out) < n:
                b = q[h]
                if pos[b] == at:
                    pos[b] = -1
                    out.append(b)
                h += 1
                at += 1
        if n <= self.clean_live:  # the front read clean by ``front_without``
            self.clean_live -= n
        else:
            self.clean_end, self.clean_live = self.base + h, 0
        if h > 1024 and 2 * h > len(q):
            del q[:h]
            self.base += h
            h = 0
        self.head = h
        return out

    def release(self, blocks: list[int]) -> None:
        shared = self.shared
        n = len(blocks)
        if not shared or shared.keys().isdisjoint(blocks):
            # The common case: no block is shared, every one goes back to the queue.
            self._queue(blocks[::-1])
        elif len(set(blocks)) == n:
            # Some are shared (a cached prefix other requests hold): those lose a reference,
            # the others go back to the queue, tail first.
            held = shared.keys() & blocks
            for b in held:
                extra = shared[b]
                if extra == 1:
                    del shared[b]
                else:
                    shared[b] = extra - 1
            self._queue([b for b in reversed(blocks) if b not in held])
        else:  # a block listed twice (books gone wrong): one reference at a time
            for b in self._drop_references(blocks):
                self._queue([b])  # (one by one: a block freed twice takes its last place)
        if self.num_free > self.num_blocks:
            raise KVIntegrityError(
                f"double free: {self.num_free} blocks free in a pool of "
                f"{self.num_blocks} after releasing {blocks}")

    def _queue(self, blocks: list[int]) -> None:
        """Put ``blocks`` at the back of the free queue, in this order, as live entries."""
        q, pos, n = self.free_queue, self.pos, len(blocks)
        at = self.base + len(q)
        q.fromlist(blocks)
        if n >= _BULK:
            entries = np.frombuffer(q, np.int64)[len(q) - n:]
            np.frombuffer(pos, np.int64)[entries] = np.arange(at, at + n)
            del entries  # (an array exporting its buffer cannot grow)
        else:
            for i, b in enumerate(blocks, at):
                pos[b] = i
        self.num_free += n

    def count_free(self, blocks: list[int]) -> int:
        """How many of ``blocks`` (handed out before: cached ones) are free."""
        pos = self.pos
        if len(blocks) >= _BULK:
            return int(np.count_nonzero(
                np.frombuffer(pos, np.int64)[np.array(blocks, np.int64)] >= 0))
        return sum(1 for b in blocks if pos[b] >= 0)

    def revive_free(self, blocks: list[int]) -> list[int]:
        """``revive`` each free block of ``blocks`` (distinct ones, handed out before); the
        others (held), in order."""
        pos = self.pos
        if len(blocks) >= _BULK and len(set(blocks)) == len(blocks):
            positions = np.frombuffer(pos, np.int64)
            ids = np.array(blocks, np.int64)
            free = positions[ids] >= 0
            # (A block with content is never in the front ``front_without`` read clean.)
            self.clean_live -= int(np.count_nonzero(positions[ids[free]] < self.clean_end))
            positions[ids[free]] = -1
            self.num_free -= int(np.count_nonzero(free))
            held = ids[~free].tolist()
            del positions  # (an array exporting its buffer cannot grow)
            return held
        held = []
        for b in blocks:
            if pos[b] >= 0:
                self.revive(b)
            else:
                held.append(b)
        return held


# Blocks one call moves from which the caching pool goes through numpy views (below it, a
# loop over the C arrays costs less than building the views).
_BULK = 16


class KVBlockManager:
    """Allocates KV blocks to requests on demand.

    ``allocate_slots`` returns the newly allocated blocks, or ``None`` when the pool cannot
    hold them: the policy must then preempt someone and retry. Nothing is allocated on failure.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = False, num_offload_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"kv.block_size must be >= 1, got {block_size}")
        if num_gpu_blocks < 1:
            raise ValueError(f"kv.num_gpu_blocks_override must be >= 1, got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"kv.num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if num_offload_blocks < 0:
            raise ValueError(f"kv.num_offload_blocks must be >= 0, got {num_offload_blocks}")
        if num_offload_blocks and not enable_prefix_caching:
            raise ValueError("an offload tier keeps cached blocks by content: it needs "
                             "enable_prefix_caching")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._gpu = _CachingPool(num_gpu_blocks) if enable_prefix_caching else _Pool(
            num_gpu_blocks)
        self._cpu = _Pool(num_cpu_blocks)
        self.block_tables: dict[Hashable, list[int]] = {}
        self.cpu_tables: dict[Hashable, list[int]] = {}
        self.peak_used_blocks = 0
        # Prefix caching: content key -> block, its inverse, and how many leading blocks of
        # each table are registered. ``epoch`` changes whenever what ``match`` finds or which
        # of its blocks are free may have changed (a step builder's memo of a match is good
        # while it stays).
        self.cached: dict[Hashable, int] = {}
        self.block_key: dict[int, Hashable] = {}
        self._registered: dict[Hashable, int] = {}
        self.epoch = 0
        self.num_evictions = 0  # cached blocks handed out for other content
        # Prompt tokens looked up at admission, and those the cache supplied (vLLM's
        # prefix_cache_queries / prefix_cache_hits).
        self.prefix_queries = 0
        self.prefix_hits = 0
        # The offload tier: every block is free (no table holds one) but for those a load
        # is reading in this step (pinned), in least-recently-used order.
        self.num_offload_blocks = num_offload_blocks
        self._offload = _CachingPool(num_offload_blocks)
        self.offloaded: dict[Hashable, int] = {}
        self.offload_key: dict[int, Hashable] = {}
        self.num_offload_stores = 0  # blocks copied GPU -> offload tier
        self.num_offload_loads = 0  # blocks copied offload tier -> GPU for a cache hit
        # Where the copies go, as ("store", [(gpu, offload)]) and ("load", [(offload, gpu)])
        # in the order they were made; None: counted only (set per step by the builder).
        self.copy_log: list[tuple[str, list[tuple[int, int]]]] | None = None

    # ---- usage --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - self._gpu.num_free

    @property
    def usage(self) -> float:
        """Fraction of GPU blocks in use."""
        return self.num_used_blocks / self.num_gpu_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu.num_free

    def blocks_needed(self, request_id: Hashable, num_tokens: int) -> int:
        """New GPU blocks required so that ``request_id`` holds slots for ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, num_blocks: int, watermark_blocks: int = 0) -> bool:
        return self._gpu.num_free - num_blocks >= watermark_blocks

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's GPU block table (the live list: do not mutate)."""
        return self.block_tables.get(request_id, [])

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request_id: Hashable, num_tokens: int) -> list[int] | None:
        """Ensure ``request_id`` has slots for its first ``num_tokens`` tokens.

        Returns the blocks added to its table (possibly empty), or ``None`` if the free pool
        is too small, in which case nothing changes.
        """
        if request_id in self.cpu_tables:
            raise KVIntegrityError(f"request {request_id} is swapped out; swap it in first")
        table = self.block_tables.get(request_id)
        have = 0 if table is None else len(table)
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:
            return []
        if need > self._gpu.num_free:
            return None
        new = self._take(need)
        if table is None:
            self.block_tables[request_id] = new
        else:
            table.extend(new)
        used = self.num_gpu_blocks - self._gpu.num_free
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return new

    def grow(self, request_ids: list[Hashable]) -> bool:
        """Append one new block to the table of each listed request, in list order (a request
        listed twice gets two): the blocks, in the order, that ``allocate_slots`` calls for
        them one by one would hand out. False (nothing changes) if the pool is too small."""
        n = len(request_ids)
        if n > self._gpu.num_free:
            return False
        tables = self.block_tables
        for rid, b in zip(request_ids, self._take(n)):
            tables[rid].append(b)
        used = self.num_gpu_blocks - self._gpu.num_free
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return True

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        """Share all of the parent's blocks with a new request (ref counts +1), e.g. for
        parallel sampling. Copy-on-write of a shared partial tail block is the caller's job."""
        if child_id in self.block_tables:
            raise KVIntegrityError(f"request {child_id} already has blocks")
        table = list(self.block_tables[parent_id])
        self._gpu.share(table)
        self.block_tables[child_id] = table
        return table

    def free(self, request_id: Hashable) -> None:
        """Release every block (GPU and CPU) the request holds. Freeing twice is an error."""
        table = self.block_tables.pop(request_id, None)
        cpu = self.cpu_tables.pop(request_id, None)
        if table is None and cpu is None:
            raise KVIntegrityError(f"free of request {request_id}, which holds no blocks")
        if table is not None:
            self._release(request_id, table)
        if cpu is not None:
            self._cpu.release(cpu)

    def has_blocks(self, request_id: Hashable) -> bool:
        return request_id in self.block_tables or request_id in self.cpu_tables

    def _take(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue; a cached one loses its content."""
        blocks = self._gpu.take(n)
        keys = self.block_key
        named = list(filter(keys.__contains__, blocks)) if keys else None  # (in order)
        if named:
            lost = list(map(keys.pop, named))
            deque(map(self.cached.pop, lost), 0)
            self.num_evictions += len(named)
            self.epoch += 1
            if self.num_offload_blocks:
                self._store(list(zip(named, lost)))
        return blocks

    def _store(self, evicted: list[tuple[int, Hashable]]) -> None:
        """Keep the content of GPU blocks being evicted in the offload tier, each in the
        tier's least recently used block (whose content is lost); content the tier holds
        already becomes its most recently used."""
        pool, offloaded, names = self._offload, self.offloaded, self.offload_key
        pairs: list[tuple[int, int]] = []
        for b, key in evicted:
            c = offloaded.get(key)
            if c is not None:
                if pool.is_free(c):
                    pool.revive(c)
                    pool.release([c])
                continue
            if not pool.num_free:  # every tier block is being loaded this step
                break
            c = pool.take(1)[0]
            old = names.pop(c, None)
            if old is not None:
                del offloaded[old]
            offloaded[key] = c
            names[c] = key
            pool.release([c])
            pairs.append((b, c))
        if pairs:
            self.num_offload_stores += len(pairs)
            if self.copy_log is not None:
                self.copy_log.append(("store", pairs))

    def _release(self, request_id: Hashable, table: list[int]) -> None:
        self._gpu.release(table)
        if self.enable_prefix_caching:
            self._registered.pop(request_id, None)
            self.epoch += 1

    # ---- prefix caching -----------------------------------------------------------------
    def match(self, keys: Sequence[Hashable]) -> list[int]:
        """The cached blocks holding ``keys``' content, from the first key up to the first
        one not cached (vLLM v1's longest cache hit: whole blocks, a prefix)."""
        return _leading(self.cached, keys)

    def match_offloaded(self, keys: Sequence[Hashable]) -> list[int]:
        """The offload tier's blocks holding ``keys``' content, from the first key up to the
        first one it does not hold (where a GPU ``match`` stopped, the hit may go on here)."""
        return _leading(self.offloaded, keys)

    def load(self, request_id: Hashable, offload_blocks: list[int],
             keys: Sequence[Hashable]) -> list[int] | None:
        """Append one new GPU block per offload block to ``request_id``'s table (its table
        holds the blocks before them: a ``match``'s, attached), copy the offloaded content
        into them and make them findable by ``keys`` (the table's keys, from its first
        block). Returns the new blocks, or ``None`` (nothing changes) if the GPU pool is too
        small. The offload blocks are pinned while the GPU blocks are taken, so the stores
        that taking them may cause never overwrite what this load reads."""
        n = len(offload_blocks)
        if n > self._gpu.num_free:
            return None
        pool = self._offload
        for c in offload_blocks:
            pool.revive(c)
        gpu = self._take(n)
        table = self.block_tables.setdefault(request_id, [])
        start = len(table)
        table.extend(gpu)
        pool.release(offload_blocks)  # now the most recently used, the first block last
        pairs = list(zip(offload_blocks, gpu))
        self.num_offload_loads += n
        if self.copy_log is not None:
            self.copy_log.append(("load", pairs))
        self.register(request_id, keys, start + n)
        self.peak_used_blocks = max(self.peak_used_blocks,
                                    self.num_gpu_blocks - self._gpu.num_free)
        return gpu

    def free_without_eviction(self) -> int:
        """Free blocks that can be handed out, front first, before one whose cached content
        would be evicted (all free blocks without prefix caching or cached content)."""
        if not self.block_key:
            return self._gpu.num_free
        return self._gpu.front_without(self.block_key)  # type: ignore[attr-defined]

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` (cached blocks) are free: attaching them takes as many free
        blocks off the pool."""
        return self._gpu.count_free(blocks) if blocks else 0  # type: ignore[attr-defined]

    def attach(self, request_id: Hashable, blocks: list[int]) -> None:
        """Start ``request_id``'s table with the cached ``blocks`` (a ``match``): free ones
        leave the free queue, held ones gain a reference."""
        if request_id in self.block_tables or request_id in self.cpu_tables:
            raise KVIntegrityError(f"request {request_id} already holds blocks; a cache hit "
                                   "starts a table")
        pool = self._gpu
        held = pool.revive_free(blocks)  # type: ignore[attr-defined]
        if held:
            pool.share(held)
        self.block_tables[request_id] = list(blocks)
        self._registered[request_id] = len(blocks)
        self.epoch += 1
        used = self.num_gpu_blocks - pool.num_free
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    def register(self, request_id: Hashable, keys: Sequence[Hashable], upto: int) -> None:
        """Make the first ``upto`` blocks of ``request_id``'s table findable by their content
        ``keys`` (their tokens are computed). A key already cached in another block keeps
        that block (the first to compute it); this one stays unnamed."""
        done = self._registered.get(request_id, 0)
        if upto <= done:
            return
        table = self.block_tables[request_id]
        cached, names = self.cached, self.block_key
        new_keys, new_blocks = keys[done:upto], table[done:upto]
        if (cached.keys().isdisjoint(new_keys) and names.keys().isdisjoint(new_blocks)
                and len(set(new_keys)) == len(new_keys)):
            # The common case, in C: content nobody cached, blocks nobody named (a table
            # lists a block once, and distinct keys are each named once).
            cached.update(zip(new_keys, new_blocks))
            names.update(zip(new_blocks, new_keys))
        else:
            for key, b in zip(new_keys, new_blocks):
                if key not in cached and b not in names:
                    cached[key] = b
                    names[b] = key
        self._registered[request_id] = upto
        self.epoch += 1

    def num_registered(self, request_id: Hashable) -> int:
        return self._registered.get(request_id, 0)

    # ---- swapping -----------------------------------------------------------------------
    def can_swap_out(self, request_id: Hashable) -> bool:
        return len(self.block_tables.get(request_id, ())) <= self._cpu.num_free

    def swap_out(self, request_id: Hashable) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the CPU pool. Returns (gpu_id, cpu_id) copies to make,
        or ``None`` when the CPU pool cannot hold them (nothing changes)."""
        if request_id in self.cpu_tables:
            raise KVIntegrityError(f"request {request_id} is already swapped out")
        table = self.block_tables.get(request_id)
        if table is None:
            raise KVIntegrityError(f"swap_out of request {request_id}, which holds no blocks")
        if len(table) > self._cpu.num_free:
            return None
        cpu = self._cpu.take(len(table))
        pairs = list(zip(table, cpu))
        del self.block_tables[request_id]
        self._release(request_id, table)
        self.cpu_tables[request_id] = cpu
        return pairs

    def can_swap_in(self, request_id: Hashable, watermark_blocks: int = 0) -> bool:
        return self.can_allocate(len(self.cpu_tables[request_id]), watermark_blocks)

    def swap_in(self, request_id: Hashable) -> list[tuple[int, int]] | None:
        """Move the request's blocks back to the GPU. Returns (cpu_id, gpu_id) copies to make,
        or ``None`` when the GPU pool cannot hold them (nothing changes)."""
        cpu = self.cpu_tables.get(request_id)
        if cpu is None:
            raise KVIntegrityError(f"swap_in of request {request_id}, which is not swapped out")
        if len(cpu) > self._gpu.num_free:
            return None
        gpu = self._take(len(cpu))
        del self.cpu_tables[request_id]
        self._cpu.release(cpu)
        self.block_tables[request_id] = gpu
        used = self.num_gpu_blocks - self._gpu.num_free
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return list(zip(cpu, gpu))

    # ---- integrity ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``KVIntegrityError`` unless every block is either free exactly once and held
        by no table, or held by as many tables as the pool counts references (one for a taken
        block, plus its entry in ``shared`` if forked)."""
        for name, pool, tables in (
            ("gpu", self._gpu, self.block_tables),
            ("cpu", self._cpu, self.cpu_tables),
        ):
            if not 0 <= pool.fresh <= pool.num_blocks:
                raise KVIntegrityError(f"{name}: {pool.fresh} blocks counted handed out, in "
                                       f"a pool of {pool.num_blocks}")
            returned = pool.returned_blocks()
            queued = pool.num_blocks - pool.fresh + len(returned)
            if pool.num_free != queued:
                raise KVIntegrityError(f"{name}: {pool.num_free} blocks counted free, "
                                       f"{queued} in the free queue")
            # This runs after every step of a checked run: the whole test in numpy first,
            # over the blocks handed out so far (a pool of millions, most never used, costs
            # what its used part does), and the walk that names the first block at fault
            # only where it fails.
            if not _books_agree(pool, tables, returned):
                _name_the_fault(name, pool, tables, pool.free_blocks())
        gpu = self._gpu
        if isinstance(gpu, _CachingPool):
            gpu.check_clean(self.block_key)  # what the counts so far left
            # And a count now, against the whole queue (a checked run plans no decode jump,
            # which is what asks for it otherwise).
            front = 0
            for b in gpu.returned_blocks():
                if b in self.block_key:
                    break
                front += 1
            counted = self.free_without_eviction()
            if counted != gpu.num_blocks - gpu.fresh + front:
                raise KVIntegrityError(
                    f"{counted} free blocks counted before the first cached one; the free "
                    f"queue holds {gpu.num_blocks - gpu.fresh + front}")
        if len(self.cached) != len(self.block_key):
            raise KVIntegrityError(f"{len(self.cached)} cached keys name "
                                   f"{len(self.block_key)} blocks")
        # Each cached key names the block that holds it: with as many keys as blocks, exactly
        # when the map inverted is ``block_key`` (compared in C; walked only to name a fault).
        if {b: key for key, b in self.cached.items()} != self.block_key:
            for key, b in self.cached.items():
                if self.block_key.get(b) == key:
                    continue
                raise KVIntegrityError(f"cached key {key!r} names block {b}, which holds "
                                       f"{self.block_key.get(b)!r}")
            raise KVIntegrityError("two cached keys name one block")
        for rid, n in self._registered.items():
            if n > len(self.block_tables.get(rid, ())):
                raise KVIntegrityError(f"request {rid}: {n} blocks registered, table of "
                                       f"{len(self.block_tables.get(rid, ()))}")
        off = self._offload
        if off.num_free != off.num_blocks:
            raise KVIntegrityError(f"offload tier: {off.num_blocks - off.num_free} blocks "
                                   "still pinned between steps")
        if len(self.offloaded) != len(self.offload_key) or any(
                self.offload_key.get(c) != key for key, c in self.offloaded.items()):
            raise KVIntegrityError("offload tier: its content map and block names disagree")
        if any(not 0 <= c < off.num_blocks for c in self.offload_key):
            raise KVIntegrityError("offload tier: a block id outside the tier")
        both = self.block_tables.keys() & self.cpu_tables.keys()
        if both:
            raise KVIntegrityError(f"requests {sorted(both)} hold both GPU and CPU blocks")


def _books_agree(pool: _Pool, tables: Mapping[Hashable, list[int]],
                 free: list[int]) -> bool:
    """Whether ``pool``'s books hold (what ``_name_the_fault`` checks block by block): no
    empty table, every held id in the pool, the free queue without repeats, and each
    block's count of holding tables equal to the pool's reference count (0 exactly for the
    free blocks, 1 for a taken one, more for a shared one). ``free``: the free queue past
    the blocks never handed out (``returned_blocks``), which are free and held by nobody
    exactly when no id held, returned or shared reaches ``fresh``: only the blocks handed
    out so far are counted."""
    n = pool.fresh
    if not all(tables.values()):
        return False
    held = np.fromiter(chain.from_iterable(tables.values()), np.int64)
    if len(held) and (held.min() < 0 or held.max() >= n):
        return False
    queue = np.fromiter(free, np.int64, len(free))
    if len(queue) and (queue.min() < 0 or queue.max() >= n):
        return False
    counts = np.ones(n, np.int64)
    counts[queue] = 0
    if pool.shared:
        ids = np.fromiter(pool.shared, np.int64, len(pool.shared))
        if ids.min() < 0 or ids.max() >= n:
            return False
        counts[ids] += np.fromiter(pool.shared.values(), np.int64, len(ids))
    # Shared extras are positive, so the blocks counted with none are the free queue's
    # distinct blocks: as many as the queue holds exactly when it has no repeat.
    return (n - np.count_nonzero(counts) == len(queue)
            and np.array_equal(np.bincount(held, minlength=n), counts))


def _name_the_fault(name: str, pool: _Pool, tables: Mapping[Hashable, list[int]],
                    free: list[int]) -> None:
    """Raise ``KVIntegrityError`` naming the first fault of ``pool``'s books (``name``: which
    pool), walking them block by block."""
    refs = [0] * pool.num_blocks
    for rid, table in tables.items():
        if not table:
            raise KVIntegrityError(f"{name}: request {rid} has an empty block table")
        for b in table:
            if not 0 <= b < pool.num_blocks:
                raise KVIntegrityError(f"{name}: request {rid} holds bad block id {b}")
            refs[b] += 1
    free_set = set(free)
    if len(free_set) != len(free):
        raise KVIntegrityError(f"{name}: a block is in the free queue twice")
    if any(not 0 <= b < pool.num_blocks for b in free):
        raise KVIntegrityError(f"{name}: the free queue holds a block id outside the pool")
    counts = pool.ref_counts(free)
    for b in range(pool.num_blocks):
        if refs[b] != counts[b]:
            raise KVIntegrityError(
                f"{name}: block {b} is held by {refs[b]} tables but the pool counts "
                f"{counts[b]} references (free queue and shared blocks)"
            )
        if (refs[b] == 0) != (b in free_set):
            state = "free" if b in free_set else "not free"
            raise KVIntegrityError(f"{name}: block {b} has {refs[b]} refs and is {state}")
    raise AssertionError(f"{name}: the books disagree, yet no block is at fault")


def _read_only(name: str) -> property:
    return property(lambda view: getattr(view._kv, name), doc=f"The pool's ``{name}``.")


class KVView:
    """What a policy may read of a replica's KV pool (``StepBuilder.kv``): sizes, counts and
    block tables. Not the manager: every KV operation goes through the step builder, the one
    home of KV and request state changes, so a policy cannot allocate or free behind it."""

    __slots__ = ("_kv",)

    block_size = _read_only("block_size")
    num_gpu_blocks = _read_only("num_gpu_blocks")
    num_cpu_blocks = _read_only("num_cpu_blocks")
    num_free_blocks = _read_only("num_free_blocks")
    num_used_blocks = _read_only("num_used_blocks")
    num_free_cpu_blocks = _read_only("num_free_cpu_blocks")
    num_offload_blocks = _read_only("num_offload_blocks")
    usage = _read_only("usage")

    def __init__(self, kv: KVBlockManager) -> None:
        self._kv = kv

    def blocks_needed(self, request_id: Hashable, num_tokens: int) -> int:
        return self._kv.blocks_needed(request_id, num_tokens)

    def can_allocate(self, num_blocks: int, watermark_blocks: int = 0) -> bool:
        return self._kv.can_allocate(num_blocks, watermark_blocks)

    def has_blocks(self, request_id: Hashable) -> bool:
        return self._kv.has_blocks(request_id)

    def block_table(self, request_id: Hashable) -> tuple[int, ...]:
        """A copy of the request's GPU block table."""
        return tuple(self._kv.block_table(request_id))
