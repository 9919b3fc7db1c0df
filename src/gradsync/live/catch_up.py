"""Collectives outside a step in a live world: how far each survivor had got, and the one to run again.

Every member runs the same collectives outside a training step (the boundary's verdict, the ranks'
statistics, an evaluation), in the same order. A death met in one can leave the survivors one collective
apart: a ring all-reduce ends on a rank once it has its pieces, while another still waits for the lost
peer's. Run again as they stand, the one still in the first would meet the other's second (a collective
mismatch, or, where the two have one shape, their values mixed without an error). So each survivor says,
in the recovery's agreement, how many it had finished (``finished`` while ``inside`` one; a rank in no
collective takes no part), and one that had finished more than the fewest (by one: it cannot finish the
next without the others) first runs the one it finished again with them, its result set aside: the
result it acted on was the old world's.

A survivor inside a training step had gone past every collective the others are in: that case is the
owner's (LiveDDP sends the others back to training: failures.StepUndone), and settle() leaves it be.
"""

from __future__ import annotations

from typing import Callable

from gradsync.live.failures import rerun


class CatchUp:
    """One rank's collectives outside a step (module docstring); its owner resets it as a step begins and
    settles it in each recovery's agreement."""

    def __init__(self) -> None:
        self.finished = 0
        """Collectives this rank finished since the last step began (since the start, for an owner without
        steps between them)."""
        self.inside = False
        """This rank is in one (run())."""
        self._last: Callable[[], object] | None = None
        self._again: Callable[[], object] | None = None

    def step_began(self) -> None:
        self.finished, self._last = 0, None

    def settle(self, fewest: int | None, in_step: bool) -> bool:
        """After the agreement: ``fewest`` finished by any rank inside a collective (None: none was), and
        whether a survivor was inside a step. True when this rank is a collective ahead: run() runs the
        one it finished again first."""
        ahead = self.inside and not in_step and fewest is not None and self.finished > fewest
        assert not ahead or self.finished - fewest == 1, \
            f"collectives outside a step finished: {fewest}..{self.finished} differ by more than one"
        self._again = self._last if ahead else None
        return ahead

    def run(self, fn: Callable[[], object], tries: int, failure_of: Callable[[Exception], str],
            recover: Callable[[str], object]):
        """``fn()`` as failures.rerun runs it, the collective settle() asked for run again before it."""
        def once():
            if self._again is not None:
                again, self._again = self._again, None
                again()
            return fn()

        self.inside = True
        try:
            value = rerun(once, tries, failure_of, recover)
        finally:
            self.inside, self._again = False, None
        self.finished, self._last = self.finished + 1, fn
        return value
