"""Logprobs in the wire's shapes: chat's (`content` with `top_logprobs`), the legacy completions object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`; an echoed prompt's tokens first), and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from decodekit.api.sequence import RequestOutput, TokenLogprobs
from decodekit.serve.protocol import (
    NEG_INF_LOGPROB,
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)


def finite(value: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, a position with no row recorded) become `NEG_INF_LOGPROB`."""
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def _ranked(entry: TokenLogprobs) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda item: item[1].rank)


def _top(entry: TokenLogprobs, chosen: int, n: int) -> list[tuple[int, Any]]:
    """The `n` most likely tokens at a position (the chosen one only if it is among them)."""
    return [(t, lp) for t, lp in _ranked(entry) if t != chosen or lp.rank <= n][:n]


def _token_text(entry: TokenLogprobs, token: int) -> tuple[str, float]:
    lp = entry.get(token)
    return ("", NEG_INF_LOGPROB) if lp is None else (lp.decoded_token or "", finite(lp.logprob))


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs], top_n: int) -> ChatLogprobs:
    """Chat's logprobs for these tokens: each with its logprob, UTF-8 bytes and the `top_n` most likely tokens."""
    content = []
    for token, entry in zip(token_ids, entries):
        text, logprob = _token_text(entry, token)
        top = [TopLogprob(token=lp.decoded_token or "", logprob=finite(lp.logprob),
                          bytes=list((lp.decoded_token or "").encode("utf-8"))) for _, lp in _top(entry, token, top_n)]
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")), top_logprobs=top))
    return ChatLogprobs(content=content)


_REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""


class TextOffsets:
    """Where each generated token starts in the choice's text, fed one token at a time (the legacy logprobs'
    `text_offset`).

    A token's own text (`decoded_token`) may be part of a character (`\ufffd`), so the offsets are not the sums of
    those texts' lengths: they come from decoding the growing prefix of tokens, in a small window as the engine's
    `IncrementalDetokenizer` builds the text, and a token that continues a character begun by earlier tokens starts
    where that character starts. The same tokens give the same offsets streamed or not.

    Args:
        tokenizer: the engine's tokenizer (None: every offset is 0, as the text is empty).
        skip_special_tokens: as the request's `SamplingParams` (special tokens add no text when skipped).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._done = 0  # characters of the text of the tokens before `_read` (whole characters)
        self._prefix = 0  # the window's context starts here ...
        self._read = 0  # ... and its new tokens here
        self._prefix_text = ""  # the text of the context
        self._pending = ""  # the text of the tokens from `_read` on (it may end in an incomplete character)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def add(self, token: int) -> int:
        """The offset of `token`, the next token of the sequence."""
        if self._tokenizer is None:
            return 0
        before = self._pending
        offset = self._done + len(before)
        self._ids.append(token)
        full = self._decode(self._ids[self._prefix:])
        after = full[len(self._prefix_text):]
        # an incomplete character absorbs the bytes that continue it: the text grows by less than the token's own
        if before.endswith(_REPLACEMENT) and len(after) < len(before) + len(self._decode([token])):
            offset -= 1
        if full.endswith(_REPLACEMENT) or len(full) <= len(self._prefix_text):
            self._pending = after  # wait for the character to complete, as the detokenizer does
        else:
            self._done += len(after)
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
            self._pending = ""
        return offset

    def extend(self, tokens: Sequence[int]) -> list[int]:
        """The offsets of the next tokens."""
        return [self.add(token) for token in tokens]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs], text_offset: Sequence[int]
                        ) -> CompletionLogprobs:
    """The legacy completions logprobs for these tokens: texts, logprobs, the most likely tokens with the chosen one
    (`{text: logprob}`), and each token's offset in the text (`text_offset`, from `TextOffsets`)."""
    out = CompletionLogprobs()
    for token, entry, offset in zip(token_ids, entries, text_offset):
        text, logprob = _token_text(entry, token)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(_legacy_top(entry))
        out.text_offset.append(offset)
    return out


def _legacy_top(entry: TokenLogprobs) -> dict[str, float]:
    """The legacy logprobs' `{text: logprob}` of a position: the chosen token and the most likely ones; where two
    tokens have the same text, the larger logprob (so `max(top.values())` is the position's best, as lm-eval's
    greedy check reads it)."""
    top: dict[str, float] = {}
    for _, lp in _ranked(entry):
        text = lp.decoded_token or ""
        top[text] = max(top.get(text, NEG_INF_LOGPROB), finite(lp.logprob))
    return top


def echoed_logprobs(output: RequestOutput, tokenizer: Any, skip_special_tokens: bool, generated: Sequence[int],
                    entries: Sequence[TokenLogprobs]) -> CompletionLogprobs:
    """The legacy logprobs of an echoed choice: the prompt's tokens (the first one's logprob and alternatives null:
    nothing predicts it), then the `generated` tokens, with text offsets running on from the prompt's text."""
    prompt_ids = list(output.prompt_token_ids)
    offsets = TextOffsets(tokenizer, skip_special_tokens).extend(prompt_ids + list(generated))
    recorded = output.prompt_logprobs or []
    out = completion_logprobs(generated, entries, offsets[len(prompt_ids):])
    prompt = CompletionLogprobs()
    for i, (token, offset) in enumerate(zip(prompt_ids, offsets)):
        entry = recorded[i] if i < len(recorded) else None
        if entry is None:
            prompt.tokens.append(_decode_one(tokenizer, token))
            prompt.token_logprobs.append(None)
            prompt.top_logprobs.append(None)
        else:
            text, logprob = _token_text(entry, token)
            prompt.tokens.append(text)
            prompt.token_logprobs.append(logprob)
            prompt.top_logprobs.append(_legacy_top(entry))
        prompt.text_offset.append(offset)
    return CompletionLogprobs(tokens=prompt.tokens + out.tokens,
                              token_logprobs=prompt.token_logprobs + out.token_logprobs,
                              top_logprobs=prompt.top_logprobs + out.top_logprobs,
                              text_offset=prompt.text_offset + out.text_offset)


def _decode_one(tokenizer: Any, token: int) -> str:
    return "" if tokenizer is None else tokenizer.decode([token])


def vllm_prompt_logprobs(output: RequestOutput) -> PromptLogprobs | None:
    """`prompt_logprobs` in vLLM's shape: per prompt token, null for the first, else token id -> logprob, rank and
    text, the prompt's token first."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(token): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                                                  decoded_token=lp.decoded_token)
                                        for token, lp in entry.items()}
            for entry in output.prompt_logprobs]
