"""The tokenizer endpoints, in vLLM's shapes: `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`.

Clients that must count or split tokens exactly as the server does use them instead of loading a tokenizer of their
own: lm-evaluation-harness's `tokenizer_backend=remote` (its `local-completions` model picks it by itself when the
server answers `/tokenizer_info` and `/tokenize`) needs nothing but the server's URL.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from decodekit.serve.errors import APIError
from decodekit.serve.protocol import Bool, ChatMessage, Int


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a text (`prompt`) or a conversation (`messages`, rendered by the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = Field(None, description="Text: the tokenizer's special tokens (BOS); default "
                                            "true. A conversation's template holds its own: default false.")
    add_generation_prompt: Bool = Field(True, description="Conversation: end ready for the assistant's turn.")
    return_token_strs: Bool = Field(False, description="Also each token's text.")


class TokenizeResponse(BaseModel):
    """The token ids, their count, the context limit, and (when asked) each token's text."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    """The text of the token ids (`prompt`, as vLLM names it)."""

    prompt: str


def tokenize(tokenizer: Any, request: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
    """The token ids of the request's text or conversation, as the engine would tokenize it.

    Raises:
        APIError: 400 without exactly one of `prompt` and `messages`.
    """
    if (request.prompt is None) == (request.messages is None):
        raise APIError(400, "prompt: give a text (prompt) or a conversation (messages), one of them",
                       param="prompt")
    if request.messages is not None:
        from decodekit.serve.convert import render_chat

        text = render_chat(tokenizer, request.messages, request.add_generation_prompt)
        special = bool(request.add_special_tokens)  # the template wrote the special tokens itself
    else:
        text = request.prompt or ""
        special = request.add_special_tokens is not False
    ids = [int(i) for i in tokenizer(text, add_special_tokens=special)["input_ids"]]
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(tokenizer: Any, request: DetokenizeRequest, vocab_size: int) -> DetokenizeResponse:
    """The text of the token ids.

    Raises:
        APIError: 400 for an id outside the vocabulary, naming it.
    """
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"tokens: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """What a client needs to tokenize as the server does: the special tokens, the chat template, the context
    limit, the vocabulary size and the tokenizer's class (vLLM's `/tokenizer_info` fields)."""
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "model_max_length": max_model_len,
        "vocab_size": len(tokenizer),
        "add_bos_token": bool(tokenizer("", add_special_tokens=True)["input_ids"]),
    }
