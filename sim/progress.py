"""Progress bars on stderr (tqdm) for runs and experiments that take more than a couple of
seconds; ``progress=false`` turns them off. Bars are drawn on stderr only: what a command
logs (its summaries, run.log) never holds them."""

from __future__ import annotations

import sys

from tqdm import tqdm

#: Seconds before a bar appears: a run that ends sooner shows none.
DELAY_S = 2.0


class Progress:
    """Finished requests of one simulation, with the simulated time reached."""

    def __init__(self, total: int | None, enabled: bool = True, delay_s: float = DELAY_S) -> None:
        self._bar = tqdm(total=total, disable=not enabled, delay=delay_s, mininterval=0.5,
                         unit="req", unit_scale=True, file=sys.stderr, dynamic_ncols=True,
                         desc="requests", leave=False)
        self._done = 0

    def update(self, done: int, sim_time: float) -> None:
        """``done`` requests finished so far, at ``sim_time`` simulated seconds."""
        bar = self._bar
        if bar.disable:
            return
        bar.update(done - self._done)
        self._done = done
        bar.set_postfix_str(f"sim {sim_time:,.0f} s", refresh=False)

    def close(self) -> None:
        self._bar.close()


def job_bar(total: int, enabled: bool = True, desc: str = "jobs",
            delay_s: float = DELAY_S) -> tqdm:
    """A bar over an experiment's jobs (``update(1)`` per finished job)."""
    return tqdm(total=total, disable=not enabled, delay=delay_s, unit="job", file=sys.stderr,
                dynamic_ncols=True, desc=desc, leave=False)
