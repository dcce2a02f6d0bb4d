"""The `suffix` proposer: SuffixDecoding (arXiv 2411.04975), training-free drafts from suffix trees.

Two depth-bounded substring indexes (`decodekit_plugins.suffix_tree`: the matches and continuations of a suffix
trie of that depth, found from each token's positions) are searched for the longest suffix of the sequence that
occurred before with a continuation: the request's own (its prompt and output so far, extended token by token as the
output grows) and one global to the engine, over the outputs of recent finished requests that used the proposer
(oldest evicted first, at most `global_cache_tokens` tokens). From the match, each draft token is the most frequent
continuation of the path so far, while the product of those frequencies stays at least `min_token_prob`; the draft
is at most `max_spec_factor * match_length + max_spec_offset` tokens long (a long match is evidence of a long copy,
as the paper sets its draft length); where the indexes' depth leaves the longest match too little room, a shorter
match's draft competes with it (`suffix_tree.follow`). Of the two drafts, the one with the higher score (the
expected number of accepted tokens, the sum of the cumulative frequencies) is proposed. A seeded sampled request
drafts from its own tokens only, so its output is the same whatever the engine served before.

The drafts are deterministic (no `q`), so sampled requests stay lossless under the strategy's acceptance rule.

Example (recipe): `strategy: {speculative: {proposer: suffix}}`, or as a link of a chain:
`{proposer: ngram, proposer_options: {prompt_lookup_min: 2}, fallback: [suffix, draft]}`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from decodekit.api.proposer import Proposer
from decodekit.api.sequence import Sequence
from decodekit.api.strategy import StepContext
from decodekit_plugins.suffix_tree import RecentOutputs, SequenceIndex, SuffixTrie

MAX_DEPTH = 24
"""The indexes' depth, a suffix trie's: matches of up to 23 tokens, each followed by at least one, and drafts that
stop where a path of 24 tokens would. (The indexes keep two integers per token; a trie held up to 24 nodes.)"""


class SuffixParams(BaseModel):
    """Parameters of the `suffix` proposer (Arctic Inference's names for the paper's settings)."""

    model_config = ConfigDict(extra="forbid")

    max_spec_factor: float = Field(1.0, gt=0.0, description="Draft at most this many tokens per matched token.")
    max_spec_offset: int = Field(0, ge=0, description="... plus this many.")
    min_token_prob: float = Field(0.1, ge=0.0, le=1.0, description="Stop the draft where the estimated chance "
                                  "that all of it is right (the product of the continuations' frequencies) falls "
                                  "below this.")
    global_outputs: bool = Field(True, description="Also draft from the outputs of recent finished requests, and "
                                 "add this request's output to them when it finishes.")
    global_cache_tokens: int = Field(8192, ge=0, description="The most tokens of recent outputs the engine keeps "
                                     "(oldest request evicted first), applied when this request's output is added.")


@dataclass
class _Local:
    """A sequence's own tokens, indexed (as far as it has read them), and the options it drafts with."""

    index: SequenceIndex
    options: SuffixParams


def suffix_draft(tries: list[SuffixTrie | SequenceIndex], context: list[int], k: int,
                 options: SuffixParams) -> list[int]:
    """The best draft of at most `k` tokens after `context` from `tries` (the highest expected number of accepted
    tokens; on a tie the earlier trie's)."""
    best: list[int] = []
    best_score = 0.0
    for trie in tries:
        tokens, probs = trie.follow(
            context, lambda length: min(k, int(options.max_spec_factor * length) + options.max_spec_offset),
            options.min_token_prob)
        if tokens and sum(probs) > best_score:
            best, best_score = tokens, sum(probs)
    return best


class SuffixProposer(Proposer):
    """Suffix decoding: drafts from suffix tries over the request and recent outputs (see the module docstring)."""

    name = "suffix"
    Params = SuffixParams

    def __init__(self) -> None:
        self._local: dict[int, _Local] = {}  # seq_id -> its own tokens, indexed
        self.recent = RecentOutputs(MAX_DEPTH)  # the outputs of recent finished requests, oldest evicted first
        self.global_tokens = 0  # the tokens `recent` keeps

    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts = []
        for seq, k, opts in zip(seqs, ks, options):
            local = self._extend(seq, opts)
            # a seeded sampled request drafts from its own tokens only: which drafts it verifies changes which
            # random numbers it draws, and its output must not depend on what the engine served before
            shared = opts.global_outputs and self.global_tokens and (seq.greedy or seq.request.params.seed is None)
            tries: list[SuffixTrie | SequenceIndex] = [local.index, self.recent] if shared else [local.index]
            drafts.append(suffix_draft(tries, seq.token_ids, k, opts))
        return drafts, [None] * len(seqs)

    def _extend(self, seq: Sequence, options: SuffixParams) -> _Local:
        """The sequence's index, with every token it has now (verified tokens only ever append)."""
        local = self._local.get(seq.seq_id)
        if local is None or local.index.length > len(seq.token_ids):  # new (or, defensively, rewound): rebuild
            local = self._local[seq.seq_id] = _Local(SequenceIndex(MAX_DEPTH), options)
        local.index.extend(seq.token_ids[local.index.length :])
        return local

    def forget_outputs(self) -> None:
        """Forget the recent outputs (a benchmark that repeats its prompts calls it, so a repeat cannot draft the
        previous one's answer from them)."""
        self.recent = RecentOutputs(MAX_DEPTH)
        self.global_tokens = 0

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's index; add its output to the recent ones (evicting the oldest past the cap)."""
        local = self._local.pop(seq.seq_id, None)
        if local is None or not local.options.global_outputs:
            return
        cap = local.options.global_cache_tokens
        output = seq.generated_ids[:cap]
        if output:
            self.recent.add(output)
            self.global_tokens += len(output)
        while self.global_tokens > cap:
            self.global_tokens -= self.recent.remove_oldest()
