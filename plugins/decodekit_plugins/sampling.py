"""Built-in sampling processors: min-tokens, temperature, top-k, top-p, min-p (the `SamplingParams` fields).

Each reads its parameter per row from the request's `SamplingParams`, so one batch mixes any settings; the math
is vectorized over rows, with no loop over the vocabulary.
"""

from __future__ import annotations

import torch

from decodekit import hookimpl
from decodekit.params import SamplingParams
from decodekit.processors import BatchView, LogitsProcessor


class MinTokensProcessor(LogitsProcessor):
    """Forbid EOS and `stop_token_ids` until a row has generated `min_tokens` tokens."""

    name = "min_tokens"

    def is_active(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits.clone()
        for row, params in enumerate(batch.params):
            if len(batch.generated_ids(row)) < params.min_tokens:
                banned = [t for t in (*batch.eos_token_ids, *params.stop_token_ids) if t < logits.shape[-1]]
                if not params.ignore_eos or params.stop_token_ids:
                    out[row, banned] = -float("inf")
        return out


class TemperatureProcessor(LogitsProcessor):
    """Divide logits by the row's temperature (argmax-invariant)."""

    name = "temperature"
    argmax_invariant = True

    def is_active(self, params: SamplingParams) -> bool:
        return params.temperature not in (0.0, 1.0)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        return logits / batch.param_tensor("temperature", logits.dtype)[:, None]


class TopKProcessor(LogitsProcessor):
    """Keep tokens whose logit is at least the row's k-th largest (ties kept)."""

    name = "top_k"
    argmax_invariant = True

    def is_active(self, params: SamplingParams) -> bool:
        return params.top_k > 0

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        k = batch.param_tensor("top_k", torch.long).clamp(max=logits.shape[-1])
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, -float("inf"))


class TopPProcessor(LogitsProcessor):
    """Keep the smallest set of most likely tokens whose probability reaches the row's `top_p`."""

    name = "top_p"
    argmax_invariant = True

    def is_active(self, params: SamplingParams) -> bool:
        return params.top_p < 1.0

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        top_p = batch.param_tensor("top_p", logits.dtype)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach p (the first token is always kept)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return logits.masked_fill(drop, -float("inf"))


class MinPProcessor(LogitsProcessor):
    """Keep tokens with probability at least `min_p` times the row's most likely token's."""

    name = "min_p"
    argmax_invariant = True

    def is_active(self, params: SamplingParams) -> bool:
        return params.min_p > 0.0

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * batch.param_tensor("min_p", logits.dtype)[:, None]
        return logits.masked_fill(probs < threshold, -float("inf"))


@hookimpl
def decodekit_register_processors(register):  # type: ignore[no-untyped-def]
    """Register the built-in sampling processors, in the order the engine applies them by default."""
    for proc in (MinTokensProcessor, TemperatureProcessor, TopKProcessor, TopPProcessor, MinPProcessor):
        register(proc.name, proc, default=True)
