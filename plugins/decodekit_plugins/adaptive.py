"""Adaptive speculation: each step, the draft length of every speculating sequence that maximizes the batch's
expected tokens per second, from each sequence's measured acceptance and the machine's cost of a step by rows.

A sequence whose draft tokens are each accepted with probability `a` (an exponential moving average of what the
target accepted of its drafts) gains `E(k) = (1 - a^(k+1)) / (1 - a)` tokens from a step that verifies `k` of them:
its `j`-th draft token adds `a^j`. The step costs `target(R)` seconds for the batch's `R` rows (`StepCost`, the
target's forward measured by rows on this machine), plus the draft model's forwards where a proposer runs one (its
`j`-th forward over the sequences drafting at least `j` tokens). Since every sequence's gains fall with `j`, the best
allocation of `N` extra rows takes the `N` largest gains of the batch, so the chooser sorts them once and keeps the
`N` with the most tokens per second, `N = 0` (nobody drafts) included: on a compute-bound step (a big batch, where
each row costs its share) speculation switches itself off, on a memory-bound one (rows nearly free) it drafts as
far as acceptance pays. A sequence kept from drafting for `PROBE_INTERVAL` steps drafts `PROBE_TOKENS` tokens once,
so its acceptance is measured again and speculation can turn back on.

A seeded sampled sequence chooses as if it ran alone: which draft tokens it verifies changes which random numbers it
draws, so its output must not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from decodekit.api.sequence import Sequence
from decodekit.api.stash import StashKey
from decodekit.api.step_cost import StepCost

PRIOR_ACCEPTANCE = 0.6
"""A new sequence's acceptance rate before it has verified anything: high enough that it drafts, so it is measured."""
PRIOR_WEIGHT = 2.0  # the prior counts as this many draft tokens
DECAY = 0.8  # per verified draft: the acceptance follows the text as it changes (a copied span, then free text)
MAX_RATE = 0.99  # E(k) needs a < 1; a sequence that accepted everything still risks the next token
PROBE_INTERVAL = 16
PROBE_TOKENS = 2


@dataclass
class Acceptance:
    """A sequence's acceptance: discounted accepted draft tokens and rejections, and steps kept from drafting."""

    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        """The estimated chance that a draft token is accepted (given the ones before it were)."""
        return min(self.accepted / (self.accepted + self.rejected), MAX_RATE)

    def record(self, proposed: int, accepted: int) -> None:
        """A verified draft of `proposed` tokens whose first `accepted` were accepted (the rest rejected at once:
        one rejection, since verification stops at the first)."""
        if proposed:
            self.accepted = DECAY * self.accepted + accepted
            self.rejected = DECAY * self.rejected + (accepted < proposed)


ACCEPTANCE = StashKey[Acceptance]()


def expected_tokens(rate: float, k: int) -> float:
    """The expected tokens a step gives a sequence verifying `k` draft tokens each accepted with chance `rate`."""
    return sum(rate**j for j in range(k + 1))


def choose_draft_lengths(rates: Seq[float], limits: Seq[int], other_rows: int, target: StepCost,
                         draft: StepCost | None = None) -> list[int]:
    """The draft length of each sequence that maximizes the step's expected tokens per second.

    Args:
        rates: each sequence's acceptance rate.
        limits: the most draft tokens each may verify.
        other_rows: rows of the step that do not speculate (other strategies' sequences, one token each).
        target: the target's forward cost by rows.
        draft: the draft model's forward cost by rows, where a proposer runs one (None: drafting is free).
    """
    # each sequence's j-th draft token gains rate^j; generated in j order and sorted stably, so a sequence's gains
    # are always taken first to last
    gains = sorted(((rate**j, i) for i, (rate, limit) in enumerate(zip(rates, limits)) for j in range(1, limit + 1)),
                   key=lambda gain: -gain[0])
    base = len(rates) + other_rows
    tokens = float(base)  # every row without a draft gives one token, the others' decode rows included
    best, best_n = tokens / target(base), 0
    lengths = [0] * len(rates)
    drafting = [0] * (max(limits, default=0) + 1)  # how many sequences draft at least j tokens
    draft_seconds = 0.0
    for n, (gain, i) in enumerate(gains, 1):
        lengths[i] += 1
        if draft is not None:  # the j-th draft forward has one more row (or starts)
            j = lengths[i]
            draft_seconds += draft(drafting[j] + 1) - (draft(drafting[j]) if drafting[j] else 0.0)
            drafting[j] += 1
        tokens += gain
        value = tokens / (target(base + n) + draft_seconds)
        if value > best * (1 + 1e-9):
            best, best_n = value, n
    chosen = [0] * len(rates)
    for _, i in gains[:best_n]:
        chosen[i] += 1
    return chosen


def draft_lengths(seqs: list[Sequence], limits: list[int], other_rows: int, target: StepCost,
                  draft: StepCost | None) -> list[int]:
    """This step's draft length of each of `seqs` (see the module docstring): the batch's best, a seeded sampled
    sequence's best alone, a probe where a sequence was kept from drafting for `PROBE_INTERVAL` steps."""
    states = [seq.stash.setdefault(ACCEPTANCE, Acceptance()) for seq in seqs]
    alone = [not seq.greedy and seq.request.params.seed is not None for seq in seqs]
    shared = [i for i, own in enumerate(alone) if not own]
    lengths = [0] * len(seqs)
    chosen = choose_draft_lengths([states[i].rate for i in shared], [limits[i] for i in shared],
                                  other_rows + len(seqs) - len(shared), target, draft)
    for i, k in zip(shared, chosen):
        lengths[i] = k
    for i in (i for i, own in enumerate(alone) if own):
        lengths[i] = choose_draft_lengths([states[i].rate], [limits[i]], 0, target, draft)[0]
    for i, state in enumerate(states):
        if lengths[i] or not limits[i]:
            state.idle_steps = 0
            continue
        state.idle_steps += 1
        if state.idle_steps >= PROBE_INTERVAL:
            lengths[i], state.idle_steps = min(PROBE_TOKENS, limits[i]), 0
    return lengths
