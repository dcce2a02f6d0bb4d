"""Drafts: the tokens a strategy proposes for verification (speculative decoding), handled in one place.

A strategy's `propose` sets `seq.draft_token_ids`; from then on only this module changes them: the scheduler trims
a draft to the step's token budget, the forward stage feeds `pending_tokens`, the process stage expands a sequence
into one row per scored position (`scored_rows`), and the step context `clear`s the draft when the strategy
accepts a prefix of it (or the scheduler when it preempts the sequence).

A draft tree (`seq.draft_branches`, `decodekit.api.draft_tree`) is handled here too: each branch is scored as its
own run of rows (`scored_rows`), `flatten` falls back to its first branch as a plain draft when the step's budget
cannot take the whole tree, and `clear` forgets it.
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


def cut_branch(seq: Sequence, branch: int, keep: int) -> None:
    """Keep only the first `keep` tokens of one branch of a draft tree."""
    del seq.draft_branches[branch][keep:]


def flatten(seq: Sequence, budget: int) -> None:
    """Replace a draft tree by its first branch, a plain draft, when the tree's rows do not fit in `budget` tokens
    of work (then `trim` cuts that branch as any draft)."""
    if seq.draft_branches and seq.num_uncomputed * len(seq.draft_branches) + sum(
            len(b) for b in seq.draft_branches) > budget:
        seq.draft_token_ids = list(seq.draft_branches[0])
        seq.draft_branches = []


def clear(seq: Sequence) -> None:
    """Forget the draft or draft tree (verified, or its sequence preempted)."""
    seq.draft_token_ids = []
    seq.draft_branches = []


def pending_tokens(seq: Sequence, start: int, count: int) -> list[int]:
    """`count` tokens to compute from position `start`: the sequence's own tokens, then its draft."""
    tokens = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
    return tokens[start : start + count]


def scored_rows(seq: Sequence) -> list[tuple[list[int], int]]:
    """Each scored row of `seq`: the history it sees and how many of its trailing tokens are unverified. Row j of a
    drafting sequence sees the first j draft tokens; a sequence scoring candidates has one row per candidate, each
    seeing that one candidate (`StepContext.score_candidates`); a draft tree has `1 + len(branch)` rows per branch,
    each branch's rows seeing that branch's tokens."""
    if seq.draft_branches:
        return [(seq.token_ids + branch[:j] if j else seq.token_ids, j)
                for branch in seq.draft_branches for j in range(1 + len(branch))]
    if seq.candidate_token_ids:
        return [([*seq.token_ids, token], 1) for token in seq.candidate_token_ids]
    draft = seq.draft_token_ids
    return [(seq.token_ids + draft[:j] if j else seq.token_ids, j) for j in range(1 + len(draft))]
