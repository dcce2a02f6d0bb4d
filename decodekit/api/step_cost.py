"""`StepCost`: what one forward of a model costs by the rows (tokens) it computes, as measured on this machine.

Speculation pays when the rows a draft adds cost less than the tokens it saves: on a memory-bound step (a CPU or a
GPU at small batch, where reading the weights dominates) a few more rows are nearly free, on a compute-bound one
(a big batch) each row costs its share. The engine measures the curve of its model once per machine and caches it
(`ComponentInfo.step_cost`); the speculative strategy's adaptive draft length reads it, and calibrates it online
against what each step really took (`StepTiming`, `StepContext.step_timing`).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """Seconds (or any one unit) of a forward of `rows` rows: measured points, linear between them and past the
    last (the slope of the last two), the first point's cost below it.

    Example:
        >>> cost = StepCost((1, 8, 64), (0.010, 0.011, 0.040))
        >>> round(cost(4), 5), round(cost(128), 5)
        (0.01043, 0.07314)
    """

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds):
            raise ValueError(f"a step cost needs as many `seconds` as `rows` (at least one), got {self.rows!r} "
                             f"and {self.seconds!r}")
        if any(b <= a for a, b in itertools.pairwise(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"`rows` must be increasing and >= 1, got {self.rows!r}")
        if any(s <= 0 for s in self.seconds):
            raise ValueError(f"`seconds` must be > 0, got {self.seconds!r}")

    def __call__(self, rows: int | float) -> float:
        """The cost of a forward of `rows` rows (never less than of fewer rows)."""
        xs, ys = self.rows, self._monotone
        if rows <= xs[0]:
            return ys[0]
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    @property
    def _monotone(self) -> tuple[float, ...]:
        """`seconds` with each point at most every later one: a timing disturbed by other work is too high, never
        too low, so a point above a later one is lowered to it."""
        return tuple(itertools.accumulate(self.seconds[::-1], min))[::-1]

    def scaled(self, factor: float) -> StepCost:
        """The same curve times `factor` (a draft model's cost as a share of the target's)."""
        return StepCost(self.rows, tuple(s * factor for s in self.seconds))

    @classmethod
    def default(cls) -> StepCost:
        """A fixed curve in units of a one-row step, for tests and wherever measuring is off: a step's fixed cost
        (reading the weights) plus a sixteenth of it per row, as a memory-bound device at small batch has."""
        rows = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        return cls(rows, tuple(1.0 + r / 16 for r in rows))


@dataclass(frozen=True)
class StepTiming:
    """What one engine step's verification took: the wall time from scheduling through the forward and the process
    stage (the processors over every scored row), and the rows (tokens) its forward computed. Strategies read it in
    `select` (`StepContext.step_timing`) to calibrate a `StepCost` against this machine as it runs now.

    Attributes:
        rows: tokens the forward computed (every scheduled sequence's new tokens, drafts and probes included).
        seconds: wall seconds of scheduling, the forward and the process stage (proposing is not in it).
        decode_only: every computed token was a scored position (decodes and verifications, no prompt chunk): only
            such a step is shaped like the ones a `StepCost` measures.
    """

    rows: int
    seconds: float
    decode_only: bool
