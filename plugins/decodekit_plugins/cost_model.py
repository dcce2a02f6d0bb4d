"""What a speculating step really costs on this machine now: the cached step-cost curve calibrated by what steps
measure, and the proposers' own host time, learned online.

- `Calibration`: a target `StepCost` (measured once per machine and cached, or the fixed default) times a
  correction per row bucket (1, 2, 3-4, 5-8, ... rows): a moving estimate (`LowEstimate`: in log space, falling fast
  and rising slowly, since disturbed timings are only ever too high) of each decode-only step's measured seconds
  (`StepTiming`: scheduling, the forward and the processors) over what the curve predicted for its rows. A machine
  busier than when the curve was measured, a model whose multi-row steps cost more than the measured shape says (a
  quantized GGUF's kernels), the processors' share of a step: each bucket is charged what it measures. A bucket not
  measured yet takes its nearest measured neighbours' correction (interpolated in log rows), 1 when none is. The
  calibrated curve is in seconds, whatever the curve's own unit.
- `ProposerCost`: per proposer, what a call costs the host: seconds per sequence asked (lookups: n-gram, suffix
  tries, a draft head), or, for a proposer that runs a draft model (`Proposer.draft_cost`), the measured seconds
  over the draft curve's prediction for the forwards it ran (its processors, sampling and Python included); and how
  often it drafts something when asked, so a chain's later links are charged for the sequences that reach them.
- `ChainCharge`: what the chooser charges a chain of proposers for one step (`ChainCharge.of`).

Timings differ from run to run, so none of this may decide anything a seeded sampled sequence's output depends on:
the adaptive chooser uses it only for the sequences whose output is the same whatever k is (greedy: lossless by
construction) or is not reproducible anyway (unseeded sampling).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from decodekit.api.step_cost import StepCost

SMOOTHING = 0.25
"""Weight of a new observation in the hit-rate averages: about the last 4-8 asks count."""
RISE, FALL = 0.1, 0.4
"""Weights of a timing above and below the current estimate. A timing disturbed by other work (a neighbour's burst,
a thread descheduled mid-step) is too high, never too low, as the cached curve's fastest-of-5 assumes: so estimates
fall fast and rise slowly, settling near a low quantile (the 20% expectile) of what steps take, while a lasting
change still wins within ten steps or so."""
MAX_JUMP = 3.0
"""One timing moves an estimate by at most this factor."""
NEW_BUCKET_JUMP = 1.5
"""A row bucket's first timing starts at most this factor above its measured neighbours' correction."""
STALE_AFTER = 256
"""A bucket last measured this many measured steps ago is measured again (`Calibration.explore`)."""


def bucket(rows: float) -> int:
    """The calibration bucket of a step of `rows` rows: 0 for 1 row, then ceil(log2(rows)) (2, 3-4, 5-8, ...)."""
    return max(0, math.ceil(math.log2(max(rows, 1.0)) - 1e-9))


def buckets(rows: np.ndarray) -> np.ndarray:
    """`bucket` of each of `rows`."""
    return np.maximum(np.ceil(np.log2(np.maximum(rows, 1.0)) - 1e-9), 0).astype(np.int64)


def curve_at(curve: StepCost, rows: np.ndarray) -> np.ndarray:
    """`curve(r)` for each of `rows` at once (the same interpolation, for the chooser's hundreds of row counts)."""
    xs = np.asarray(curve.rows, dtype=np.float64)
    ys = np.minimum.accumulate(np.asarray(curve.seconds, dtype=np.float64)[::-1])[::-1]  # never falling
    if len(xs) == 1:
        return np.where(rows <= xs[0], ys[0], ys[0] * rows / xs[0])
    i = np.clip(np.searchsorted(xs, rows, side="left"), 1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return np.where(rows <= xs[0], ys[0], y0 + (y1 - y0) * (rows - x0) / (x1 - x0))


def cost_at(cost: Callable[[float], float], rows: np.ndarray) -> np.ndarray:
    """`cost(r)` for each of `rows`: at once for a `StepCost`, a `Calibration` or a `Scaled` curve, else one by one."""
    if isinstance(cost, StepCost):
        return curve_at(cost, rows)
    many = getattr(cost, "many", None)
    if many is not None:
        return np.asarray(many(rows), dtype=np.float64)
    return np.array([cost(float(r)) for r in rows], dtype=np.float64)


@dataclass(frozen=True)
class Scaled:
    """A curve times a factor (a draft model's measured curve times its calls' measured over predicted): the factor
    of `rows`' bucket where `factors` has one, else `factor` (over every call)."""

    curve: StepCost
    factor: float = 1.0
    factors: dict[int, float] | None = None

    def factor_at(self, rows: float) -> float:
        """The factor for a forward of `rows` rows."""
        if self.factors:
            return self.factors.get(bucket(rows), self.factor)
        return self.factor

    def __call__(self, rows: float) -> float:
        return self.curve(rows) * self.factor_at(rows)

    def many(self, rows: np.ndarray) -> np.ndarray:
        """The cost of each of `rows`."""
        if not self.factors:
            return curve_at(self.curve, rows) * self.factor
        table = np.array([self.factors.get(b, self.factor) for b in range(int(buckets(rows).max(initial=0)) + 1)])
        return curve_at(self.curve, rows) * table[buckets(rows)]


@dataclass
class LowEstimate:
    """A timing (or a ratio of timings), tracked in log space from its first value: it falls fast and rises slowly
    (`RISE`, `FALL`), each step by at most `MAX_JUMP`."""

    log_value: float | None = None
    count: int = 0

    def add(self, value: float) -> None:
        """One more timing."""
        logged = math.log(max(value, 1e-12))
        if self.log_value is None:
            self.log_value = logged
        else:
            jump = math.log(MAX_JUMP)
            delta = min(max(logged - self.log_value, -jump), jump)
            self.log_value += (RISE if delta > 0 else FALL) * delta
        self.count += 1

    @property
    def value(self) -> float | None:
        """The estimate (None before the first timing)."""
        return None if self.log_value is None else math.exp(self.log_value)


class Calibration:
    """A target's step cost on this machine now: `curve(rows)` times the measured correction of `rows`' bucket.

    Example:
        >>> calibrated = Calibration(StepCost((1, 64), (1.0, 2.0)))
        >>> calibrated.record(8, 0.05)  # an 8-row step took 50 ms; the curve says 1.11 units
        >>> round(calibrated(8), 3), calibrated.observed(8), calibrated.observed(32)
        (0.05, True, False)
    """

    def __init__(self, curve: StepCost, explore_tries: int = 2) -> None:
        self.curve = curve
        self.corrections: dict[int, LowEstimate] = {}
        self.explore_tries = explore_tries
        self._explored: dict[int, int] = {}
        self.records = 0  # decode-only steps measured so far
        self._last: dict[int, int] = {}  # per bucket, `records` when it was last measured
        self._by_bucket: dict[int, float] = {}  # corrections as `correction` gives them, until the next record

    def record(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds`."""
        if rows < 1 or seconds <= 0:
            return
        ratio = seconds / self.curve(rows)
        estimate = self.corrections.get(bucket(rows))
        if estimate is None:
            if self.corrections:  # a new bucket starts near its neighbours: one disturbed step is not the truth
                nearby = self.correction(rows)
                ratio = min(max(ratio, nearby / MAX_JUMP), nearby * NEW_BUCKET_JUMP)
            estimate = self.corrections[bucket(rows)] = LowEstimate()
        estimate.add(ratio)
        self._by_bucket.clear()
        self.records += 1
        self._last[bucket(rows)] = self.records

    def explore(self, rows: float) -> bool:
        """Whether a step of `rows` rows should run plain now to measure it: its bucket has fewer than two
        timings and fewer than `explore_tries` steps tried (a context that reports no timings stops asking), or
        its last timing is `STALE_AFTER` measured steps old (a speculating batch never times its plain step)."""
        at = bucket(rows)
        estimate = self.corrections.get(at)
        if estimate is not None and self.records - self._last[at] >= STALE_AFTER:
            return True
        if (estimate is not None and estimate.count >= 2) or self._explored.get(at, 0) >= self.explore_tries:
            return False
        self._explored[at] = self._explored.get(at, 0) + 1
        return True

    def observed(self, rows: float) -> bool:
        """Whether a step of `rows` rows' bucket was measured."""
        return bucket(rows) in self.corrections

    def correction(self, rows: float) -> float:
        """Measured over predicted for `rows` rows: its bucket's, else interpolated between the nearest measured
        buckets (in log rows), else the nearest one's, else 1."""
        at = bucket(rows)
        cached = self._by_bucket.get(at)
        if cached is None:  # the chooser asks for many row counts per step: each bucket is worked out once
            cached = self._by_bucket[at] = self._correction(at)
        return cached

    def _correction(self, at: int) -> float:
        known = sorted((b, ema.log_value) for b, ema in self.corrections.items() if ema.log_value is not None)
        if not known:
            return 1.0
        below = [(b, v) for b, v in known if b <= at]
        above = [(b, v) for b, v in known if b >= at]
        if below and above:
            (b0, v0), (b1, v1) = below[-1], above[0]
            return math.exp(v0 if b1 == b0 else v0 + (v1 - v0) * (at - b0) / (b1 - b0))
        return math.exp((below[-1] if below else above[0])[1])

    def __call__(self, rows: float) -> float:
        """The seconds of a step of `rows` rows (in the curve's unit while nothing is measured)."""
        return self.curve(rows) * self.correction(rows)

    def many(self, rows: np.ndarray) -> np.ndarray:
        """The seconds of a step of each of `rows` rows."""
        at = buckets(rows)
        table = np.array([self.correction(2.0**b) for b in range(int(at.max(initial=0)) + 1)])
        return curve_at(self.curve, rows) * table[at]


@dataclass
class ProposerCost:
    """One proposer's host cost per call, learned from its calls (`record`)."""

    per_sequence: LowEstimate = field(default_factory=LowEstimate)
    """Seconds per sequence asked (a proposer without a draft model)."""
    model_factor: LowEstimate = field(default_factory=LowEstimate)
    """Measured seconds over the draft curve's prediction (a proposer with a draft model)."""
    model_factors: dict[int, LowEstimate] = field(default_factory=dict)
    """The same by the row bucket of a call's sequences (its first forward's rows), each bucket's first call left
    out (a new shape's first forward builds its kernels' state) and used from its second kept one. A forward's fixed
    cost (its Python, its processors' calls) weighs more at 1 row than at 8: one factor over all calls charged a batch
    of 8 what a chain's lone sequences had cost (1.5x the draft curve), and speculation at batch 8 stayed off in some
    runs. Kept by bucket (float32 target, 2-core Intel Xeon, `strategies.py spec --batches 8`): chat b8 int8 draft
    0.99x -> 1.18x, tree 1.00x -> 1.21x; the chain at chat b8 0.86x (0.90-1.00x in earlier runs): its draft link's
    few sequences now draft at their own, lower cost."""
    hit: float = 1.0
    """How often a sequence asked gets a draft (moving average; a new proposer is assumed to draft always)."""
    calls: int = 0

    def record(self, seconds: float, asked: int, drafted: int, predicted: float | None) -> None:
        """A call that took `seconds` for `asked` sequences, `drafted` of which got a draft; `predicted`: what the
        draft curve said its forwards cost (None: no draft model). The first call's time is not kept: it opens the
        proposer's model or builds its tables."""
        if asked <= 0:
            return
        self.calls += 1
        self.hit += SMOOTHING * (drafted / asked - self.hit)
        if self.calls == 1:
            return
        if predicted is None:
            self.per_sequence.add(seconds / asked)
        elif predicted > 0:
            self.model_factor.add(seconds / predicted)
            by_rows = self.model_factors.get(bucket(asked))
            if by_rows is None:
                self.model_factors[bucket(asked)] = LowEstimate()  # this bucket's first call: not kept
            else:
                by_rows.add(seconds / predicted)


VETO_BELOW = 0.97
"""A batch size whose speculating steps measure (moving average) under this share of its plain steps' measured rate
drafts nothing for a while (`RealizedGain`)."""
REALIZED_WEIGHT = 0.25  # weight of a step in its batch size's moving averages (about the last 4-8 count)
REALIZED_MIN_STEPS = 6  # speculating steps measured before their average may veto
VETO_STEPS = 32
MAX_VETO_STEPS = 512


@dataclass
class RealizedGain:
    """What steps at one batch size (a row bucket of running sequences) of one chain really gave, in tokens per second
    of the whole step (proposing, verifying, selecting): moving averages in log space of the steps in which the
    chooser drafted and of those in which nobody drafted (plain decoding's, exploration and native runs included);
    and the veto that earns.

    The chooser's predictions can be wrong in ways no part of the cost model sees alone (acceptance that falls as a
    draft grows, a proposer's or the chooser's own Python, a machine whose multi-row steps wander), and where drafting
    barely pays they decide run to run (float32 target, int8 self-draft, chat at batch 8, 2-core Intel Xeon: 0.82-1.10x
    plain the same day). So the steps that drafted are measured against the plain steps measured alike (not against the
    calibrated curve, whose unmeasured buckets can be far off): where their average falls under `VETO_BELOW` of plain's
    over at least `REALIZED_MIN_STEPS` steps, that batch size drafts nothing (no probes either) for `VETO_STEPS` steps,
    twice as long after each further veto (up to `MAX_VETO_STEPS`), back to `VETO_STEPS` once drafting measures at
    least as fast as plain decoding. Without a plain measurement nothing is vetoed. What is measured belongs to the
    sequences it was measured on: a sequence joining the batch (new text, perhaps a copying request after a chatting
    one) starts the speculating average afresh and ends a veto."""

    log_rate: float | None = None
    plain_log_rate: float | None = None
    steps: int = 0
    veto_left: int = 0
    veto_length: int = VETO_STEPS
    vetoes: int = 0
    members: frozenset[int] = frozenset()

    def record(self, tokens_per_second: float) -> None:
        """One step in which the chooser drafted gave `tokens_per_second`."""
        self.log_rate = _averaged(self.log_rate, tokens_per_second)
        self.steps += 1
        if self.steps < REALIZED_MIN_STEPS or self.plain_log_rate is None:
            return
        if self.log_rate - self.plain_log_rate < math.log(VETO_BELOW):
            self.veto_left, self.vetoes = self.veto_length, self.vetoes + 1
            self.veto_length = min(2 * self.veto_length, MAX_VETO_STEPS)
            self.log_rate, self.steps = None, 0  # measured afresh once the veto ends
        elif self.log_rate >= self.plain_log_rate:
            self.veto_length = VETO_STEPS

    def record_plain(self, tokens_per_second: float) -> None:
        """One step in which nobody drafted gave `tokens_per_second`."""
        self.plain_log_rate = _averaged(self.plain_log_rate, tokens_per_second)

    @property
    def ratio(self) -> float | None:
        """The speculating steps' average rate over the plain steps' (None until both are measured)."""
        if self.log_rate is None or self.plain_log_rate is None:
            return None
        return math.exp(self.log_rate - self.plain_log_rate)

    def vetoed(self, members: frozenset[int] = frozenset()) -> bool:
        """Whether drafting at this batch size is vetoed this step for the batch's sequences `members` (ids; each
        answer uses up one step of a veto)."""
        if not members <= self.members:  # someone new: what was measured is not about them
            self.log_rate, self.steps, self.veto_left = None, 0, 0
        self.members = members
        if self.veto_left <= 0:
            return False
        self.veto_left -= 1
        return True


def _averaged(log_average: float | None, value: float) -> float:
    """`log_average` moved `REALIZED_WEIGHT` of the way to log(`value`) (log(`value`) where None)."""
    logged = math.log(max(value, 1e-12))
    return logged if log_average is None else log_average + REALIZED_WEIGHT * (logged - log_average)


def draft_forwards(lengths: Sequence[int]) -> list[int]:
    """The rows of each batched draft forward for these draft lengths: forward j drafts for the sequences drafting
    at least j tokens."""
    return [sum(1 for k in lengths if k > j) for j in range(max(lengths, default=0))]


def expected_cost(curve: Callable[[float], float], rows: float) -> float:
    """A forward's expected cost when it has `rows` rows on average: below one row it runs with that chance."""
    if rows <= 0:
        return 0.0
    return curve(rows) if rows >= 1 else rows * curve(1.0)


def expected_costs(curve: Callable[[float], float], rows: np.ndarray) -> np.ndarray:
    """`expected_cost` of each of `rows`."""
    full = cost_at(curve, np.maximum(rows, 1.0))
    return np.where(rows <= 0, 0.0, np.where(rows >= 1, full, rows * full))


@dataclass(frozen=True)
class ChainCharge:
    """What proposing costs the host for one step, for a chain of proposers asked in turn (each for the sequences
    the links before it left without a draft).

    Attributes:
        per_sequence: seconds per sequence that drafts, of the chain's lookups (each link's seconds per sequence
            asked times the share of sequences that reach it).
        draft: the seconds of one draft-model forward by its rows (the measured curve times its correction), or
            None where no link runs a model.
        draft_reach: the share of drafting sequences that reach the model link.
    """

    per_sequence: float = 0.0
    draft: Callable[[float], float] | None = None
    draft_reach: float = 1.0

    @classmethod
    def of(cls, links: Sequence[tuple[ProposerCost, StepCost | None]]) -> ChainCharge:
        """The charge of a chain: per link its learned cost and its draft-model curve (None: a lookup)."""
        reach, per_sequence = 1.0, 0.0
        draft: Callable[[float], float] | None = None
        draft_reach = 1.0
        for cost, curve in links:
            if curve is None:
                per_sequence += reach * (cost.per_sequence.value or 0.0)
            elif draft is None:  # a second model link is rare; the first one's forwards are charged
                factors = {b: e.value for b, e in cost.model_factors.items() if e.value is not None and e.count >= 2}
                draft, draft_reach = Scaled(curve, cost.model_factor.value or 1.0, factors), reach
            reach *= max(0.0, 1.0 - cost.hit)
        return cls(per_sequence, draft, draft_reach)
