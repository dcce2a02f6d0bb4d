"""Best-of-n: sample `best_of` sequences and return the `n` most likely, ranked by cumulative log-probability
(vLLM's `best_of`), written only against decodekit's public strategy hooks.

The request's prompt is prefilled once; at its first token the sequence is forked into `best_of` sequences that
share the prompt's KV blocks (copy-on-write) and sample on their own (a seeded request's forks are seeded by the
engine). Each sequence's score is the sum of its tokens' log-probabilities, under the distribution they were drawn
from (`rank_by: processed`, vLLM's ranking) or the model's raw one (`rank_by: raw`). The ranking uses the
`finalize` hook: it runs after the engine's own stopping criteria ended every sequence, so stop strings, stop
token ids and the request's own criteria apply as for any other strategy; only the final output is streamed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from decodekit import hookimpl, select_tokens
from decodekit.api.params import SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.sequence import Request, Sequence
from decodekit.api.stash import StashKey
from decodekit.api.strategy import StepContext, Strategy, StrategyResult


class BestOfParams(BaseModel):
    """Parameters of the `best_of` strategy."""

    model_config = ConfigDict(extra="forbid")

    best_of: int = Field(2, ge=1, le=64, description="Sequences sampled; the `n` best are returned.")
    rank_by: Literal["processed", "raw"] = Field(
        "processed", description="Log-probabilities ranked: of the distribution sampled from (`processed`), or the "
                                 "model's (`raw`).")


_SCORE = StashKey[float]()


class BestOfStrategy(Strategy):
    """Sample `best_of` sequences, return the `n` with the highest cumulative log-probability, best first.

    Example (recipe): `sampling: {n: 2, temperature: 0.8}` with `strategy: {best_of: {best_of: 6}}`.
    """

    name = "best_of"
    Params = BestOfParams
    scores = "raw"
    finalizes = True

    def check_compatible(self, options: BaseModel | None, params: SamplingParams, stages: tuple[Stage, ...]) -> None:
        assert isinstance(options, BestOfParams)
        if options.best_of < params.n:
            raise ValueError(f"best_of ({options.best_of}) must be >= n ({params.n})")

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        assert isinstance(options, BestOfParams)
        return options.best_of

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        processed = ctx.process(logits, seqs)
        rows: list[int] = []
        targets: list[Sequence] = []
        for i, seq in enumerate(seqs):
            rows.append(i)
            targets.append(seq)
            best_of = seq.request.plan.strategy_options.best_of
            if seq.num_generated == 0 and len(seq.request.sequences) == 1:
                for _ in range(1, best_of):
                    rows.append(i)
                    targets.append(ctx.fork(seq))
        index = torch.tensor(rows, device=logits.device)
        chosen = select_tokens(processed[index], [s.greedy for s in targets], [s.generator for s in targets])
        raw_rank = [s.request.plan.strategy_options.rank_by == "raw" for s in targets]
        ranked = torch.where(torch.tensor(raw_rank, device=logits.device)[:, None], logits[index], processed[index])
        logprobs = torch.log_softmax(ranked.float(), dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        for seq, token, logprob in zip(targets, chosen.tolist(), logprobs):
            seq.stash[_SCORE] = seq.stash.get(_SCORE, 0.0) + logprob
            ctx.append_token(seq, token)

    def finalize(self, request: Request) -> list[StrategyResult]:
        ranked = sorted(request.sequences, key=lambda s: s.stash.get(_SCORE, float("-inf")), reverse=True)
        return [StrategyResult(seq.generated_ids, seq.finish_reason or "stop", seq.stash.get(_SCORE, None),
                               seq.stop_reason, sequence=seq)
                for seq in ranked[: request.params.n]]


@hookimpl
def decodekit_register_strategies(register: Callable[..., None]) -> None:
    """Register `best_of`."""
    register(BestOfStrategy.name, BestOfStrategy)
