"""Scoring token ids under the plain model through the engine: each window runs as one prompt that asks for its
prompt logprobs (raw: the model's logits, none of a recipe's processors), all windows in one continuous batch.
`decodekit eval`'s loglikelihoods and `decodekit compare`'s perplexity and KL read them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Logprob, RequestOutput

SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
"""A scoring request: its prompt's logprobs (each token's own, with its rank) and one greedy token, not used."""


def score_tails(llm: Any, windows: Sequence[list[int]], tails: Sequence[int],
                on_output: Callable[[RequestOutput], None] | None = None) -> list[list[Logprob] | str]:
    """For each window, the logprob (and rank) of each of its last `tails[i]` tokens given the tokens before it; or,
    for a request the engine refused or failed (a window as long as the context), its error message.

    Each tail must leave at least one token before it (the first token of a window has no logprob)."""
    if not windows:
        return []
    outputs: list[RequestOutput] = llm.generate(list(windows), SCORE, on_output=on_output)
    scored: list[list[Logprob] | str] = []
    for window, tail, output in zip(windows, tails, outputs):
        if output.error is not None:
            scored.append(output.error)
            continue
        entries = (output.prompt_logprobs or [])[len(window) - tail:]
        tokens = window[len(window) - tail:]
        chosen = [entry[token] for entry, token in zip(entries, tokens) if entry is not None]
        scored.append(chosen if len(chosen) == tail else
                      f"the engine returned {len(chosen)} prompt logprobs for the last {tail} tokens")
    return scored
