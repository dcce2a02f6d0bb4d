"""Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation"), written only against
decodekit's public strategy hooks.

Each step the `top_k` most likely next tokens (after the request's processors) are candidates; each is scored by
`(1 - penalty_alpha) * p(token) - penalty_alpha * max cos(h_token, h_j)`, where `h_token` is the candidate's last
hidden state and `h_j` runs over the hidden states of every earlier token, prompt included (the degeneration
penalty); the best candidate is appended. It uses two hooks: `hidden_states = True` (the engine hands over the
last hidden states of every position it computes for the request) and `StepContext.score_candidates`, which runs
the `top_k` candidates as `top_k` rows of the next forward, sharing the sequence's KV blocks; the accepted
candidate keeps its key and value and its row is the next position's scores, so a step costs one forward of
`top_k` rows, as in transformers' implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from decodekit import hookimpl
from decodekit.api.params import SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.sequence import Sequence
from decodekit.api.stash import StashKey
from decodekit.api.strategy import StepContext, Strategy, TokenDistribution


class ContrastiveSearchParams(BaseModel):
    """Parameters of the `contrastive_search` strategy (transformers' names)."""

    model_config = ConfigDict(extra="forbid")

    penalty_alpha: float = Field(0.6, ge=0.0, le=1.0,
                                 description="Weight of the degeneration penalty (0: greedy over the candidates).")
    top_k: int = Field(4, ge=1, le=64, description="Candidates scored per step.")


@dataclass
class _Search:
    """One sequence's search state: the hidden state of each of its tokens, and its candidates' probabilities."""

    context: torch.Tensor  # [positions, hidden]
    candidate_probs: torch.Tensor | None = None  # [candidates], the probability of each candidate scored next


_SEARCH = StashKey[_Search]()


class ContrastiveSearchStrategy(Strategy):
    """Contrastive search: `strategy: {contrastive_search: {penalty_alpha: 0.6, top_k: 4}}`.

    Deterministic (no sampling); the request's processors shape the candidates' probabilities, so with the default
    sampling parameters it is transformers' `generate(penalty_alpha=..., top_k=...)`.
    """

    name = "contrastive_search"
    Params = ContrastiveSearchParams
    scores = "logits"
    hidden_states = True

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        if params.n != 1:
            raise ValueError(f"contrastive search returns one sequence; n must be 1, got {params.n}")

    def token_distribution(self, options: BaseModel | None, params: SamplingParams) -> TokenDistribution:
        """Each token is the best-scoring candidate: no sampling."""
        return "deterministic"

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        # each candidate is a row of the forward, as a sequence is: admission reserves room for them
        assert isinstance(options, ContrastiveSearchParams)
        return options.top_k

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        counts = [seq.num_scored_positions for seq in seqs]  # before any action changes them
        start = 0
        for seq, count in zip(seqs, counts):
            rows = logits[start : start + count]
            start += count
            options = seq.request.plan.strategy_options
            hidden = ctx.hidden_states(seq)
            if hidden is None:
                raise RuntimeError("contrastive search got no hidden states for a scored sequence")
            if hidden.candidates:
                search = seq.stash[_SEARCH]
                assert search.candidate_probs is not None
                chosen = _rank(search.context, hidden.states, search.candidate_probs, options.penalty_alpha)
                ctx.accept_candidate(seq, chosen)
                search.context = torch.cat([search.context[: hidden.start], hidden.states[chosen : chosen + 1]])
                row = rows[chosen]
            else:  # the prompt (or everything, after a preemption) was computed: its hidden states start over
                previous = seq.stash.get(_SEARCH, None)
                context = hidden.states if previous is None or hidden.start == 0 else torch.cat(
                    [previous.context[: hidden.start], hidden.states])
                search = _Search(context)
                seq.stash[_SEARCH] = search
                row = rows[-1]
            if seq.finished or seq.request.finished:
                continue
            probs = torch.softmax(row.float(), dim=-1)
            top_probs, top_ids = torch.topk(probs, k=min(options.top_k, probs.shape[-1]))
            # a token the request's processors removed (probability 0) is never a candidate: the degeneration
            # penalty could otherwise make it win (a constrained output would break)
            allowed = top_probs > 0
            allowed[0] = True
            search.candidate_probs = top_probs[allowed]
            ctx.score_candidates(seq, top_ids[allowed].tolist())


def _rank(context: torch.Tensor, candidates: torch.Tensor, probs: torch.Tensor, alpha: float) -> int:
    """The index of the best candidate: model confidence minus the degeneration penalty (the largest cosine
    similarity between the candidate's hidden state and any earlier token's)."""
    context = context.float()
    candidates = candidates.float()
    norm_context = context / context.norm(dim=-1, keepdim=True)
    norm_candidates = candidates / candidates.norm(dim=-1, keepdim=True)
    penalty = (norm_candidates @ norm_context.T).max(dim=-1).values
    scores = (1.0 - alpha) * probs - alpha * penalty
    return int(scores.argmax())


@hookimpl
def decodekit_register_strategies(register: Callable[..., None]) -> None:
    """Register `contrastive_search`."""
    register(ContrastiveSearchStrategy.name, ContrastiveSearchStrategy)
