"""The default constraint backend: llguidance (MIT, no dependencies).

It compiles typical JSON schemas in about a millisecond, refuses schema features it cannot enforce instead of
approximating them, keeps special tokens out of strings, and fills the masks of a whole batch (drafts included)
in one call on its own threads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from decodekit.api.constraints import ConstraintBackend, ConstraintError, ConstraintSpec, EosAfterStopMatcher, Matcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar of a spec (not yet checked)."""
    if spec.kind in ("json_schema", "json"):
        # Exactly one space after "," and ":" unless asked otherwise: given free whitespace, small models often
        # write runs of blank lines until they run out of tokens.
        options: JsonCompileOptions = (
            {"whitespace_flexible": True} if spec.flexible_whitespace else
            {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=options))
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == "choice":
        return str(llguidance.grammar_from("choice", spec.text))
    if spec.syntax == "gbnf":
        try:
            return str(llguidance.grammar_from("gbnf", spec.text))
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    return str(llguidance.LLMatcher.grammar_from_lark(spec.text))


def _reason(message: str) -> str:
    """llguidance's message on one line, without its source excerpt and caret lines or its position prefix."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [line for line in lines if line and set(line) - {"^", " "} and not _EXCERPT.match(line)]
    return _POSITION.sub("", " ".join(kept)).removesuffix(" <non-verbose/>")


_EXCERPT = re.compile(r"^\d+\s*\|")  # "   1 | start: /a(b/"
_POSITION = re.compile(r"^at \d+\(\d+\): ")


class LLGuidanceMatcher(EosAfterStopMatcher):
    """A sequence's `llguidance.LLMatcher`. EOS after a complete match is taken as a no-op: llguidance refuses it
    in `consume_tokens` and `validate_tokens` once the parser has stopped (though `consume_token` takes it)."""

    def __init__(self, inner: llguidance.LLMatcher, eos_token_ids: frozenset[int], noop_eos: int = 0) -> None:
        super().__init__(eos_token_ids, noop_eos)
        self.inner = inner

    def _eos_is_noop(self) -> bool:
        return bool(self.inner.is_stopped()) and not self.inner.is_error()

    def _consume_one(self, token: int) -> bool:
        return bool(self.inner.consume_token(token))

    def _rollback_inner(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def validate(self, token_ids: Sequence[int]) -> int:
        tokens = list(token_ids)
        valid = int(self.inner.validate_tokens(tokens))
        if valid == len(tokens) or tokens[valid] not in self.eos_token_ids:
            return valid
        probe = self.fork()
        stopped = probe.consume(tokens[:valid]) and probe.is_stopped()
        while stopped and valid < len(tokens) and tokens[valid] in self.eos_token_ids:
            valid += 1
        return valid

    def is_stopped(self) -> bool:
        return bool(self.inner.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self.inner.is_accepting())

    def fast_forward_tokens(self) -> list[int]:
        return list(self.inner.compute_ff_tokens())

    def error(self) -> str | None:
        return _reason(self.inner.get_error()) if self.inner.is_error() else None

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.inner.deep_copy(), self.eos_token_ids, self.noop_eos)


class LLGuidanceBackend(ConstraintBackend):
    """llguidance behind the constraint interface. Compiled grammars are template matchers; a sequence's matcher
    is a copy of its template (microseconds), not a new compile."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                          eos_token=list(eos_token_ids) or None)
        except ValueError as exc:
            raise ConstraintError(f"llguidance cannot use this tokenizer: {exc}") from None
        self.executor = llguidance.LLExecutor()
        self._eos = frozenset(self.eos_token_ids)
        # error messages without the parser's state dump (it can be long and echoes the grammar)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    @classmethod
    def check(cls, spec: ConstraintSpec) -> None:
        message = llguidance.LLMatcher.validate_grammar(grammar_text(spec), None)
        if message and not message.startswith("WARNING"):
            raise ConstraintError(_reason(message))

    def _compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0, limits=self._limits)
        if template.is_error():
            raise ConstraintError(_reason(template.get_error()))
        return template

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._eos)

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        for matcher, row, drafts in rows:
            inner = matcher.inner  # type: ignore[attr-defined]
            if drafts:
                drafted.append((inner, row, list(drafts)))
            else:
                plain.append((inner, row))
        # The executor writes through a raw pointer (what `llguidance.torch`'s helpers do; importing that module
        # would import torch._dynamo for its compiled apply kernel, which we do not use: about a second).
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        rows_total, words = bitmask.shape
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, rows_total)
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, rows_total)
