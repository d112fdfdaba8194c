"""A minimal progress line on stderr for runs that take more than a couple of seconds."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, enabled: bool = True, delay_s: float = 2.0) -> None:
        self.total = total
        self.enabled = enabled
        self.start = time.perf_counter()
        self._next = self.start + delay_s
        self._shown = False

    def update(self, done: int, sim_time: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now < self._next:
            return
        self._next = now + 0.5
        self._shown = True
        rate = done / max(now - self.start, 1e-9)
        if self.total:
            frac = done / self.total
            bar = "#" * int(30 * frac)
            msg = f"\r[{bar:<30}] {done}/{self.total} requests  sim {sim_time:,.0f} s  {rate:,.0f} req/s"
        else:
            msg = f"\r{done} requests  sim {sim_time:,.0f} s  {rate:,.0f} req/s"
        sys.stderr.write(msg)
        sys.stderr.flush()

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
