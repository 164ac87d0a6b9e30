"""A time limit on one invocation of a long run, not on the run.

A run of hours (a 12-layer calibration, an accuracy table) keeps its state as it goes; an
invocation given ``--max-minutes M`` stops at its next safe point once M minutes are spent (after
a calibration step, between two cells of a table), keeps what it did and raises
:class:`OutOfTime`.  The command then exits with ``EXIT_UNFINISHED`` and the same command run
again continues.  What the run computes never depends on the limit: it is the recipe's whatever
the limit, the machine or the number of invocations it took.
"""

from __future__ import annotations

import time

# Exit status of a command that stopped at its time limit with work left (EX_TEMPFAIL: run it again).
EXIT_UNFINISHED = 75


class OutOfTime(Exception):
    """An invocation's time limit is spent; what it did is kept and the same command continues."""


def _now() -> float:
    """The clock a limit reads (monotonic seconds)."""
    return time.monotonic()


class TimeLimit:
    """``minutes`` from now (None: no limit)."""

    def __init__(self, minutes: float | None):
        if minutes is not None and not minutes > 0:
            raise ValueError(f"a time limit must be positive, got {minutes}")
        self.minutes = minutes
        self.started = _now()

    def elapsed(self) -> float:
        """Seconds since the limit was set."""
        return _now() - self.started

    def spent(self) -> bool:
        return self.minutes is not None and self.elapsed() >= 60 * self.minutes
