"""A failure that comes back at a steady interval, watched at its next turn.

A failed step is re-checked by a full watch of the step after it. A batch that fails once each
pass over the data (the smaller last batch of an epoch, where a statistic over a batch of one is
nan; a sample that comes back each epoch) passes that re-check: the op that made the nan never
runs under a watch, and the run only says that the batch held nan. Two failures of one cause
that no watch named, ``k`` steps apart (``k`` of 2 or more), give the step ``k`` after the second
its turn: it is watched fully from its start, and if it fails too the watch names the op and
line that made the nan (the batch's own lines included). One fully watched step per interval,
until a watch names the origin or the interval breaks.
"""

from __future__ import annotations

__all__ = ["FailureTurns"]


class FailureTurns:
    """The failures no full watch named, and the step their interval says fails next.

    :meth:`failed` notes each such failure (its step and cause); :meth:`due` says, after a
    step, whether the next one is the turn, and whose (a turn is given once)."""

    def __init__(self) -> None:
        self._newest: tuple[int, str] | None = None  # (step, cause) of the newest unnamed failure
        self.turn: int | None = None  # the step watched at the failures' interval
        self.every = 0  # that interval, in steps
        self.before = 0  # the failed step before the newest one

    def failed(self, step: int, cause: str) -> None:
        """Optimizer step ``step`` failed with ``cause`` and no full watch named its origin."""
        newest, self._newest = self._newest, (step, cause)
        self.turn = None
        if newest is None:
            return
        before, before_cause = newest
        if before_cause == cause and step - before >= 2:  # a gap of 1 is the re-check's own step
            self.before, self.every, self.turn = before, step - before, step + (step - before)

    def named(self) -> None:
        """A full watch named the origin: no turn is needed for it."""
        self._newest = self.turn = None

    def due(self, step: int) -> int | None:
        """The newest failure's step when the step after ``step`` is its turn, else ``None``;
        a turn is given once."""
        if self.turn is None or step + 1 < self.turn:
            return None
        due, self.turn = step + 1 == self.turn, None
        return self.before + self.every if due else None
