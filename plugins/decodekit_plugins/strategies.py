"""Built-in search strategies: "sample" (greedy, sampling, n > 1 forks), "beam_search" and "speculative"."""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import BaseModel

from decodekit import hookimpl, select_tokens
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Sequence
from decodekit.api.strategy import StepContext, Strategy, TokenDistribution
from decodekit_plugins.beam_search import BeamSearchStrategy
from decodekit_plugins.eagle import EagleProposer
from decodekit_plugins.speculative import DraftModelProposer, NgramProposer, SpeculativeStrategy
from decodekit_plugins.suffix import SuffixProposer


class SampleStrategy(Strategy):
    """One token per sequence per step: the processed argmax (temperature 0) or a seeded sample.

    Parallel sampling: a request with `n > 1` prefills its prompt once; at its first token the sequence is forked
    into `n` sequences that share the prompt's KV blocks (copy-on-write) and each draws its own samples (seeded
    `seed + i` when the request has a seed).
    """

    name = "sample"
    scores = "logits"
    greedy_argmax = True  # a greedy sequence takes `select_tokens`' argmax and nothing else (forks: n > 1 only)
    plain_draw = True  # a sampled one takes `select_tokens`' draw from its processed row and nothing else

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        return params.n

    def token_distribution(self, options: BaseModel | None, params: SamplingParams) -> TokenDistribution:
        """Greedy picks the processed argmax; otherwise each token is drawn from the processed distribution."""
        return "deterministic" if params.greedy else "processed"

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows: list[int] = []
        targets: list[Sequence] = []
        for i, seq in enumerate(seqs):
            rows.append(i)
            targets.append(seq)
            params = seq.request.params
            if params.n > 1 and seq.num_generated == 0 and len(seq.request.sequences) == 1:
                for k in range(1, params.n):
                    child = ctx.fork(seq, seed=None if params.seed is None else params.seed + k)
                    rows.append(i)
                    targets.append(child)
        if len(rows) != len(seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens = select_tokens(logits, [s.greedy for s in targets], [s.generator for s in targets]).tolist()
        for seq, token in zip(targets, tokens):
            ctx.append_token(seq, token)


@hookimpl
def decodekit_register_strategies(register: Callable[..., None]) -> None:
    """Register the built-in strategies."""
    register(SampleStrategy.name, SampleStrategy)
    register(BeamSearchStrategy.name, BeamSearchStrategy)
    register(SpeculativeStrategy.name, SpeculativeStrategy)


@hookimpl
def decodekit_register_proposers(register: Callable[..., None]) -> None:
    """Register the built-in speculative-decoding proposers."""
    register(NgramProposer.name, NgramProposer)
    register(DraftModelProposer.name, DraftModelProposer)
    register(EagleProposer.name, EagleProposer)
    register(SuffixProposer.name, SuffixProposer)
