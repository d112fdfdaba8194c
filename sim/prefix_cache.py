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
    ``prefix`` ((content key, tokens) pairs in prompt order). Requests that share a prefix
    share its spans, so the chain is computed once per spans and block size (a prompt of
    one-token blocks has hundreds); each caller gets its own list."""
    return list(_block_hashes(tuple(map(tuple, prefix)), block_size))


# (A few hundred prefixes: a workload's shared system prompts; a conversation's growing
# prefix is new at every turn and gains nothing from a larger memo.)
@lru_cache(maxsize=256)
def _block_hashes(prefix: tuple[tuple[int, int], ...], block_size: int) -> tuple[int, ...]:
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
    return tuple(out)


def own_block_key(request_id: Hashable, index: int) -> tuple[Hashable, int]:
    """The key of block ``index`` of a request once it holds the request's own tokens."""
    return (request_id, index)

