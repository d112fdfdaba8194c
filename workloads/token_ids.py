"""Prompt token ids, for executors that run a real model (``Executor.produces_tokens``).

Ids are a pure function of (seed, what the tokens are, position), computed by a vectorized
splitmix64 hash, so they are reproducible, need no generator state, and leave every other
seeded stream of the workload (arrivals, lengths) unchanged:

* synthetic: a request's own tokens hash (seed, request id, position); with
  ``shared_prefix_len`` > 0 its prompt starts with one of ``num_prefix_groups`` shared
  prefixes (the group hashed from the request id), so equal prefixes give equal ids;
* Mooncake: each hash id names one 512-token block, and a block's ids hash (seed, hash id,
  offset), so requests that share hash ids share those ids exactly;
* Azure (no content in the trace): as a synthetic request without a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512

# Domain tags keep the different kinds of ids independent of each other.
_OWN, _PREFIX, _GROUP, _MOONCAKE = 1, 2, 3, 4
_U = np.uint64


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def hash_ids(seed: int, tag: int, key: int | np.ndarray, positions: np.ndarray,
             vocab_size: int) -> np.ndarray:
    """Token ids in [0, vocab_size) for (seed, tag, key, position), elementwise."""
    with np.errstate(over="ignore"):
        h = _splitmix(np.full(1, seed % 2**64, dtype=np.uint64))
        h = _splitmix(h ^ _U(tag))
        h = _splitmix(h ^ np.asarray(key, dtype=np.uint64))
        h = _splitmix(h ^ np.asarray(positions, dtype=np.uint64))
    return (h % _U(vocab_size)).astype(np.int64)


def prefix_group(seed: int, request_id: int, num_groups: int) -> int:
    """Which of ``num_groups`` shared prefixes a synthetic request's prompt starts with."""
    h = hash_ids(seed, _GROUP, request_id, np.zeros(1), 2**62)
    return int(h[0] % num_groups)


class TokenIdSource:
    """Builds prompt ids for one workload; see the module docstring."""

    def __init__(self, seed: int, vocab_size: int, shared_prefix_len: int = 0,
                 num_prefix_groups: int = 1) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.shared_prefix_len = shared_prefix_len
        self.num_prefix_groups = num_prefix_groups

    def prefix_group(self, request_id: int) -> int:
        return prefix_group(self.seed, request_id, self.num_prefix_groups)

    def synthetic(self, request_id: int, prompt_len: int) -> list[int]:
        shared = min(self.shared_prefix_len, prompt_len)
        own = hash_ids(self.seed, _OWN, request_id, np.arange(shared, prompt_len),
                       self.vocab_size)
        if not shared:
            return own.tolist()
        prefix = hash_ids(self.seed, _PREFIX, self.prefix_group(request_id), np.arange(shared),
                          self.vocab_size)
        return prefix.tolist() + own.tolist()

    def mooncake(self, block_hash_ids: Sequence[int], prompt_len: int) -> list[int]:
        """``block_hash_ids`` must cover the prompt (checked by the trace reader)."""
        n_blocks = -(-prompt_len // MOONCAKE_BLOCK_TOKENS)
        keys = np.repeat(np.asarray(block_hash_ids[:n_blocks], dtype=np.uint64),
                         MOONCAKE_BLOCK_TOKENS)[:prompt_len]
        offsets = np.arange(prompt_len) % MOONCAKE_BLOCK_TOKENS
        with np.errstate(over="ignore"):
            mixed = _splitmix(keys) ^ offsets.astype(np.uint64)  # one key per (block, offset)
        return hash_ids(self.seed, _MOONCAKE, mixed, np.zeros(prompt_len), self.vocab_size
                        ).tolist()
