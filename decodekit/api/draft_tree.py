"""Draft trees: several draft branches for one sequence, verified side by side in one forward.

A proposer that can give a tree (`Proposer.propose_tree`) returns, per sequence, a `DraftTree`: its root-to-leaf
branches (each a list of draft tokens after the sequence's last token; branches share leading tokens where the tree
does) and, per token, the distribution it was drawn from (None: chosen deterministically, a point mass for the
acceptance rule). The strategy puts the branches in `seq.draft_branches`; the engine runs each branch as a hidden
probe that shares the sequence's KV blocks (a copy-on-write fork with the branch as its draft), scores
`1 + len(branch)` positions per branch, and the strategy keeps one branch's accepted prefix with
`StepContext.accept_branch` (the sequence adopts that probe's blocks; the other probes are freed).

The shape of the tree a request asks for is a `TreeShape` (`strategy: {speculative: {tree: {...}}}`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field


class TreeShape(BaseModel):
    """How wide and large a draft tree may grow (the `tree` option of the `speculative` strategy).

    Example (recipe): `strategy: {speculative: {proposer: draft, tree: {width: 2, max_nodes: 16, threshold: 0.8}}}`
    """

    model_config = ConfigDict(extra="forbid")

    width: int = Field(2, ge=1, le=8, description="Most children of one node: the drafted token and up to "
                       "width - 1 alternatives (the proposer's next most likely tokens).")
    max_nodes: int = Field(16, ge=1, le=256, description="Most draft tokens in the tree (every branch together, "
                           "shared tokens counted once).")
    threshold: float = Field(0.8, ge=0.0, le=1.0, description="Branch only where the proposer's probability of "
                             "its own token is below this (1.0: branch everywhere the nodes allow; 0.0: never).")


@dataclass
class DraftTree:
    """One sequence's draft tree, as its root-to-leaf branches.

    `branches[b]` is a list of draft tokens; `probs[b][j]` is the distribution (`[vocab]` probabilities) token
    `branches[b][j]` was drawn from, or None where the proposer chose it deterministically. Where two branches share
    their first `j` tokens they are the same nodes (and carry the same distributions).
    """

    branches: list[list[int]] = field(default_factory=list)
    probs: list[list[torch.Tensor | None]] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        """The draft tokens of the tree, shared tokens counted once."""
        return count_nodes(self.branches)


def count_nodes(branches: list[list[int]]) -> int:
    """Distinct non-empty prefixes of `branches`: the nodes of the tree they spell, its root excluded."""
    return len({tuple(branch[: j + 1]) for branch in branches for j in range(len(branch))})


def branch_row_starts(branches: list[list[int]]) -> list[int]:
    """Where each branch's rows start among its sequence's scored rows (branch `b` scores `1 + len(branches[b])`
    positions: after the last verified token, then after each of its draft tokens)."""
    starts, offset = [], 0
    for branch in branches:
        starts.append(offset)
        offset += 1 + len(branch)
    return starts
