"""A request to stop the run (a signal arrived), checked where the state is whole.

A signal handler only sets ``requested`` (the signal's number); the replica loop, the arrival
processes and the array core call ``check()`` at the top of each iteration, between steps, so
a run stops with every finished request both counted and written, never half-recorded."""

from __future__ import annotations

from sim.errors import RunInterrupted

requested = 0  # the signal asking the run to stop; 0: none


def check() -> None:
    """Raise ``RunInterrupted`` if a stop was requested."""
    if requested:
        raise RunInterrupted(requested)
