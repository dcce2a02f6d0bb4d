"""Deliberately broken logits processors, each breaking one rule of the processor contract in a way a plugin author
could plausibly write, for `tests/processors/test_conformance.py` to prove that the conformance kit catches every one
of them.

`BROKEN` lists them with a strategy of their options and the pattern the kit's message must match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from pydantic import Field

from decodekit.api.params import StrictParams
from decodekit.api.processors import NEG_INF, BatchView, LogitsProcessor


class BanTokenInPlace(LogitsProcessor):
    """Bans one token id per row, writing -inf into the logits it is given without declaring `in_place = True`
    (the engine then hands it the tensor that the other stages and the logprobs read)."""

    name = "ban_token_in_place"

    class Params(StrictParams):
        token_id: int = Field(ge=0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        for row, options in enumerate(batch.options):
            logits[row, options.token_id] = NEG_INF
        return logits


class RandomTopDrop(LogitsProcessor):
    """With chance `probability`, removes the row's most likely token (an XTC-like sampler), drawing its coin from
    the global RNG (`torch.rand`) even for seeded rows, instead of `batch.generators[row]`: a seeded request's tokens
    then depend on whatever else ran before it."""

    name = "random_top_drop"

    class Params(StrictParams):
        probability: float = Field(ge=0.0, le=1.0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        finite = logits.isfinite().sum(dim=-1).tolist()
        for row, options in enumerate(batch.options):
            coin = float(torch.rand(()))  # the bug: ignores batch.generators[row]
            if coin < options.probability and finite[row] > 1:
                out[row, int(logits[row].argmax())] = NEG_INF
        return out


class ProbabilityFloor(LogitsProcessor):
    """Keeps the tokens whose probability is at least `floor`, and forgets to keep the most likely token: a flat
    row whose every probability is below the floor comes out with every logit -inf."""

    name = "probability_floor"

    class Params(StrictParams):
        floor: float = Field(gt=0.0, lt=1.0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        floor = batch.option_tensor("floor", logits.dtype).to(logits.device)[:, None]
        return logits.masked_fill(logits.softmax(dim=-1) < floor, NEG_INF)


@dataclass
class _Seen:
    """A sequence's tokens so far (prompt and accepted ones)."""

    tokens: set[int] = field(default_factory=set)


class SeenTokenPenalty(LogitsProcessor):
    """Subtracts `penalty` from every token the sequence has seen, keeping the seen set as per-sequence state; to
    cover the drafted tokens it adds them to the shared state inside `__call__`, so a rejected draft stays "seen"
    for the rest of the request (state must change only in `update_state`, on accepted tokens)."""

    name = "seen_token_penalty"
    stateful = True

    class Params(StrictParams):
        penalty: float = Field(ge=0.0, le=5.0)

    def init_state(self, options: Any, prompt_ids: list[int]) -> _Seen:
        """The prompt's tokens."""
        return _Seen(set(prompt_ids))

    def update_state(self, state: _Seen, options: Any, token_ids: list[int]) -> _Seen:
        """Add the accepted tokens."""
        state.tokens.update(token_ids)
        return state

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for row, (state, options, offset) in enumerate(zip(batch.states, batch.options, batch.draft_offsets)):
            if offset:
                state.tokens.update(batch.histories[row][-offset:])  # the bug: drafts written into the state
            seen = [t for t in state.tokens if t < logits.shape[-1]]
            out[row, seen] -= options.penalty
        return out


class Float32Temperature(LogitsProcessor):
    """Divides by the row's temperature read with `option_tensor("temperature")`, whose default dtype is float32:
    correct for float32 logits, but bfloat16 or float16 logits come back as float32 (and float64 ones stay float64
    only by luck of type promotion)."""

    name = "float32_temperature"

    class Params(StrictParams):
        temperature: float = Field(gt=0.05, le=5.0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        return logits / batch.option_tensor("temperature").to(logits.device)[:, None]  # the bug: no dtype given


class ClampLogits(LogitsProcessor):
    """Clamps logits to [-limit, limit] "to avoid overflow", which turns every -inf (a token an earlier processor
    removed) back into a finite -limit."""

    name = "clamp_logits"

    class Params(StrictParams):
        limit: float = Field(gt=0.0, le=100.0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        limit = batch.option_tensor("limit", logits.dtype).to(logits.device)[:, None]
        return torch.maximum(torch.minimum(logits, limit), -limit)


class EntropyScaled(LogitsProcessor):
    """Divides each row by (1 + its entropy), with the entropy taken as `-(p * log p).sum()`: a masked token gives
    `0 * -inf = NaN`, so every row with a -inf comes out NaN (`xlogy` or `nansum` would be right)."""

    name = "entropy_scaled"

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        entropy = -(probs * probs.log()).sum(dim=-1, keepdim=True)
        return logits / (1.0 + entropy)


class CenterLogits(LogitsProcessor):
    """Subtracts the mean finite logit, taken over the whole batch instead of per row (no `dim=-1`): a row's
    result depends on which other requests share its batch."""

    name = "center_logits"

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        return logits - logits[logits.isfinite()].mean()  # the bug: one mean for the whole batch


class ArgmaxInvariantPresencePenalty(LogitsProcessor):
    """A presence penalty (subtract `penalty` from every generated token) that declares `argmax_invariant`: a
    penalized top token can fall below the runner-up, and greedy rows would skip the penalty."""

    name = "presence_penalty_argmax_invariant"
    argmax_invariant = True

    class Params(StrictParams):
        penalty: float = Field(ge=0.0, le=2.0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for row, options in enumerate(batch.options):
            seen = [t for t in set(batch.generated_ids(row)) if t < logits.shape[-1]]
            out[row, seen] -= options.penalty
        return out


class LastTokenBoost(LogitsProcessor):
    """Boosts the last generated token, reading `generated_ids(row)[-1]`: an IndexError on a request's first token,
    when nothing is generated yet."""

    name = "last_token_boost"

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for row in range(len(batch)):
            token = batch.generated_ids(row)[-1]  # the bug: no generated token on the first step
            out[row, token] += 1.0
        return out


class TwoBugs(LogitsProcessor):
    """Breaks two rules in different cases: NaN on even vocabularies, a changed shape on odd ones."""

    name = "two_bugs"

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        if logits.shape[-1] % 2 == 0:
            return torch.full_like(logits, float("nan"))
        return logits[:, :-1].clone()


def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False)


BROKEN: list[tuple[LogitsProcessor, Any, str]] = [
    # the five the kit used to miss
    (BanTokenInPlace(), lambda v: st.builds(BanTokenInPlace.Params, token_id=st.integers(0, v - 1)),
     r"modified its input in place without declaring `in_place = True`"),
    (RandomTopDrop(), st.builds(RandomTopDrop.Params, probability=_floats(0.0, 1.0)),
     r"draws from the global RNG for seeded rows.*must draw from `batch\.generators\[row\]`"),
    (ProbabilityFloor(), st.builds(ProbabilityFloor.Params, floor=_floats(0.01, 0.99)),
     r"left a row with every logit -inf"),
    (SeenTokenPenalty(), st.builds(SeenTokenPenalty.Params, penalty=_floats(0.0, 5.0)),
     r"changed its state in `__call__`.*state changes belong in `update_state`"),
    (Float32Temperature(), st.builds(Float32Temperature.Params, temperature=_floats(0.1, 5.0)),
     r"changed the dtype: torch\.(bfloat16|float16) -> torch\.float32"),
    # four it always caught
    (ClampLogits(), st.builds(ClampLogits.Params, limit=_floats(1.0, 100.0)), r"re-inflated a masked \(-inf\) logit"),
    (EntropyScaled(), st.none(), r"produced NaN"),
    (CenterLogits(), st.none(), r"gives a different result batched than row by row"),
    (ArgmaxInvariantPresencePenalty(), st.builds(ArgmaxInvariantPresencePenalty.Params, penalty=_floats(0.0, 2.0)),
     r"declares argmax_invariant but changed the argmax"),
]
"""`(processor, options strategy or function of the vocabulary size, pattern of the kit's message)`."""
