"""Catalogue biases and masks: logit bias (by token id or by string), bad words, allowed token ids.

None of them is on by default: a request or recipe names them in its `processors:` list. (`min_tokens`, which
suppresses EOS until a row has generated enough tokens, is a built-in in `sampling.py`.) Strings are turned into
token ids with the engine's tokenizer, given to `setup`, once per distinct string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field

from decodekit import hookimpl
from decodekit.api.params import StrictParams
from decodekit.api.processors import NEG_INF, BatchView, LogitsProcessor

TokenId = Annotated[int, Field(ge=0)]


class _UsesTokenizer(LogitsProcessor):
    """Keeps the engine's tokenizer (from `setup`) and caches string tokenizations.

    Token ids and strings are checked against the engine in `check_options_with`, which runs only inside an engine
    (after `setup`): a recipe check, with no tokenizer and no vocabulary, accepts them, and the engine refuses the
    request that names a token past its vocabulary.
    """

    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._encoded: dict[str, list[list[int]]] = {}

    def setup(self, info: Any) -> None:
        """Keep the tokenizer: strings are tokenized with it, once each."""
        self._tokenizer = info.tokenizer

    @staticmethod
    def _check_ids(ids: list[int], what: str, vocab_size: int) -> None:
        if vocab_size and any(t >= vocab_size for t in ids):
            raise ValueError(f"{what} must be below the vocabulary size {vocab_size}, "
                             f"got {sorted(t for t in ids if t >= vocab_size)}")

    def _check_strings(self, strings: list[str], what: str, info: Any) -> None:
        if strings and info.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer; give token ids instead")
        for text in strings:  # tokenized now (and cached), not at the request's first token
            self._check_ids([t for ids in self._encode(text) for t in ids], what, info.vocab_size)

    def _encode(self, text: str) -> list[list[int]]:
        if text not in self._encoded:
            if self._tokenizer is None:
                raise ValueError(f"cannot tokenize {text!r}: the processor has no tokenizer (give token ids)")
            self._encoded[text] = self._tokenizations(text)
        return self._encoded[text]

    def _tokenizations(self, text: str) -> list[list[int]]:
        return [list(self._tokenizer.encode(text, add_special_tokens=False))]


class LogitBiasProcessor(_UsesTokenizer):
    """Add a bias to chosen tokens' logits, named by id (`bias`) or by string (`bias_strings`).

    A string's bias goes to every token of its tokenization, added once per occurrence (llama.cpp server's
    string logit bias). Biases lie in [-100, 100] as in OpenAI's API; -100 all but bans a token.

    Example (recipe): `processors: [{logit_bias: {bias: {"123": -100}, bias_strings: {" hello": 5}}}]`
    """

    name = "logit_bias"
    example: ClassVar[dict[str, Any]] = {"bias": {str(i): 4.0 for i in range(40, 48)}}

    class Params(StrictParams):
        bias: dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
            default_factory=dict, description="Token id -> bias added to its logit.")
        bias_strings: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
            default_factory=dict, description="String -> bias added to each token of its tokenization.")

    def check_options_with(self, options: Any, info: Any) -> None:
        """Token ids must be in the engine's vocabulary; strings need its tokenizer."""
        self._check_ids(list(options.bias), "`bias` token ids", info.vocab_size)
        self._check_strings(list(options.bias_strings), "`bias_strings`", info)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for row, options in enumerate(batch.options):
            for token, value in options.bias.items():
                rows.append(row)
                tokens.append(token)
                values.append(value)
            for text, value in options.bias_strings.items():
                for token in self._encode(text)[0]:
                    rows.append(row)
                    tokens.append(token)
                    values.append(value)
        if not rows:
            return logits
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


class BadWordsProcessor(_UsesTokenizer):
    """Forbid token sequences: the last token of a bad word is banned when the history (prompt included) ends with
    the rest of it; one-token bad words are always banned (transformers' `NoBadWordsLogitsProcessor`, which also
    ignores a one-token bad word that is an EOS id, so a request can still end).

    `words` are strings, each tokenized as written and with a leading space (vLLM's `bad_words`), so a word is
    banned at the start of the text and after a space.

    Example (recipe): `processors: [{bad_words: {words: ["darn"], words_ids: [[1, 2], [3]]}}]`
    """

    name = "bad_words"
    example: ClassVar[dict[str, Any]] = {"words_ids": [[i] for i in range(40, 200)]}

    class Params(StrictParams):
        words_ids: list[Annotated[list[TokenId], Field(min_length=1)]] = Field(
            default_factory=list, description="Token-id sequences that must not be generated.")
        words: list[Annotated[str, Field(min_length=1)]] = Field(
            default_factory=list, description="Words that must not be generated (tokenized by the engine).")

    def check_options_with(self, options: Any, info: Any) -> None:
        """Token ids must be in the engine's vocabulary; strings need its tokenizer."""
        self._check_ids([t for ids in options.words_ids for t in ids], "`words_ids`", info.vocab_size)
        self._check_strings(options.words, "`words`", info)

    def _tokenizations(self, text: str) -> list[list[int]]:
        plain = list(self._tokenizer.encode(text, add_special_tokens=False))
        spaced = list(self._tokenizer.encode(" " + text.lstrip(), add_special_tokens=False))
        # vLLM keeps the spaced form only when the space makes a different first token of the same length
        return [plain, spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        rows: list[int] = []
        tokens: list[int] = []
        eos = {(t,) for t in batch.eos_token_ids}
        for row, options in enumerate(batch.options):
            history = batch.histories[row]
            sequences = [*options.words_ids, *(ids for word in options.words for ids in self._encode(word))]
            for ids in sequences:
                prefix = len(ids) - 1
                if tuple(ids) in eos or prefix > len(history):
                    continue
                if prefix == 0 or history[len(history) - prefix :] == ids[:-1]:
                    rows.append(row)
                    tokens.append(ids[-1])
        pairs = [(r, t) for r, t in zip(rows, tokens) if t < logits.shape[-1]]
        if not pairs:
            return logits
        device = logits.device
        index = (torch.tensor([r for r, _ in pairs], device=device), torch.tensor([t for _, t in pairs], device=device))
        return logits.index_put(index, torch.tensor(NEG_INF, dtype=logits.dtype, device=device))


class AllowedTokenIdsProcessor(_UsesTokenizer):
    """Allow only the listed token ids: every other logit becomes -inf (vLLM's `allowed_token_ids`).

    Example (recipe): `processors: [{allowed_token_ids: {token_ids: [11, 12, 13]}}]`
    """

    name = "allowed_token_ids"
    example: ClassVar[dict[str, Any]] = {"token_ids": list(range(40, 52))}

    class Params(StrictParams):
        token_ids: list[TokenId] = Field(min_length=1, description="The only token ids that may be generated.")

    def check_options_with(self, options: Any, info: Any) -> None:
        """Token ids must be in the engine's vocabulary."""
        self._check_ids(options.token_ids, "`token_ids`", info.vocab_size)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows = [r for r, options in enumerate(batch.options) for t in options.token_ids if t < vocab]
        tokens = [t for options in batch.options for t in options.token_ids if t < vocab]
        allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        allowed[torch.tensor(rows, dtype=torch.long, device=logits.device),
                torch.tensor(tokens, dtype=torch.long, device=logits.device)] = True
        return logits.masked_fill(~allowed, NEG_INF)


@hookimpl
def decodekit_register_processors(register: Callable[..., None]) -> None:
    """Register the catalogue biases and masks (used only when a request or recipe names them)."""
    for proc in (LogitBiasProcessor, BadWordsProcessor, AllowedTokenIdsProcessor):
        register(proc.name, proc)
