"""The search-strategy contract: how a request turns scores into tokens.

The engine gives each strategy the rows of this step's logits that belong to its requests. The default strategy
("sample") processes the rows and appends one token per sequence. Other strategies (beam search, parallel
sampling, speculative decoding) use the same context to fork, free or roll back sequences.
"""

from __future__ import annotations

from typing import Protocol

import torch

from decodekit.core.sequence import Sequence
from decodekit.processors import BatchView


class StepContext(Protocol):
    """What the engine offers a strategy during one step."""

    def batch_view(self, seqs: list[Sequence]) -> BatchView:
        """The processors' view of these sequences (params and histories)."""
        ...

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply each request's processors, in order, to rows of `logits` (one row per sequence)."""
        ...

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Append a token to a sequence; stopping criteria run on it at the end of the step."""
        ...


class Strategy:
    """Base class of search strategies, built once per engine and called with every step's rows."""

    name: str = "strategy"

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Turn `logits` (`[len(seqs), vocab]`, raw model scores) into actions on `seqs` via `ctx`."""
        raise NotImplementedError
