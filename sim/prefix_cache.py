"""What a KV block holds, as a key the prefix cache can look up (vLLM v1's block hashes).

A full block's key names its tokens and, through its parent's key, every token before it, so
two requests hold equal keys exactly where their prompts agree from the first token on. The
simulator rarely has token ids, so a request names its content by spans instead
(``Request.prefix``): (content key, length) pairs, in prompt order, for the part of the
prompt other requests may share (a system prompt, a Mooncake hash id's 512 tokens, an earlier
turn of a conversation). Everything after the shared spans is the request's own.

* A block wholly inside the shared spans gets a chained hash: ``hash((parent, pieces))``
  over the (content key, first offset, end offset) pieces of the spans it overlaps. Python's
  hash of a tuple of ints is the same in every process (no string hashing is involved).
* A block holding any of the request's own tokens can only ever be hit by the request itself
  (after a preemption by recompute): its key is ``(request id, block index)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import lru_cache


def shared_block_hashes(prefix: Sequence[tuple[int, int]], block_size: int) -> list[int]:
    """The chained hashes of the full blocks that lie wholly inside the shared spans
    ``prefix`` ((content key, tokens) pairs in prompt order). A prefix of one or two spans
    (a shared system prompt, which many requests repeat) is hashed once per block size (a
    prompt of one-token blocks has hundreds of blocks); each caller gets its own list."""
    spans = tuple(map(tuple, prefix))
    if (len(spans) <= _MEMO_SPANS
            and sum(n for _, n in spans) // block_size <= _MEMO_BLOCKS):
        return list(_memo_hashes(spans, block_size))
    return _block_hashes(spans, block_size)


# What the memo keeps: up to 256 chains of up to 4,096 blocks (a few tens of MB at most).
# Longer span lists (a conversation's turns, a trace's hash ids) are new at nearly every
# request and are hashed directly.
_MEMO_SPANS = 2
_MEMO_BLOCKS = 4096


@lru_cache(maxsize=256)
def _memo_hashes(prefix: tuple[tuple[int, int], ...], block_size: int) -> tuple[int, ...]:
    return tuple(_block_hashes(prefix, block_size))


def _block_hashes(prefix: Sequence[tuple[int, int]], block_size: int) -> list[int]:
    out: list[int] = []
    parent = 0
    pieces: list[tuple[int, int, int]] = []
    filled = 0  # tokens of the current block so far
    for key, length in prefix:
        offset = 0
        while offset < length:
            take = min(length - offset, block_size - filled)
            pieces.append((key, offset, offset + take))
            offset += take
            filled += take
            if filled == block_size:
                parent = hash((parent, tuple(pieces)))
                out.append(parent)
                pieces = []
                filled = 0
    return out


def own_block_key(request_id: Hashable, index: int) -> tuple[Hashable, int]:
    """The key of block ``index`` of a request once it holds the request's own tokens."""
    return (request_id, index)

