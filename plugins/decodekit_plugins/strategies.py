"""Built-in search strategies: "sample" (greedy when temperature is 0, else sampling)."""

from __future__ import annotations

import torch

from decodekit import hookimpl, select_tokens
from decodekit.core.sequence import Sequence
from decodekit.strategy import StepContext, Strategy


class SampleStrategy(Strategy):
    """One token per sequence per step: the processed argmax (temperature 0) or a seeded sample."""

    name = "sample"

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        logits = ctx.process(logits, seqs)
        greedy = [s.request.params.greedy for s in seqs]
        tokens = select_tokens(logits, greedy, [s.generator for s in seqs]).tolist()
        for seq, token in zip(seqs, tokens):
            ctx.append_token(seq, token)


@hookimpl
def decodekit_register_strategies(register):  # type: ignore[no-untyped-def]
    """Register the built-in strategies."""
    register(SampleStrategy.name, SampleStrategy)
