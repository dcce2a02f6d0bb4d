"""Built-in sampling processors behind the `SamplingParams` fields: min-tokens, temperature, top-k, top-p, min-p.

Each can also be named in a recipe's `processors:` list with its own parameters. Parameters are read per row
from `batch.options`, so one batch mixes any settings; the math is vectorized over rows, with no loop over the
vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field

from decodekit import hookimpl
from decodekit.api.params import SamplingParams, StrictParams
from decodekit.api.processors import BatchView, LogitsProcessor
from decodekit.api.sampling import TINY_TEMPERATURE


class MinTokensProcessor(LogitsProcessor):
    """Forbid EOS and `stop_token_ids` until a row has generated `min_tokens` tokens.

    Example (recipe): `processors: [{min_tokens: {min_tokens: 8}}]`
    """

    name = "min_tokens"

    class Params(StrictParams):
        min_tokens: int = Field(ge=0, description="Tokens to generate before EOS / stop token ids are allowed.")

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> Params | None:
        return cls.Params(min_tokens=params.min_tokens) if params.min_tokens > 0 else None

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = logits
        for row, (params, options) in enumerate(zip(batch.params, batch.options)):
            if len(batch.generated_ids(row)) < options.min_tokens:
                banned = [t for t in (*batch.eos_token_ids, *params.stop_token_ids) if t < logits.shape[-1]]
                if banned and (not params.ignore_eos or params.stop_token_ids):
                    if out is logits:
                        out = logits.clone()
                    out[row, banned] = -float("inf")
        return out




class TemperatureProcessor(LogitsProcessor):
    """Divide logits by the row's temperature (argmax-invariant).

    Example (recipe): `processors: [{temperature: {temperature: 0.7}}]`
    """

    name = "temperature"
    argmax_invariant = True

    class Params(StrictParams):
        temperature: float = Field(gt=0.0, description="Divide logits by this (below 1 sharpens).")

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> Params | None:
        t = params.temperature
        return None if t in (0.0, 1.0) else cls.Params(temperature=t)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        temperature = batch.option_tensor("temperature", logits.dtype).to(logits.device)[:, None]
        out = logits / temperature
        tiny = [row for row, options in enumerate(batch.options) if options.temperature < TINY_TEMPERATURE]
        if tiny:
            # logits / 1e-38 overflows to +inf and softmax turns the row into NaN. Shifted by the row's maximum
            # first, the top token gets 0 and the others tend to -inf: the same distribution, the limit it
            # approaches, and no overflow (transformers divides as above; vLLM switches such rows to greedy).
            idx = torch.tensor(tiny, device=logits.device)
            rows = logits.index_select(0, idx)
            floor = torch.finfo(logits.dtype).tiny  # 1e-300 is 0 in float32: 0 / 0 would be NaN again
            shifted = (rows - rows.amax(dim=-1, keepdim=True)) / temperature.index_select(0, idx).clamp_min(floor)
            out = out.index_copy(0, idx, shifted)
        return out


class TopKProcessor(LogitsProcessor):
    """Keep tokens whose logit is at least the row's k-th largest (ties kept).

    Example (recipe): `processors: [{top_k: {top_k: 40}}]`
    """

    name = "top_k"
    argmax_invariant = True

    class Params(StrictParams):
        top_k: int = Field(ge=1, description="How many of the most likely tokens to keep (ties kept).")

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> Params | None:
        return cls.Params(top_k=params.top_k) if params.top_k > 0 else None

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        k = batch.option_tensor("top_k", torch.long).to(logits.device).clamp(max=logits.shape[-1])
        largest = min(max(o.top_k for o in batch.options), logits.shape[-1])  # from the host: no device sync
        kth = logits.topk(largest, dim=-1).values.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, -float("inf"))


class TopPProcessor(LogitsProcessor):
    """Keep the smallest set of most likely tokens whose probability reaches the row's `top_p`.

    Example (recipe): `processors: [{top_p: {top_p: 0.9}}]`
    """

    name = "top_p"
    argmax_invariant = True

    class Params(StrictParams):
        top_p: float = Field(gt=0.0, le=1.0, description="Probability mass to keep.")

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> Params | None:
        return cls.Params(top_p=params.top_p) if params.top_p < 1.0 else None

    #: candidate counts tried, in order, before a row falls back to a full sort of the vocabulary
    CANDIDATES: tuple[int, ...] = (256, 4096)
    #: how far from p the masses around a candidate result's edge must be for it to stand (float32 sums over a
    #: 49k vocabulary drift by ~1e-5 in practice)
    EDGE_MARGIN = 1e-4

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        top_p = batch.option_tensor("top_p", logits.dtype).to(logits.device)[:, None]
        out = logits
        pending = torch.arange(logits.shape[0], device=logits.device)
        # The cascade decides per row on the host; on an accelerator a full sort is cheap and needs no sync.
        for count in self.CANDIDATES if logits.device.type == "cpu" else ():
            if count >= logits.shape[-1] or pending.numel() == 0:
                break
            rows = logits if pending.numel() == logits.shape[0] else logits.index_select(0, pending)
            masked, exact = self._from_candidates(rows, top_p.index_select(0, pending), count)
            if bool(exact.all()) and pending.numel() == logits.shape[0]:
                return masked
            done = pending[exact]
            out = out.index_copy(0, done, masked[exact]) if done.numel() else out
            pending = pending[exact.logical_not()]
        if pending.numel() == 0:
            return out
        rows = logits.index_select(0, pending)
        # transformers' own computation, so that a mass within rounding of p decides exactly as it does: an
        # ascending sort, a cumulative sum from the least likely token, a token dropped while the mass up to it is
        # <= 1 - p (with 1 - p taken in double precision, as transformers' Python float is), the most likely kept
        # (tied values sort lowest index last, so a tie at the edge keeps the argmax; ties add equal terms, so the
        # sums are transformers' whatever order its unstable sort gives them)
        sorted_logits, flipped = rows.flip(-1).sort(dim=-1, stable=True)
        order = rows.shape[-1] - 1 - flipped
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        rest = torch.tensor([1.0 - o.top_p for o in batch.options], dtype=torch.float64)
        drop_sorted = cumulative <= rest.to(logits.device, logits.dtype).index_select(0, pending)[:, None]
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return out.index_copy(0, pending, rows.masked_fill(drop, -float("inf")))

    @staticmethod
    def _from_candidates(logits: torch.Tensor, top_p: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The result from the `count` most likely candidates, and which rows it is exact for.

        A full sort of a 49k vocabulary per row dominates a decode step at batch 32 (~150 ms here vs ~7 ms for
        `topk(256)`); the kept set is usually a few dozen tokens. Candidates are ordered exactly as the stable full
        sort would (value descending, then index), and a row's result is exact when its kept set ends strictly
        above the smallest candidate value, so ties cut off by `topk` cannot matter, and the masses around its edge
        are farther from p than float32 rounding of a vocabulary-long sum could move them (`EDGE_MARGIN`), so
        transformers' ascending sum decides the same way; other rows go to the full computation.
        """
        values, index = logits.topk(count, dim=-1)
        index, by_index = index.sort(dim=-1)  # index order first, so the stable value sort breaks ties by index
        values, order = values.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
        index = index.gather(1, order)
        probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
        before = probs.cumsum(dim=-1) - probs  # the mass of the tokens ahead of each candidate
        keep = before < top_p
        num_kept = keep.sum(dim=-1, keepdim=True)
        last_kept = values.gather(1, (num_kept - 1).clamp(min=0))
        margin = torch.minimum(top_p - before.gather(1, (num_kept - 1).clamp(min=0)),
                               before.gather(1, num_kept.clamp(max=count - 1)) - top_p)
        exact = (keep[:, -1:].logical_not() & (last_kept > values[:, -1:]) & (margin > TopPProcessor.EDGE_MARGIN))[:, 0]
        drop = torch.ones_like(logits, dtype=torch.bool).scatter(1, index, keep.logical_not())
        return logits.masked_fill(drop, -float("inf")), exact


class MinPProcessor(LogitsProcessor):
    """Keep tokens with probability at least `min_p` times the row's most likely token's.

    Example (recipe): `processors: [{min_p: {min_p: 0.05}}]`
    """

    name = "min_p"
    argmax_invariant = True

    class Params(StrictParams):
        min_p: float = Field(gt=0.0, le=1.0, description="Keep tokens with p >= min_p * p_max.")

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> Params | None:
        return cls.Params(min_p=params.min_p) if params.min_p > 0.0 else None

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        min_p = batch.option_tensor("min_p", logits.dtype).to(logits.device)[:, None]
        threshold = probs.max(dim=-1, keepdim=True).values * min_p
        return logits.masked_fill(probs < threshold, -float("inf"))


@hookimpl
def decodekit_register_processors(register: Callable[..., None]) -> None:
    """Register the built-in sampling processors, in the order they run after any listed processors."""
    for proc in (MinTokensProcessor, TemperatureProcessor, TopKProcessor, TopPProcessor, MinPProcessor):
        register(proc.name, proc, default=True)
