"""Greedy or temperature/top-p sampling with seeded, scheduling-independent randomness.

Each sampled token draws from its own generator seeded by (run seed, request id, output
index), so a request's tokens do not depend on which other requests share its steps, on
preemption, or on the order of rows in a batch.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over the values: a well-spread 63-bit seed from small integers."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return x >> 1


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed

    def __call__(self, logits: torch.Tensor, request_ids: list[int],
                 output_index: list[int]) -> list[int]:
        """logits [S, V] fp32; one token id per row."""
        if logits.shape[0] == 0:
            return []
        if self.temperature == 0:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits / self.temperature, dim=-1)  # [S, V]
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            drop = sorted_p.cumsum(dim=-1) - sorted_p >= self.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs.cpu()
        out = []
        for row, rid, idx in zip(probs, request_ids, output_index):
            g = torch.Generator().manual_seed(_mix(self.seed, rid, idx))
            out.append(int(torch.multinomial(row, 1, generator=g)))
        return out
