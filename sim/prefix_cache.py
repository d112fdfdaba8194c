"""What a KV block holds, as a key the prefix cache can look up (vLLM v1's block hashes).

A full block's key names its tokens and, through its parent's key, every token before it, so
two requests hold equal keys exactly where their prompts agree from the first token on. The
simulator rarely has token ids, so a request names its content by spans instead
(``Request.prefix``): (content key, length) pairs, in prompt order, for the part of the
prompt other requests may share (a system prompt, a Mooncake hash id's 512 tokens, an earlier
turn of a conversation). Everything after the shared spans is the request's own.

* A block wholly inside the shared spans gets a chained hash: ``hash((parent, key,
  offset))`` for a block inside one span (its content key, the block's first offset in it),
  ``hash((parent, pieces))`` over the (content key, first offset, end offset) pieces of the
  spans a block overlaps when there are several. Python's hash of a tuple of ints is the
  same in every process (no string hashing is involved).
* A block holding any of the request's own tokens can only ever be hit by the request itself
  (after a preemption by recompute): its key is ``(request id, block index)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from itertools import repeat


def shared_block_hashes(prefix: Sequence[tuple[int, int]], block_size: int) -> list[int]:
    """The chained hashes of the full blocks that lie wholly inside the shared spans
    ``prefix`` ((content key, tokens) pairs in prompt order). Span lists that extend one
    hashed before (a conversation's next turn repeats the last prompt and its answer; a
    trace's requests share leading hash ids; a system prompt) go on from where that one
    ended (``_Chains``), so a token is hashed about once per run; each caller gets its own
    list."""
    return _CHAINS.hashes(tuple(map(tuple, prefix)), block_size)


class _Chains:
    """The hash chains of recent span lists, by span list: the blocks' hashes and where the
    chain stood after the last span (its parent hash, the pieces of its partial block and
    their tokens). At most ``max_items`` hashes and spans kept in all (an entry counts its
    hashes, its key's spans and one more), least recently used dropped first (a few tens of
    bytes each)."""

    def __init__(self, max_items: int = 1 << 19) -> None:
        self.max_items = max_items
        self.kept = 0
        self._states: OrderedDict[tuple, tuple[tuple[int, ...], int,
                                               tuple[tuple[int, int, int], ...], int, int]] = (
            OrderedDict())

    def hashes(self, spans: tuple[tuple[int, int], ...], block_size: int) -> list[int]:
        states = self._states
        # The longest span list hashed before that this one extends, among the one a span
        # shorter (a conversation's next turn extends its last answer, which extends its
        # prompt) and its first one or two spans (a shared system prompt): probing every
        # length would cost a slice and a hash per span.
        n = len(spans)
        state = None
        for i in (*range(n, max(n - _PROBED, 0), -1), *range(min(2, n - _PROBED), 0, -1)):
            state = states.get((block_size, spans[:i]))
            if state is not None:
                states.move_to_end((block_size, spans[:i]))
                break
        else:
            i = 0
        if state is None:
            out: list[int] = []
            parent, pieces, filled = 0, [], 0
        else:
            if i == n:
                return list(state[0])
            out = list(state[0])
            parent, pieces, filled = state[1], list(state[2]), state[3]
        append = out.append
        for key, length in spans[i:]:
            offset = 0
            if filled:  # the block the spans before began
                offset = min(length, block_size - filled)
                pieces.append((key, 0, offset))
                filled += offset
                if filled < block_size:
                    continue
                parent = hash((parent, tuple(pieces)))
                append(parent)
                pieces = []
                filled = 0
            end = offset + (length - offset) // block_size * block_size
            for off in range(offset, end, block_size):  # the blocks inside this span
                parent = hash((parent, key, off))
                append(parent)
            if end < length:  # a block the spans after it go on
                pieces = [(key, end, length)]
                filled = length - end
        cost = len(out) + n + 1
        if cost <= self.max_items:
            replaced = states.pop((block_size, spans), None)  # (the empty list is probed never)
            if replaced is not None:
                self.kept -= replaced[4]
            states[(block_size, spans)] = (tuple(out), parent, tuple(pieces), filled, cost)
            self.kept += cost
            while self.kept > self.max_items:
                self.kept -= states.popitem(last=False)[1][4]
        return out


# Span lists shorter by up to this many spans that ``_Chains.hashes`` looks for.
_PROBED = 2
_CHAINS = _Chains()


def own_block_key(request_id: Hashable, index: int) -> tuple[Hashable, int]:
    """The key of block ``index`` of a request once it holds the request's own tokens."""
    return (request_id, index)


def own_block_keys(request_id: Hashable, start: int, stop: int) -> list[tuple[Hashable, int]]:
    """``own_block_key`` of blocks ``start .. stop - 1``, built in C (a recomputed request
    waiting in a pool that binds looks its blocks up at every step)."""
    return list(zip(repeat(request_id, max(stop - start, 0)), range(start, stop)))

