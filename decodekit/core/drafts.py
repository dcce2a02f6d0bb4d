"""Drafts: the tokens a strategy proposes for verification (speculative decoding), handled in one place.

A strategy's `propose` sets `seq.draft_token_ids`; from then on only this module changes them: the scheduler trims
a draft to the step's token budget, the forward stage feeds `pending_tokens`, the process stage expands a sequence
into one row per scored position (`scored_rows`), and the step context `clear`s the draft when the strategy
accepts a prefix of it (or the scheduler when it preempts the sequence).
"""

from __future__ import annotations

from decodekit.api.sequence import Sequence


def trim(seq: Sequence, budget: int) -> None:
    """Drop the draft tokens that do not fit in `budget` tokens of work (drafts are optional; the tokens that must
    be computed are not)."""
    if seq.draft_token_ids and seq.num_pending > budget:
        del seq.draft_token_ids[max(0, budget - seq.num_uncomputed) :]


def cut(seq: Sequence, keep: int) -> None:
    """Keep only the first `keep` draft tokens (a reasoning request's draft past a forced marker)."""
    del seq.draft_token_ids[keep:]


def clear(seq: Sequence) -> None:
    """Forget the draft (verified, or its sequence preempted)."""
    seq.draft_token_ids = []


def pending_tokens(seq: Sequence, start: int, count: int) -> list[int]:
    """`count` tokens to compute from position `start`: the sequence's own tokens, then its draft."""
    tokens = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
    return tokens[start : start + count]


def scored_rows(seq: Sequence) -> list[tuple[list[int], int]]:
    """Each scored row of `seq`: the history it sees and how many of its trailing tokens are unverified. Row j of a
    drafting sequence sees the first j draft tokens; a sequence scoring candidates has one row per candidate, each
    seeing that one candidate (`StepContext.score_candidates`)."""
    if seq.candidate_token_ids:
        return [([*seq.token_ids, token], 1) for token in seq.candidate_token_ids]
    draft = seq.draft_token_ids
    return [(seq.token_ids + draft[:j] if j else seq.token_ids, j) for j in range(1 + len(draft))]
