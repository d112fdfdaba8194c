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

    @property
    def done(self) -> int:
        return self._done

    def update(self, done: int, sim_time: float, label: str = "") -> None:
        """``done`` requests finished so far, at ``sim_time`` simulated seconds (shown after
        ``label``, where a run says which part of it is running)."""
        bar = self._bar
        if bar.disable:
            return
        bar.set_postfix_str(f"{label}{', ' if label else ''}sim {sim_time:,.0f} s",
                            refresh=False)
        bar.update(done - self._done)  # (redraws at the bar's pace, even with no new count)
        self._done = done

    def close(self) -> None:
        self._bar.close()


class PassProgress:
    """The progress line as one pass of a run that goes over its requests twice sees it (a
    disaggregated deployment on the array core: every prompt first, then every decode):
    ``update`` as Progress's, with the count offset by ``base`` (those an earlier pass
    finished), or left where it is with ``counts=False`` (a pass whose requests are not
    finished yet), and the simulated time shown after ``label``."""

    def __init__(self, progress: Progress, label: str = "", base: int = 0,
                 counts: bool = True) -> None:
        self.progress = progress
        self.label = label
        self.base = base
        self.counts = counts

    def update(self, done: int, sim_time: float) -> None:
        p = self.progress
        p.update(self.base + done if self.counts else p.done, sim_time, self.label)


def job_bar(total: int, enabled: bool = True, desc: str = "jobs",
            delay_s: float = DELAY_S) -> tqdm:
    """A bar over an experiment's jobs (``update(1)`` per finished job)."""
    return tqdm(total=total, disable=not enabled, delay=delay_s, unit="job", file=sys.stderr,
                dynamic_ncols=True, desc=desc, leave=False)
