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
far as acceptance pays. Drafting must beat plain decoding's predicted rate by `MIN_GAIN` (smaller gains are within
the cost model's error), and a batch switched off keeps that answer for `HOLD_STEPS` while it stays the same
(`OffSwitch`). A sequence kept from drafting for `PROBE_INTERVAL` steps drafts `PROBE_TOKENS` tokens once, so its
acceptance is measured again and speculation can turn back on.

What a step costs (`decodekit_plugins.cost_model`): for the batch's shared choice, the target's curve calibrated by
what this machine's steps measure (`Calibration`), the chain's host time of proposing (lookups per sequence asked,
the draft model's forwards times their measured correction: `ChainCharge`), and each sequence's chance that its
chain drafts anything when asked (`hits`: a lookup that rarely finds a match earns little and still costs its
lookup). Where nothing pays, no sequence drafts and the proposers are not called at all. Before speculating at a
batch size whose plain step has fewer than two timings, steps run plain to measure it (at most
`Calibration.explore_tries` per bucket), and again once its timing is stale (`cost_model.STALE_AFTER`), so the
comparison is against what plain decoding costs here, not what the curve says. Probes back off: a sequence whose
probe did not turn speculation back on waits twice as long before the next (up to `MAX_PROBE_INTERVAL`), and at most
one in `PROBE_SHARE` of a batch probes in one step, and none where even an acceptance of `HOPEFUL_RATE` would not
pay (a compute-bound batch: a probe's rows would be spent to learn nothing). In a chain of lookups alone, a sequence
drafting nothing has its lookups draft in shadow instead (`Shadow`: asked every `SHADOW_GAP` tokens, compared with
the target's next tokens, counted as a verification would count them, no rows spent) and is never probed
(`Acceptance.shadowed`).

A seeded sampled sequence chooses as if it ran alone: which draft tokens it verifies changes which random numbers it
draws, so its output must not depend on the rest of the batch, nor on timings: it chooses from the cached curve
alone (no calibration, no host charges, no exploration), which is the same for every run on this machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from decodekit.api.draft_tree import TreeShape
from decodekit.api.sequence import Sequence
from decodekit.api.stash import StashKey
from decodekit.api.step_cost import StepCost
from decodekit_plugins.cost_model import SMOOTHING, Calibration, ChainCharge, cost_at, expected_costs

PRIOR_ACCEPTANCE = 0.6
"""A new sequence's acceptance rate before it has verified anything: high enough that it drafts, so it is measured."""
PRIOR_WEIGHT = 2.0  # the prior counts as this many draft tokens
DECAY = 0.8  # per verified draft: the acceptance follows the text as it changes (a copied span, then free text)
MAX_RATE = 0.99  # E(k) needs a < 1; a sequence that accepted everything still risks the next token
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 128
PROBE_TOKENS = 2
PROBE_SHARE = 8  # at most one in this many of a batch's sequences probes in one step (the ones idle longest)
HOPEFUL_RATE = 0.9  # a probe is worth its rows only where drafting at this acceptance would pay
SHADOW_TOKENS = 4
"""A shadow draft's length (`Shadow`): the tokens a sequence's lookups propose while it drafts nothing, compared
with the tokens the target then gives, as a verification of them would."""
SHADOW_GAP = 8
"""Tokens a sequence generates between two shadow asks: a lookup costs host time (tens of microseconds over a long
answer), so a batch of 32 switched off asks about 4 a step, not 32."""
CHAIN_DECAY = 0.99  # a chain's running acceptance (the prior of its new sequences) follows many verifications
MIN_GAIN = 0.05
"""A batch's measured choice drafts only where it predicts at least this much more than plain decoding's rate. The
calibrated cost of a row bucket wanders by 5-15% from step to step, so a smaller predicted gain is noise; and on a
compute-bound step a sequence that finishes early saves only the rows it would have taken (the batch's steps go on
for the others), not the step's fixed part that the tokens-per-second objective credits it with. At 24-32 sequences
of the GGUF as stored, batches that drafted on predictions of ~2% measured 0.86-0.96x plain."""
HOLD_STEPS = 8
"""A batch for which nothing paid keeps that answer for up to this many steps while its sequences and size stay the
same (nothing it is chosen from changes then, but the calibration's drift), so a batch with speculation switched off
does not pay the search every step; probes still run on time."""


@dataclass
class Acceptance:
    """A sequence's acceptance: discounted accepted draft tokens and rejections, and steps kept from drafting."""

    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
    idle_steps: int = 0
    probe_interval: int = PROBE_INTERVAL
    hit: float = 1.0
    """How often the sequence's chain drafted something when asked (moving average)."""
    decay: float = DECAY
    fresh: bool = False
    """A new sequence's state (`draft_lengths` makes it so) before its first probe or verified draft. In a batch
    chosen by measured costs it is probed on its first decode step, with the batch's other new sequences, where a high
    acceptance would pay (not `hopeless`), instead of waiting `PROBE_INTERVAL` steps and taking turns: its rate is only
    the prior, at which a batch of 8 (float32, 2-core Intel Xeon) found nothing paid, held that, then probed one
    sequence a step, and spent ~24 of its ~40 steps before drafting at the 81-95% its int8 self-draft was accepted
    at. One probe each costs one step `PROBE_TOKENS` rows a sequence longer, once."""
    probing: bool = False
    """This step's length is a probe's (`draft_lengths`), not the chooser's: it is kept as it is."""
    shadow: Shadow | None = None
    """The draft its chain's lookups proposed while it was not drafting, waiting for the tokens that decide it."""
    shadow_at: int = -SHADOW_GAP
    """Its token count when its lookups were last asked for a shadow draft."""
    shadowed: bool = False
    """Its chain is all lookups and a shadow draft has measured its acceptance: shadows, which cost no rows, take
    the place of its probes."""
    links: dict[str, list[float]] = field(default_factory=dict)
    """Per link of the chain (proposer name), the discounted accepted and rejected draft tokens of its own drafts:
    `link_rate`. A chain's links differ (suffix decoding's chat drafts 12-16% accepted, the int8 draft model's 80-90%),
    and a draft's length is chosen from the rate of the link that drafts it (`lengths_by_answer`)."""

    @classmethod
    def starting_from(cls, prior: Acceptance) -> Acceptance:
        """A new sequence's state whose prior is `prior`'s rate and hit rate (its chain's running ones), with the
        weight of the fixed prior, its rate never above the fixed prior's. A chain's history may only make a new
        request more cautious: its text is unknown, and a rate borrowed from other text (a copying workload before
        a chatting one) had a batch of 8 new chat requests draft on an acceptance they did not have, verifying
        rows for every sequence until their own estimates fell (the first such run 0.82x plain, the chain drafting
        89 tokens, against 0.95-1.02x and 0-4 tokens where the chain had no copying history)."""
        rate = min(prior.rate, PRIOR_ACCEPTANCE)
        links = {name: [r * PRIOR_WEIGHT, (1 - r) * PRIOR_WEIGHT]
                 for name in prior.links for r in [min(prior.link_rate(name), PRIOR_ACCEPTANCE)]}
        return cls(rate * PRIOR_WEIGHT, (1 - rate) * PRIOR_WEIGHT, hit=prior.hit, fresh=True, links=links)

    @property
    def rate(self) -> float:
        """The estimated chance that a draft token is accepted (given the ones before it were)."""
        return min(self.accepted / (self.accepted + self.rejected), MAX_RATE)

    def link_rate(self, link: str) -> float:
        """The acceptance of link `link`'s drafts for this sequence; the fixed prior's until it drafted (a rate
        borrowed from the other links would be theirs)."""
        tally = self.links.get(link)
        if tally is None:
            return PRIOR_ACCEPTANCE
        return min(tally[0] / (tally[0] + tally[1]), MAX_RATE)

    def record(self, proposed: int, accepted: int, link: str | None = None) -> None:
        """A verified draft of `proposed` tokens whose first `accepted` were accepted (the rest rejected at once:
        one rejection, since verification stops at the first), drafted by link `link` where given."""
        if proposed:
            self.fresh = False
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (accepted < proposed)
            if link is not None:
                tally = self.links.setdefault(link, [PRIOR_ACCEPTANCE * PRIOR_WEIGHT,
                                                     (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT])
                tally[0] = self.decay * tally[0] + accepted
                tally[1] = self.decay * tally[1] + (accepted < proposed)

    def record_ask(self, drafted: bool) -> None:
        """The chain was asked for a draft and gave one (`drafted`) or nothing."""
        self.hit += SMOOTHING * (float(drafted) - self.hit)


ACCEPTANCE = StashKey[Acceptance]()


@dataclass
class Shadow:
    """A draft that a sequence's lookups proposed at token count `start` while it drafted nothing, by link `link`:
    never verified, only compared with the tokens the target gives next. A lookup's draft is deterministic, so a
    verification of it would accept exactly its first tokens that equal the target's (a greedy sequence's tokens; a
    sampled one's match a draft token with the chance the target gives it, the lossless rule's chance of accepting
    it), and the comparison measures that acceptance for free: no verification rows, no probe steps."""

    start: int
    tokens: list[int]
    link: str

    def outcome(self, token_ids: Seq[int]) -> tuple[int, int] | None:
        """(tokens proposed, tokens a verification would have accepted) once the sequence's tokens since `start`
        decide it (a mismatch, or as many tokens as were proposed); None while they do not yet."""
        given = token_ids[self.start : self.start + len(self.tokens)]
        accepted = 0
        while accepted < len(given) and given[accepted] == self.tokens[accepted]:
            accepted += 1
        if accepted < len(given) or len(given) == len(self.tokens):
            return len(self.tokens), accepted
        return None


def expected_tokens(rate: float, k: int) -> float:
    """The expected tokens a step gives a sequence verifying `k` draft tokens each accepted with chance `rate`."""
    return sum(rate**j for j in range(k + 1))


def choose_draft_lengths(rates: Seq[float], limits: Seq[int], other_rows: int, target: Callable[[float], float],
                         draft: Callable[[float], float] | None = None, *, hits: Seq[float] | None = None,
                         host: ChainCharge | None = None, min_gain: float = 0.0,
                         reach: Seq[float] | None = None) -> list[int]:
    """The draft length of each sequence that maximizes the step's expected tokens per second; all 0 where no
    drafting beats plain decoding's rate by more than `min_gain` (then nobody drafts, and nobody pays for proposing).

    Args:
        rates: each sequence's acceptance rate.
        limits: the most draft tokens each may verify.
        other_rows: rows of the step that do not speculate (other strategies' sequences, one token each).
        target: the target's forward cost by rows (a `StepCost`, or a `Calibration` of one).
        draft: the draft model's forward cost by rows, where a proposer runs one (None: drafting is free); not with
            `host`, which carries its own.
        hits: each sequence's chance that its proposers draft anything when asked (1 where not given): its gains
            and verification rows are expected values.
        host: what proposing costs the host (`ChainCharge`): seconds per drafting sequence, and the draft model's
            forwards for the share of sequences that reach it.
        min_gain: the share by which the best choice must beat plain decoding's rate (`MIN_GAIN` for measured
            costs); 0: any gain.
        reach: each sequence's share of the draft model's forwards (the host's `draft_reach` where not given): 0
            for a sequence whose draft a lookup already gave (`lengths_by_answer`).
    """
    plan = _Allocations(rates, limits, other_rows, target, draft, hits, host, reach)
    chosen = [0] * len(rates)
    if plan.values is None:
        return chosen
    best = float(plan.values.max())
    # the fewest extra rows within rounding of the best; none where drafting cannot beat plain decoding
    best_n = 0 if best <= plan.plain * (1 + min_gain) * (1 + 1e-9) else \
        int(np.argmax(plan.values >= best / (1 + 1e-9))) + 1
    for i in plan.seq_of[:best_n].tolist():
        chosen[i] += 1
    return chosen


def best_rate(rates: Seq[float], limits: Seq[int], other_rows: int, target: Callable[[float], float],
              draft: Callable[[float], float] | None = None, reach: Seq[float] | None = None) -> float:
    """The most expected tokens per second of a step (drafting or not) for these sequences (`choose_draft_lengths`'s
    arguments, every sequence drafting when asked)."""
    plan = _Allocations(rates, limits, other_rows, target, draft, None, None, reach)
    return plan.plain if plan.values is None else max(plan.plain, float(plan.values.max()))


class _Allocations:
    """The candidate allocations of draft rows to a batch's sequences, best gains first: after the first n of them
    (n = 1, 2, ...) the step's expected tokens per second (`values`, None where nobody may draft), against plain
    decoding's (`plain`); `seq_of[n]` is the sequence the (n+1)-th extra row drafts for."""

    def __init__(self, rates: Seq[float], limits: Seq[int], other_rows: int, target: Callable[[float], float],
                 draft: Callable[[float], float] | None, hits: Seq[float] | None, host: ChainCharge | None,
                 reach: Seq[float] | None) -> None:
        if host is not None and draft is not None:
            raise ValueError("choose_draft_lengths: give the draft model's cost in `draft` or in `host`, not both")
        charge = host if host is not None else ChainCharge(draft=draft)
        chance = np.asarray(list(hits) if hits is not None else [1.0] * len(rates), dtype=np.float64)
        share = np.asarray(list(reach) if reach is not None else [charge.draft_reach] * len(rates), dtype=np.float64)
        base = len(rates) + other_rows
        self.plain = base / target(base)  # every row without a draft gives one token, the others' decode rows too
        self.values: np.ndarray | None = None
        self.seq_of = np.zeros(0, dtype=np.int64)
        depth = max(limits, default=0)
        if depth <= 0 or not len(rates):
            return
        # each sequence's j-th draft token gains chance * rate^j; listed sequence by sequence in j order and sorted
        # stably, so a sequence's gains are always taken first to last (they never grow with j)
        j = np.arange(1, depth + 1)
        seq_of, j_of = np.nonzero(j[None, :] <= np.asarray(limits)[:, None])
        j_of = j_of + 1
        gains = chance[seq_of] * np.asarray(rates, dtype=np.float64)[seq_of] ** j_of
        order = np.argsort(-gains, kind="stable")
        seq_of, j_of, gains = seq_of[order], j_of[order], gains[order]
        # the step with the first n of them (n = 1, 2, ...): expected tokens, rows, and seconds
        tokens = base + np.cumsum(gains)
        rows = base + np.cumsum(chance[seq_of])  # a verification row where the chain drafts something
        seconds = cost_at(target, rows)
        seconds += charge.per_sequence * np.cumsum(j_of == 1)  # lookups run whether or not they find anything
        if charge.draft is not None:  # the j-th draft forward gets the sequence's reach more expected rows
            weight = share[seq_of]
            taken = np.cumsum((j_of[:, None] == j[None, :]) * weight[:, None], axis=0)[np.arange(len(j_of)),
                                                                                      j_of - 1]
            added = expected_costs(charge.draft, taken) - expected_costs(charge.draft, taken - weight)
            seconds += np.cumsum(added)
        self.values = tokens / seconds
        self.seq_of = seq_of


def lengths_by_answer(answers: Seq[tuple[float, int] | None], model_rates: Seq[float], limits: Seq[int],
                      other_rows: int, target: Callable[[float], float],
                      draft: Callable[[float], float] | None) -> tuple[list[int], list[bool]]:
    """Each sequence's draft length from the rate of the link that will draft it, once the chain's lookups have
    answered, and whether it keeps its lookup's draft (else its chain's draft model drafts it).

    A chain's sequence was chosen a length before its proposers ran, from one rate; but its lookups' drafts, when
    they find one, preempt the draft model's, and their acceptance is their own (suffix decoding's on chat 12-16%,
    the int8 draft model's 80-90%). So the lookups run first (`answers`: the answering lookup's acceptance for the
    sequence and its draft's length, None where none answered). Every answer is kept, then, the answers least
    promising against the draft model first (`model_rates`, up to `limits`, at `draft`'s cost), each is handed to
    the model where that raises the batch's best expected tokens per second beside `other_rows` (the model's forwards
    are shared: once one sequence pays for them, another's rows in them cost little). The lengths are then chosen
    for the batch from those rates, the draft model charged only for the sequences it drafts (the lookups have run:
    their cost is spent). Without a draft model (`draft` None) an unanswered sequence drafts nothing."""
    keep = [answer is not None for answer in answers]

    def plan(keep: list[bool]) -> tuple[list[float], list[int], list[float]]:
        rates = [answer[0] if kept and answer is not None else model_rate
                 for answer, kept, model_rate in zip(answers, keep, model_rates)]
        lengths = [answer[1] if kept and answer is not None else limit if draft is not None else 0
                   for answer, kept, limit in zip(answers, keep, limits)]
        return rates, lengths, [0.0 if kept else 1.0 for kept in keep]

    if draft is not None:
        rates, lengths, reach = plan(keep)
        best = best_rate(rates, lengths, other_rows, target, draft, reach)
        doubtful = sorted((answer[0] - model_rate, i)
                          for i, (answer, model_rate) in enumerate(zip(answers, model_rates))
                          if answer is not None and model_rate > answer[0])
        for _, i in doubtful:
            trial = keep.copy()
            trial[i] = False
            rates, lengths, reach = plan(trial)
            value = best_rate(rates, lengths, other_rows, target, draft, reach)
            if value > best:
                keep, best = trial, value
    rates, lengths, reach = plan(keep)
    chosen = choose_draft_lengths(rates, lengths, other_rows, target, host=ChainCharge(draft=draft), reach=reach,
                                  min_gain=MIN_GAIN)
    return chosen, keep


@dataclass
class OffSwitch:
    """The chooser's memory of a batch for which nothing paid (`HOLD_STEPS`): which sequences it was, for how many
    more steps the answer stands, and whether probing it was found useless meanwhile."""

    members: tuple[int, ...] = ()
    others: int = -1
    steps_left: int = 0
    hopeless: bool | None = None
    """The last probe check of the held batch: not even an acceptance of `HOPEFUL_RATE` would pay (None: not run)."""

    def holds(self, members: tuple[int, ...], others: int) -> bool:
        """Whether the batch `members` (sequence ids) beside `others` rows is the one switched off, still in time;
        each answer uses up one step."""
        if self.steps_left <= 0 or members != self.members or others != self.others:
            self.release()
            return False
        self.steps_left -= 1
        return True

    def switch_off(self, members: tuple[int, ...], others: int) -> None:
        """The search found nothing that pays for this batch: hold that for the next `HOLD_STEPS - 1` steps."""
        self.members, self.others, self.steps_left = members, others, HOLD_STEPS - 1

    def release(self) -> None:
        """Search again next step (something drafted, or the batch changed)."""
        self.steps_left, self.hopeless = 0, None


def draft_lengths(seqs: list[Sequence], limits: list[int], other_rows: int, target: StepCost,
                  draft: StepCost | None, calibrated: Calibration | None = None,
                  host: ChainCharge | None = None, prior: Acceptance | None = None,
                  off: OffSwitch | None = None, rate_link: str | None = None, vetoed: bool = False) -> list[int]:
    """This step's draft length of each of `seqs` (see the module docstring): the batch's best (from `calibrated`
    and `host` where given, else from the curves), a seeded sampled sequence's best alone from the curves, a probe
    where a sequence was kept from drafting for its probe interval (its state's `probing` set). A new sequence
    starts from `prior` (its chain's running acceptance and hit rate) where given, unless seeded (its choices must
    not depend on earlier requests). With `off`, a batch for which nothing paid skips the search while it stays the
    same (`HOLD_STEPS`). With `rate_link`, the batch's sequences (not the seeded ones) choose by the higher of the
    chain's rate and that link's: the draft model of a chain whose lookups answer first and are kept only where
    they promise more (`lengths_by_answer`), so the chain drafts at least as well as its model would. `vetoed`:
    this batch size's speculating steps measured slower than plain decoding (`cost_model.RealizedGain`): its
    sequences (not the seeded ones) draft nothing and probe nothing this step."""
    alone = [not seq.greedy and seq.request.params.seed is not None for seq in seqs]
    states = [seq.stash[ACCEPTANCE] if ACCEPTANCE in seq.stash else  # a new state only for a new sequence
              seq.stash.setdefault(ACCEPTANCE, Acceptance(fresh=True) if own or prior is None else
                                   Acceptance.starting_from(prior)) for seq, own in zip(seqs, alone)]
    for state in states:
        state.probing = False
    shared = [i for i, own in enumerate(alone) if not own]
    rates = [states[i].rate if rate_link is None else max(states[i].rate, states[i].link_rate(rate_link))
             for i in shared]
    lengths = [0] * len(seqs)
    others = other_rows + len(seqs) - len(shared)
    members = tuple(seqs[i].seq_id for i in shared) if off is not None else ()
    holding = off is not None and off.holds(members, others)
    charge = host if host is not None else ChainCharge(draft=draft)  # the measured choices' host charges
    if holding or vetoed:
        chosen = [0] * len(shared)
    elif calibrated is None:
        chosen = choose_draft_lengths(rates, [limits[i] for i in shared], others, target, draft, min_gain=MIN_GAIN)
    else:
        chosen = choose_draft_lengths(rates, [limits[i] for i in shared], others,
                                      calibrated, hits=[states[i].hit for i in shared],
                                      host=charge, min_gain=MIN_GAIN)
    exploring = any(chosen) and calibrated is not None and calibrated.explore(len(shared) + others)
    for i, k in zip(shared, chosen):
        lengths[i] = 0 if exploring else k
    for i in (i for i, own in enumerate(alone) if own):
        lengths[i] = choose_draft_lengths([states[i].rate], [limits[i]], 0, target, draft, min_gain=MIN_GAIN)[0]
    due: list[int] = []
    for i, state in enumerate(states):
        if lengths[i] or not limits[i]:
            state.idle_steps = 0
            if lengths[i]:
                state.probe_interval = PROBE_INTERVAL  # speculation pays for it again: probe soon when it stops
            continue
        state.idle_steps += 1
        if state.shadowed and not state.fresh:  # its shadow drafts measure what a probe would, for nothing
            continue
        if state.idle_steps >= state.probe_interval or (state.fresh and calibrated is not None and not alone[i]):
            due.append(i)
    # a seeded sequence probes as it would alone; the others take turns, the longest idle first, and only where
    # a high acceptance would make drafting pay (a compute-bound batch learns nothing useful from a probe)
    shared_due = [] if vetoed else sorted((i for i in due if not alone[i]), key=lambda i: -states[i].idle_steps)
    # shadow drafts (`Shadow`) are asked only where a high acceptance could pay: the same check, where nothing drafts
    shadowing = not vetoed and not any(lengths[i] for i in shared) and any(
        states[i].shadowed and limits[i] for i in shared)
    if (shared_due or shadowing) and calibrated is not None:
        hopeless = off.hopeless if off is not None and off.hopeless is not None else not any(choose_draft_lengths(
            [HOPEFUL_RATE] * len(shared), [limits[i] for i in shared], others, calibrated,
            host=charge, min_gain=MIN_GAIN))
        if off is not None:
            off.hopeless = hopeless
        if hopeless:
            shared_due = []
    # new sequences all at once (their first probe), the others a share of the batch a step
    fresh = [i for i in shared_due if states[i].fresh]
    turns = [i for i in shared_due if not states[i].fresh][:math.ceil(len(shared) / PROBE_SHARE)]
    if turns and calibrated is not None and not exploring:
        worth = [i for i in turns if states[i].probe_interval >= MAX_PROBE_INTERVAL or _probe_would_pay(
            shared.index(i), rates, [limits[j] for j in shared], [states[j].hit for j in shared], others,
            calibrated, charge)]
        for i in turns:
            if i not in worth:  # what it would learn changes no choice: waits as after a probe that found nothing
                states[i].idle_steps = 0
                states[i].probe_interval = min(2 * states[i].probe_interval, MAX_PROBE_INTERVAL)
        turns = worth
    probing = [i for i in due if alone[i]] + ([] if exploring else fresh + turns)
    for i in probing:
        lengths[i], states[i].idle_steps, states[i].probing = min(PROBE_TOKENS, limits[i]), 0, True
        if states[i].fresh:  # a first probe: the next one waits the usual interval
            states[i].fresh = False
        else:
            states[i].probe_interval = min(2 * states[i].probe_interval, MAX_PROBE_INTERVAL)
    if off is not None:
        if exploring or any(lengths[i] for i in shared):
            off.release()
        elif not holding:
            off.switch_off(members, others)
    return lengths


def _probe_would_pay(index: int, rates: list[float], limits: list[int], hits: list[float], others: int,
                     calibrated: Calibration, host: ChainCharge) -> bool:
    """Whether a probe of the `index`-th of a batch's sequences can change what the batch drafts: if it found that
    sequence's drafts accepted at `HOPEFUL_RATE` (and always given), with the others as they are, the chooser would
    give it draft rows. A probe that cannot change a choice is all cost: a step a few rows longer and its proposers'
    work (its own rows and draft forwards were a fifth of a batch-8 step, float32 target on a 2-core Zen 3).

    `hopeless` asks whether drafting could pay at all, with every sequence hopeful; this asks it of the one probed.
    In a batch where drafting pays only if most sequences draft together (rows that cost nearly their share), one
    sequence's high acceptance changes nothing, so its probes are skipped (backed off as a probe that found nothing,
    up to `MAX_PROBE_INTERVAL`, where one runs anyway so that a batch whose text turned copyable is still found).
    Measured: the chain `ngram > suffix > draft` at batch 8 of chat prompts after copying ones (2-core Zen 3,
    float32 target) drafted ~10 tokens a run over ~24 probe steps of 9-10 rows (43-47 ms against 37 for 8) and ran
    0.91x plain."""
    hopeful, given = list(rates), list(hits)
    hopeful[index], given[index] = max(rates[index], HOPEFUL_RATE), 1.0
    return choose_draft_lengths(hopeful, limits, others, calibrated, hits=given, host=host,
                                min_gain=MIN_GAIN)[index] > 0


TREE_SLACK = 0.05
"""A draft tree may add the rows that cost at most this share of the step more: "nearly free" rows."""


def tree_rows(target: Callable[[float], float], rows: float, most: int, slack: float = TREE_SLACK) -> int:
    """The most extra rows (up to `most`) a step of `rows` rows can take for at most `slack` more time, by `target`'s
    cost (a binary search: the cost never falls with more rows)."""
    limit = target(rows) * (1 + slack)
    low, high = 0, most
    while low < high:
        mid = (low + high + 1) // 2
        if target(rows + mid) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


def tree_shape(shape: TreeShape, k: int, extra_rows: int) -> TreeShape | None:
    """`shape` cut to fit `extra_rows` verification rows beyond its first branch: each other branch costs up to
    `1 + k` rows and adds at least one node, so `max_nodes` becomes `k` plus the branches that fit; None (a plain
    draft) where not one does."""
    branches = min(extra_rows // (k + 1), max(shape.max_nodes - k, 0))
    if branches < 1 or shape.width < 2:
        return None
    return shape.model_copy(update={"max_nodes": k + branches})


def worst_tree_rows(shape: TreeShape, k: int) -> int:
    """The most verification rows a tree of `shape` at depth `k` adds beyond its first branch."""
    return max(shape.max_nodes - k, 0) * (k + 1)
