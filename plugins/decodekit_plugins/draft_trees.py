"""Draft trees for the `speculative` strategy: a draft model's tree of branches, and the rule that verifies one.

Drafting (`draft_tree`): the draft model drafts a chain for each sequence, as it does without a tree; where its
probability of its own token is below `TreeShape.threshold`, up to `width - 1` of its next most likely tokens become
siblings, and each sibling's branch is drafted on to the same depth, until the tree has `max_nodes` tokens. Every
branch is one row per level in the draft model's batched forwards (a branch has a key of its own in the draft's
paged cache, started from the blocks of its parent's prefix); processors see each branch's own history.

Verification (`accept_tree`), in one target forward where each branch is a probe sharing the sequence's KV blocks:
- greedy: walk from the root, descending into the child equal to the target's processed argmax; the path's last
  argmax is the next token. The output is the target's greedy output (lossless), whatever the tree.
- sampled: the multi-branch rule of SpecInfer and EAGLE-2 (recursive rejection sampling over siblings): at a node
  with target distribution p, child token t drawn from q is accepted with probability min(1, p(t) / q(t)); if
  rejected, p <- normalize(max(p - q, 0)) and the next sibling is tried; when every sibling is rejected, the token
  is drawn from the remaining p. A sibling chosen deterministically has q a point mass on its token, so its
  rejection removes just that token from p. Each step is an exact rejection-sampling step against the current p,
  so the emitted tokens are distributed as the target's processed distribution.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from decodekit.api.draft_tree import DraftTree, TreeShape, branch_row_starts
from decodekit.api.proposer import Proposer, ProposerModel
from decodekit.api.sampling import select_tokens
from decodekit.api.sequence import Sequence
from decodekit.api.strategy import StepContext

_branch_keys = itertools.count(1)
"""Keys of sibling branches in a draft model's cache: negative, so they never meet a sequence's id."""


@dataclass
class _Branch:
    """One branch being drafted: the sequence it drafts for (index), its key in the draft cache, its tokens."""

    index: int
    key: int
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def tree_rollback(roots: dict[int, tuple[int, list[int]]], seq: Sequence, num_valid: int) -> int:
    """How many leading tokens of `seq` the draft cache may keep after verification: `num_valid`, cut where the
    tokens the sequence kept leave the chain the sequence's own key cached (a sibling branch won). `roots` holds,
    per sequence drafted with a tree, how many tokens it had and the chain its key cached (forgotten here)."""
    root = roots.pop(seq.seq_id, None)
    if root is None:
        return num_valid
    start, chain = root
    return min(num_valid, start + _common_prefix(chain, seq.token_ids[start:]))


def draft_tree(model: ProposerModel, ctx: StepContext, seqs: list[Sequence], ks: list[int], shape: TreeShape,
               roots: dict[int, tuple[int, list[int]]]) -> list[DraftTree]:
    """Draft a tree of depth up to `ks[i]` for each `seqs[i]` with a draft model (see the module docstring).

    The sequence's own key keeps the first branch (its chain) cached, as a plain draft would; `roots` records that
    chain, so `tree_rollback` keeps only what the accepted branch shares with it. Sibling branches' keys are
    released before returning."""
    for seq in seqs:  # a failed or unverified earlier call may have cached draft tokens: the last token is fed
        cached = min(model.num_cached(seq.seq_id), tree_rollback(roots, seq, len(seq.token_ids) - 1))
        if model.num_cached(seq.seq_id) > cached:
            model.truncate(seq.seq_id, cached)
    branches: list[list[_Branch]] = [[] for _ in seqs]
    nodes = [0] * len(seqs)
    for i, seq in enumerate(seqs):
        if ks[i] > 0 and model.reserve(seq.seq_id, len(seq.token_ids) + ks[i] - 1, seq.token_ids):
            model.adopt_target_kv(seq.seq_id, seq.token_ids, seq.num_computed_tokens)  # a self-draft's catch-up
            branches[i].append(_Branch(i, seq.seq_id))
    try:
        for depth in range(max(ks, default=0)):
            rows = []
            for i, own in enumerate(branches):
                for branch in own:
                    # the first branch (the plain draft) keeps the nodes it needs to reach its full depth
                    keep = 0 if branch is own[0] else max(0, ks[i] - len(own[0].tokens) - 1)
                    if len(branch.tokens) == depth < ks[i] and nodes[i] + keep < shape.max_nodes:
                        nodes[i] += 1  # the token this row drafts
                        rows.append(branch)
            if not rows:
                break
            row_seqs = [seqs[b.index] for b in rows]
            batch = [(b.key, (s.token_ids + b.tokens)[model.num_cached(b.key):]) for s, b in zip(row_seqs, rows)]
            logits = ctx.process_after(model.forward(batch), row_seqs, [list(b.tokens) for b in rows])
            greedy = [s.greedy for s in row_seqs]
            tokens = select_tokens(logits, greedy, [s.generator for s in row_seqs]).tolist()
            probs = torch.softmax(logits.float(), dim=-1)
            for r, (branch, token) in enumerate(zip(rows, tokens)):
                seq = seqs[branch.index]
                # a sampled row's token was drawn from q; a greedy row's is the argmax (a point mass for the rule)
                branch.tokens.append(token)
                branch.probs.append(None if greedy[r] else probs[r])
                if shape.width > 1 and float(probs[r, token]) < shape.threshold:
                    chain = max(0, ks[branch.index] - len(branches[branch.index][0].tokens))
                    _add_siblings(model, seq, branch, probs[r], ks[branch.index], shape, nodes, branches,
                                  shape.max_nodes - chain)
    finally:
        for own in branches:
            for branch in own[1:]:
                model.release(branch.key)
    trees = []
    for i, own in enumerate(branches):
        if own:
            roots[seqs[i].seq_id] = (len(seqs[i].token_ids), list(own[0].tokens))
        trees.append(DraftTree([b.tokens for b in own if b.tokens], [b.probs for b in own if b.tokens]))
    return trees


def _add_siblings(model: ProposerModel, seq: Sequence, branch: _Branch, probs: torch.Tensor, k: int,
                  shape: TreeShape, nodes: list[int], branches: list[list[_Branch]], max_nodes: int) -> None:
    """Branch where the draft is unsure: its next most likely tokens after `branch`'s last become siblings of it
    (chosen deterministically), each a new branch drafted on from there, while the tree has fewer than `max_nodes`
    nodes."""
    i, chosen = branch.index, branch.tokens[-1]
    top = torch.topk(probs, min(shape.width, probs.shape[-1]))
    added = 0
    for p, token in zip(top.values.tolist(), top.indices.tolist()):
        if added == shape.width - 1 or nodes[i] >= max_nodes:
            return
        if token == chosen or p <= 0.0:
            continue
        prefix = branch.tokens[:-1]
        key = -next(_branch_keys)
        if not model.reserve(key, len(seq.token_ids) + k - 1, seq.token_ids + prefix):
            return  # the draft's pool is full: the tree stays as it is
        branches[i].append(_Branch(i, key, [*prefix, int(token)], [*branch.probs[:-1], None]))
        nodes[i] += 1
        added += 1


def _uniform(gen: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=gen, device=device)) if gen is not None else float(torch.rand(()))


def accept_tree(tree: DraftTree, rows: torch.Tensor, greedy: bool, gen: torch.Generator | None
                ) -> tuple[int, int, int]:
    """Verify a draft tree against the target's processed rows (`1 + len(branch)` per branch, branch after branch):
    returns the branch to keep, how many of its tokens are accepted and the token that follows them.

    Greedy: the longest path that follows the target's argmax. Sampled: recursive rejection sampling over siblings
    (module docstring), drawing uniforms and the final token from `gen`, so a seeded request is reproducible."""
    branches = tree.branches
    starts = branch_row_starts(branches)
    path: list[int] = []
    current = 0  # a branch that contains `path`: its rows score the path's positions
    while True:
        depth = len(path)
        row = rows[starts[current] + depth]
        children: list[tuple[int, int]] = []  # (token, first branch through it), in branch order
        for b, branch in enumerate(branches):
            if len(branch) > depth and branch[:depth] == path and all(t != branch[depth] for t, _ in children):
                children.append((branch[depth], b))
        if greedy:
            best = int(row.argmax())
            follow = next((b for t, b in children if t == best), None)
            if follow is None:
                return current, depth, best
            path.append(best)
            current = follow
            continue
        p = torch.softmax(row.float(), dim=-1)
        for token, b in children:
            q = tree.probs[b][depth]
            q_t = 1.0 if q is None else float(q[token])
            if q_t > 0 and _uniform(gen, row.device) < min(1.0, float(p[token]) / q_t):
                path.append(token)
                current = b
                break
            residual = p.clone()
            if q is None:
                residual[token] = 0.0
            else:
                residual = (residual - q.to(residual.device)).clamp_min(0.0)
            total = float(residual.sum())
            if total > 0.0:  # else p <= q everywhere: p == q up to rounding, and p itself is the residual
                p = residual / total
        else:
            token = int(select_tokens(p.log()[None], [False], [gen]).item())
            return current, depth, token


def propose_with_trees(proposer: Proposer, ctx: StepContext, items: list[tuple[Sequence, int, Any]],
                       shapes: Mapping[int, TreeShape | None] | None = None
                       ) -> tuple[list[list[int]], list[torch.Tensor | None], list[DraftTree | None]]:
    """Run `proposer` on `(seq, k, options)` items: a tree for the requests that ask for one (`tree:`) where the
    proposer can draft trees (one call per tree shape), a plain draft for the others. `shapes` overrides the shape
    by sequence id (None: a plain draft this step), as the adaptive chooser gates trees by cost. Returns, per item,
    a plain draft (a tree of one branch becomes one) with its first branch's distributions, and the tree where it
    has several branches."""
    drafts: list[list[int]] = [[] for _ in items]
    qs: list[torch.Tensor | None] = [None] * len(items)
    trees: list[DraftTree | None] = [None] * len(items)
    groups: dict[tuple[Any, ...] | None, list[int]] = {}
    group_shapes: dict[tuple[Any, ...], TreeShape] = {}
    for n, (seq, _, _) in enumerate(items):
        shape: TreeShape | None = getattr(seq.request.plan.strategy_options, "tree", None)
        if shapes is not None and seq.seq_id in shapes:
            shape = shapes[seq.seq_id]
        key = None if shape is None or not proposer.supports_tree else tuple(shape.model_dump().values())
        if key is not None and shape is not None:
            group_shapes[key] = shape
        groups.setdefault(key, []).append(n)
    for key, part in groups.items():
        seqs, ks, options = [items[n][0] for n in part], [items[n][1] for n in part], [items[n][2] for n in part]
        if key is None:
            plain, plain_q = proposer.propose(ctx, seqs, ks, options)
            for n, draft, q in zip(part, plain, plain_q):
                drafts[n], qs[n] = draft, q
            continue
        proposed = proposer.propose_tree(ctx, seqs, ks, options, group_shapes[key])
        if len(proposed) != len(part):
            raise ValueError(f"proposer {proposer.name!r} returned {len(proposed)} trees for {len(part)} sequences")
        for n, k, tree in zip(part, ks, proposed):
            if [len(p) for p in tree.probs] != [len(b) for b in tree.branches]:
                raise ValueError(f"proposer {proposer.name!r} returned a tree whose probs do not match its branches")
            tree = DraftTree([b[:k] for b in tree.branches], [p[:k] for p in tree.probs])  # never past k
            if not tree.branches:
                continue
            # the first branch's distributions: a tree verified as its first branch alone (a chain, or past the
            # step's budget: `drafts.flatten`) needs them for the plain rule
            probs = tree.probs[0]
            given = [p for p in probs if p is not None]
            qs[n] = torch.stack(given) if len(given) == len(probs) else None
            if len(tree.branches) > 1:
                trees[n] = tree
            else:
                drafts[n] = tree.branches[0]
    return drafts, qs, trees
