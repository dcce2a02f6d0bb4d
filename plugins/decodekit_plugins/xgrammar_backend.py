"""A second constraint backend: xgrammar (Apache-2.0), optional (`pip install 'decodekit[structured-xgrammar]'`).

Slightly faster per token than llguidance and accepts more schemas, but it approximates some features (an
unknown string `format` is ignored rather than refused) and lets special tokens into strings. `pip install
xgrammar` pulls in triton; `pip install --no-deps xgrammar apache-tvm-ffi` is enough for CPU masks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar

from decodekit.api.constraints import (
    ConstraintBackend,
    ConstraintError,
    ConstraintSpec,
    EosAfterStopMatcher,
    Matcher,
    bitmask_to_bool,
)

_SEPARATORS = (", ", ": ")


def _choice_ebnf(spec: ConstraintSpec) -> str:
    # GBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c) for c in spec.choices)


def _reason(exc: Exception) -> str:
    # drop the "[time] file.cc:line:" prefix of xgrammar's C++ errors
    text = " ".join(str(exc).split())
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class XGrammarMatcher(EosAfterStopMatcher):
    """A sequence's `xgrammar.GrammarMatcher`, with a sticky error state like llguidance's."""

    def __init__(self, inner: xgrammar.GrammarMatcher, eos_token_ids: frozenset[int], tokenizer: Any,
                 vocab_size: int, noop_eos: int = 0, error: str | None = None) -> None:
        super().__init__(eos_token_ids, noop_eos)
        self.inner = inner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._error = error

    def consume(self, token_ids: Sequence[int]) -> bool:
        return self._error is None and super().consume(token_ids)

    def _eos_is_noop(self) -> bool:
        return bool(self.inner.is_terminated())

    def _consume_one(self, token: int) -> bool:
        if self.inner.accept_token(token):
            return True
        self._error = f"token {token} ({self.tokenizer.decode([token])!r}) does not satisfy the grammar"
        return False

    def _rollback_inner(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def validate(self, token_ids: Sequence[int]) -> int:
        probe = self.fork()
        for i, token in enumerate(token_ids):
            if not probe.consume([token]):
                return i
        return len(token_ids)

    def is_stopped(self) -> bool:
        if self.inner.is_terminated() or self._error is not None:
            return True
        if not self.inner.is_completed():
            return False
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.inner.fill_next_token_bitmask(bitmask)
        allowed = bitmask_to_bool(bitmask, self.vocab_size)[0].nonzero().flatten().tolist()
        return set(allowed) <= self.eos_token_ids

    def is_accepting(self) -> bool:
        return bool(self.inner.is_completed())

    def fast_forward_tokens(self) -> list[int]:
        forced = self.inner.find_jump_forward_string()
        if not forced:
            return []
        ids = list(self.tokenizer.encode(forced, add_special_tokens=False))
        return ids[: self.validate(ids)]

    def error(self) -> str | None:
        return self._error

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.inner.fork(), self.eos_token_ids, self.tokenizer, self.vocab_size, self.noop_eos,
                              self._error)


class XGrammarBackend(ConstraintBackend):
    """xgrammar behind the constraint interface; one grammar compiler per tokenizer."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.tokenizer = tokenizer
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()
        self._eos = frozenset(self.eos_token_ids)

    @classmethod
    def check(cls, spec: ConstraintSpec) -> None:
        try:
            if spec.kind in ("json_schema", "json"):
                xgrammar.Grammar.from_json_schema(spec.text, strict_mode=False)
            elif spec.kind == "regex":
                xgrammar.Grammar.from_regex(spec.text)
            elif spec.kind == "choice":
                xgrammar.Grammar.from_ebnf(_choice_ebnf(spec))
            elif spec.syntax == "gbnf":
                xgrammar.Grammar.from_ebnf(spec.text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own types for a bad grammar
            raise ConstraintError(_reason(exc)) from None

    def _compile(self, spec: ConstraintSpec) -> xgrammar.CompiledGrammar:
        try:
            if spec.kind in ("json_schema", "json"):
                # the additionalProperties policy is already in the spec's schema (decodekit.api.constraints)
                return self.compiler.compile_json_schema(
                    spec.text, any_whitespace=spec.flexible_whitespace,
                    separators=None if spec.flexible_whitespace else _SEPARATORS, strict_mode=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return self.compiler.compile_grammar(_choice_ebnf(spec))
            if spec.syntax == "gbnf":
                return self.compiler.compile_grammar(spec.text)
            return self.compiler.compile_lark(spec.text)
        except Exception as exc:  # see check()
            raise ConstraintError(_reason(exc)) from None

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled), self._eos, self.tokenizer, self.vocab_size)

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
        plain: list[xgrammar.GrammarMatcher] = []
        indices: list[int] = []
        for matcher, row, drafts in rows:
            inner: xgrammar.GrammarMatcher = matcher.inner  # type: ignore[attr-defined]
            if inner.is_terminated():
                bitmask[row] = self.eos_only  # xgrammar refuses to fill after the stop token
            elif drafts:
                self._fill_drafts(matcher, row, drafts, bitmask)
            else:
                plain.append(inner)
                indices.append(row)
        if plain:
            self.batch.batch_fill_next_token_bitmask(plain, bitmask, indices)

    def _fill_drafts(self, matcher: Matcher, row: int, drafts: Sequence[int], bitmask: torch.Tensor) -> None:
        inner: xgrammar.GrammarMatcher = matcher.inner  # type: ignore[attr-defined]
        inner.fill_next_token_bitmask(bitmask, row)
        consumed = 0
        for i, token in enumerate(drafts):
            if not inner.accept_token(token):
                break
            consumed += 1
            if inner.is_terminated():
                break
            inner.fill_next_token_bitmask(bitmask, row + i + 1)
        if consumed:
            inner.rollback(consumed)
