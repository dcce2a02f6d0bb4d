"""Catalogue penalties: repetition (transformers), presence and frequency (OpenAI/vLLM), no-repeat-n-gram
(transformers) and DRY (llama.cpp).

None of them is on by default: a request or recipe names them in its `processors:` list. Histories are host
lists, so the matching (n-grams, DRY) runs on CPU tensors and only the resulting penalties travel to the logits'
device: no host sync per token.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field, StringConstraints

from decodekit import hookimpl
from decodekit.api.params import StrictParams
from decodekit.api.processors import NEG_INF, BatchView, LogitsProcessor


def occurrences(seqs: Sequence[Sequence[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each distinct (row, token id) of the rows' ids: `(row, flat index row * vocab + id, count)`, CPU tensors.

    Only the tokens that occur are touched, never a `[rows, vocab]` table: at batch 32 and a 49k vocabulary a
    masked `torch.where` over the whole table costs more than the rest of the penalty. Ids >= vocab (an embedding
    larger than the LM head) are skipped: the model cannot produce them.
    """
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    keep = ids < vocab
    flat, counts = torch.unique(rows[keep] * vocab + ids[keep], return_counts=True)
    return flat // vocab, flat, counts


def _penalized(logits: torch.Tensor, flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `logits` with the entries at `flat` indices (on its device) replaced by `values`."""
    out = logits.clone(memory_format=torch.contiguous_format)
    out.view(-1)[flat] = values
    return out


def _on_device(batch: BatchView, rows: torch.Tensor, flat: torch.Tensor,
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flat indices, the logits there, and each entry's row's `penalty`, on the logits' device."""
    flat = flat.to(logits.device)
    penalty = batch.option_tensor("penalty", logits.dtype).to(logits.device)[rows.to(logits.device)]
    return flat, logits.reshape(-1)[flat], penalty


def _generated(batch: BatchView) -> list[list[int]]:
    return [batch.generated_ids(r) for r in range(len(batch))]


class RepetitionPenaltyProcessor(LogitsProcessor):
    """Divide positive / multiply negative logits of every token in the history, prompt included (transformers'
    `RepetitionPenaltyLogitsProcessor`; CTRL paper). Each token is penalized once, however often it occurred.

    Example (recipe): `processors: [{repetition_penalty: {penalty: 1.2}}]`
    """

    name = "repetition_penalty"
    example: ClassVar[dict[str, Any]] = {"penalty": 1.5}

    class Params(StrictParams):
        penalty: float = Field(gt=0.0, description="Above 1 discourages repeats, below 1 encourages them.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        flat, seen, penalty = _on_device(batch, *occurrences(batch.histories, logits.shape[-1])[:2], logits)
        return _penalized(logits, flat, torch.where(seen < 0, seen * penalty, seen / penalty))


class PresencePenaltyProcessor(LogitsProcessor):
    """Subtract `penalty` from the logit of every token generated so far (OpenAI/vLLM; the prompt does not count).

    Example (recipe): `processors: [{presence_penalty: {penalty: 0.5}}]`
    """

    name = "presence_penalty"
    example: ClassVar[dict[str, Any]] = {"penalty": 1.0}

    class Params(StrictParams):
        penalty: float = Field(ge=-2.0, le=2.0, description="Subtracted once per generated token id (OpenAI range).")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        flat, present, penalty = _on_device(batch, *occurrences(_generated(batch), logits.shape[-1])[:2], logits)
        return _penalized(logits, flat, present - penalty)


class FrequencyPenaltyProcessor(LogitsProcessor):
    """Subtract `penalty` times its count from the logit of every generated token (OpenAI/vLLM; prompt excluded).

    Example (recipe): `processors: [{frequency_penalty: {penalty: 0.5}}]`
    """

    name = "frequency_penalty"
    example: ClassVar[dict[str, Any]] = {"penalty": 0.8}

    class Params(StrictParams):
        penalty: float = Field(ge=-2.0, le=2.0, description="Subtracted per occurrence in the generated tokens.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        rows, flat, counts = occurrences(_generated(batch), logits.shape[-1])
        flat, present, penalty = _on_device(batch, rows, flat, logits)
        return _penalized(logits, flat, present - penalty * counts.to(logits.device, logits.dtype))


def _right_aligned(seqs: Sequence[Sequence[int]], pad: int = -1) -> torch.Tensor:
    """`[rows, longest]` CPU long tensor, each row's ids at the right end (so every row ends at the last column)."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, ids in enumerate(seqs):
        if ids:
            out[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
    return out


def _ban(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    keep = tokens < logits.shape[-1]
    if not bool(keep.any()):  # CPU tensors: no device sync
        return logits
    index = (rows[keep].to(logits.device), tokens[keep].to(logits.device))
    return logits.index_put(index, torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))


class NoRepeatNGramProcessor(LogitsProcessor):
    """Forbid any token that would complete an n-gram already in the history, prompt included (transformers'
    `NoRepeatNGramLogitsProcessor`). With `ngram_size: 1` every token of the history is forbidden.

    Example (recipe): `processors: [{no_repeat_ngram: {ngram_size: 3}}]`
    """

    name = "no_repeat_ngram"
    example: ClassVar[dict[str, Any]] = {"ngram_size": 2}

    class Params(StrictParams):
        ngram_size: int = Field(ge=1, description="Length of the n-grams that may occur only once.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        groups: dict[int, list[int]] = defaultdict(list)
        for row, options in enumerate(batch.options):
            groups[options.ngram_size].append(row)
        all_rows, all_tokens = [], []
        for n, rows in groups.items():
            seqs = [batch.histories[r] for r in rows]
            ids = _right_aligned(seqs)
            lengths = torch.tensor([len(s) for s in seqs])
            width = ids.shape[1]
            if width < n:
                continue
            windows = ids.unfold(1, n, 1)  # [rows, width - n + 1, n]; the last n - 1 tokens are the prefix
            matches = (windows[..., :-1] == ids[:, width - n + 1 :][:, None, :]).all(dim=-1)
            # a window is real when it starts inside the row (the prefix's own window would need one token more)
            matches &= torch.arange(windows.shape[1])[None, :] >= width - lengths[:, None]
            r, w = matches.nonzero(as_tuple=True)
            all_rows.append(torch.tensor(rows, dtype=torch.long)[r])
            all_tokens.append(windows[r, w, -1])
        if not all_rows:
            return logits
        return _ban(logits, torch.cat(all_rows), torch.cat(all_tokens))


# llama.cpp's limits on sequence breakers: characters per breaker, tokens per breaker tail
_MAX_BREAKER_CHARS = 40
_MAX_TAIL_TOKENS = 20
_FLOAT_MAX_LOG = 88.7228391


@dataclass(frozen=True)
class _Breakers:
    """Processed sequence breakers: single tokens, and multi-token sequences (head then tail)."""

    single: torch.Tensor
    multi: tuple[tuple[int, ...], ...]


class DryProcessor(LogitsProcessor):
    """DRY, "don't repeat yourself" (llama.cpp's semantics): penalize a token that would extend a repeat of a
    sequence already in the last `penalty_last_n` tokens, by `multiplier * base ** (length - allowed_length)`.

    A repeat is not followed across a sequence breaker: strings (like llama.cpp, every token whose text contains
    the string, or ends with a prefix of it followed by the rest's tokenization, is a breaker; needs the engine's
    tokenizer) or token-id sequences (`sequence_breaker_ids`, no tokenizer needed). Single-token breakers are
    never penalized.

    Example (recipe): `processors: [{dry: {multiplier: 0.8, base: 1.75, allowed_length: 2}}]`
    """

    name = "dry"
    example: ClassVar[dict[str, Any]] = {"multiplier": 2.0, "allowed_length": 1, "sequence_breakers": []}

    class Params(StrictParams):
        multiplier: float = Field(0.8, ge=0.0, description="Penalty scale; 0 turns DRY off.")
        base: float = Field(1.75, ge=1.0, description="Growth of the penalty per token of repeat length.")
        allowed_length: int = Field(2, ge=1, description="Repeats up to this length are not penalized.")
        penalty_last_n: int = Field(-1, ge=-1, description="How many last tokens to scan; -1: the whole history.")
        sequence_breakers: list[Annotated[str, StringConstraints(min_length=1, max_length=_MAX_BREAKER_CHARS)]] = (
            Field(default_factory=lambda: ["\n", ":", '"', "*"], description="Strings that end a repeat."))
        sequence_breaker_ids: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = Field(
            default_factory=list, description="Token-id sequences that end a repeat.")

    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._pieces: list[str] | None = None
        self._cache: dict[tuple[Any, ...], _Breakers] = {}

    def setup(self, info: Any) -> None:
        """Keep the engine's tokenizer for string sequence breakers."""
        self._tokenizer = info.tokenizer

    def check_options_with(self, options: Any, info: Any) -> None:
        """Inside an engine: refuse string breakers without a tokenizer; process the breakers now (a scan of the
        vocabulary, once per distinct set), not at the request's first token. A recipe check accepts them."""
        if options.sequence_breakers and info.tokenizer is None:
            raise ValueError("`sequence_breakers` strings need a tokenizer; give `sequence_breaker_ids` instead")
        self._breakers(options)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for row, o in enumerate(batch.options):
            if o.multiplier > 0 and o.penalty_last_n != 0:
                groups[_key(o)].append(row)
        rows, tokens, penalties = [], [], []
        for rs in groups.values():
            breakers = self._breakers(batch.options[rs[0]])
            r, t, p = _dry_penalties([batch.histories[i] for i in rs], [batch.options[i] for i in rs], breakers)
            rows.append(torch.tensor(rs, dtype=torch.long)[r])
            tokens.append(t)
            penalties.append(p)
        if not rows:
            return logits
        all_rows, all_tokens, all_penalties = torch.cat(rows), torch.cat(tokens), torch.cat(penalties)
        keep = all_tokens < logits.shape[-1]
        index = (all_rows[keep].to(logits.device), all_tokens[keep].to(logits.device))
        return logits.index_put(index, -all_penalties[keep].to(logits.device, logits.dtype), accumulate=True)

    def _breakers(self, options: Any) -> _Breakers:
        key = _key(options)
        if key not in self._cache:
            sequences = {tuple(ids) for ids in options.sequence_breaker_ids}
            for text in options.sequence_breakers:
                sequences |= self._string_breakers(text)
            single = sorted(s[0] for s in sequences if len(s) == 1)
            self._cache[key] = _Breakers(torch.tensor(single, dtype=torch.long),
                                         tuple(sorted(s for s in sequences if len(s) > 1)))
        return self._cache[key]

    def _string_breakers(self, text: str) -> set[tuple[int, ...]]:
        """llama.cpp's `get_overlapping_token_sequences`: once per distinct breaker string, at plan time."""
        if self._tokenizer is None:
            raise ValueError("`sequence_breakers` strings need a tokenizer; give `sequence_breaker_ids` instead")
        if self._pieces is None:
            ids = [[i] for i in range(len(self._tokenizer))]
            self._pieces = self._tokenizer.batch_decode(ids, clean_up_tokenization_spaces=False)
        found: set[tuple[int, ...]] = set()
        for token, piece in enumerate(self._pieces):
            if text in piece:
                found.add((token,))
                continue
            for k in range(1, len(text)):  # the token ends with the first k characters of the breaker
                if piece.endswith(text[:k]):
                    tail = self._tokenizer.encode(text[k:], add_special_tokens=False)[:_MAX_TAIL_TOKENS]
                    found.add((token, *tail))
        return found


def _key(options: Any) -> tuple[Any, ...]:
    return tuple(options.sequence_breakers), tuple(tuple(s) for s in options.sequence_breaker_ids)


def _dry_penalties(histories: list[list[int]], options: list[Any],
                   breakers: _Breakers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DRY for rows sharing breakers: `(row, token, penalty)` CPU tensors, one entry per penalized token."""
    windows = [h if o.penalty_last_n < 0 else h[len(h) - min(len(h), o.penalty_last_n) :]
               for h, o in zip(histories, options)]
    ids = _right_aligned(windows)
    num_rows, width = ids.shape
    lengths = torch.tensor([len(w) for w in windows])
    allowed = torch.tensor([o.allowed_length for o in options])
    empty = (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.empty(0))
    if width < 2:
        return empty
    # Step 1 (llama.cpp): the breaker closest to the end caps the repeat length at the tokens after it; of breakers
    # sharing that head position the longest wins. Encode (head position, length) as one comparable number.
    radix = 1 + max((len(s) for s in breakers.multi), default=1)
    position = torch.arange(width)
    best = torch.full((num_rows,), -1, dtype=torch.long)
    if len(breakers.single):
        best = torch.where(torch.isin(ids, breakers.single), position * radix + 1, -1).amax(dim=-1)
    for seq in breakers.multi:
        span = width - len(seq) + 1
        if span <= 0:
            continue
        match = torch.ones(num_rows, span, dtype=torch.bool)
        for offset, breaker_token in enumerate(seq):
            match &= ids[:, offset : offset + span] == breaker_token
        best = torch.maximum(best, torch.where(match, position[:span] * radix + len(seq), -1).amax(dim=-1))
    rep_limit = torch.where(best >= 0, width - best // radix - best % radix, lengths)
    active = (lengths > allowed) & (rep_limit >= allowed)
    # Step 2: for each position j, the longest common suffix of the history up to j and the whole history
    # (llama.cpp computes it with a reversed Z-algorithm), capped at rep_limit. Column j compares ids[j - d] with
    # ids[last - d] for d = 0, 1, ... while any row still matches.
    counts = torch.zeros(num_rows, width - 1, dtype=torch.long)
    alive = (ids[:, :-1] >= 0) & active[:, None]
    for d in range(width - 1):
        last = ids[:, width - 1 - d]
        equal = torch.zeros(num_rows, width - 1, dtype=torch.bool)
        equal[:, d:] = ids[:, : width - 1 - d] == last[:, None]
        alive &= equal & ((last >= 0) & (d < rep_limit))[:, None]
        if not bool(alive.any()):
            break
        counts += alive
    # Step 3: the token after each long-enough match would extend the repeat; keep each token's longest.
    r, j = (counts >= allowed[:, None]).nonzero(as_tuple=True)
    token, length = ids[r, j + 1], counts[r, j]
    if len(breakers.single):
        keep = ~torch.isin(token, breakers.single)
        r, token, length = r[keep], token[keep], length[keep]
    if len(r) == 0:
        return empty
    stride = int(token.max()) + 1
    unique, inverse = torch.unique(r * stride + token, return_inverse=True)
    longest = torch.zeros(len(unique), dtype=torch.long).scatter_reduce(0, inverse, length, "amax", include_self=False)
    r, token = unique // stride, unique % stride
    # Step 4: multiplier * base ** (length - allowed_length), the exponent capped so the penalty stays finite
    multiplier = torch.tensor([o.multiplier for o in options], dtype=torch.float64)[r]
    base = torch.tensor([o.base for o in options], dtype=torch.float64)[r]
    cap = torch.tensor([int(_FLOAT_MAX_LOG / math.log(o.base)) if o.base > 1.000001 else 0 for o in options])[r]
    exponent = longest - allowed[r]
    exponent = torch.where((cap > 0) & (exponent > cap), cap, exponent)
    return r, token, (multiplier * base.pow(exponent)).float()


@hookimpl
def decodekit_register_processors(register: Callable[..., None]) -> None:
    """Register the catalogue penalties (used only when a request or recipe names them)."""
    for proc in (RepetitionPenaltyProcessor, PresencePenaltyProcessor, FrequencyPenaltyProcessor,
                 NoRepeatNGramProcessor, DryProcessor):
        register(proc.name, proc)
