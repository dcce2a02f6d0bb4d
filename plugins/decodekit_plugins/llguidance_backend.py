"""The default constraint backend: llguidance (MIT, no dependencies).

It compiles typical JSON schemas in about a millisecond, refuses schema features it cannot enforce instead of
approximating them, keeps special tokens out of strings, and fills the masks of a whole batch (drafts included)
in one call on its own threads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import llguidance
import llguidance.hf
import torch

from decodekit.api.constraints import ConstraintBackend, ConstraintError, ConstraintSpec, EosAfterStopMatcher, Matcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


# JsonOptions field -> llguidance JsonCompileOptions key
_OPTION_KEYS = {"coerce_one_of": "coerce_one_of", "lenient": "lenient", "item_separator": "item_separator",
                "key_separator": "key_separator", "whitespace_pattern": "whitespace_pattern",
                "allowed_escapes": "json_allowed_escapes",
                "allow_general_unicode_escapes": "json_allow_general_unicode_escapes"}


def json_compile_options(spec: ConstraintSpec) -> tuple[JsonCompileOptions, JsonCompileOptions]:
    """llguidance's `(defaults, overrides)` for a JSON spec. The whitespace defaults give way to a schema's own
    `"x-guidance"` settings; the options the request sets override them."""
    # Exactly one space after "," and ":" unless asked otherwise: given free whitespace, small models often
    # write runs of blank lines until they run out of tokens.
    defaults: JsonCompileOptions = (
        {"whitespace_flexible": True} if spec.flexible_whitespace else
        {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    overrides: dict[str, Any] = {_OPTION_KEYS[name]: value for name, value in spec.json_options.set_options().items()}
    return defaults, cast("JsonCompileOptions", overrides)


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar of a spec (not yet checked)."""
    if spec.kind in ("json_schema", "json"):
        defaults, overrides = json_compile_options(spec)
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=defaults,
                                                                     overrides=overrides or None))
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
_ONE_OF = re.compile(r"oneOf constraints are not supported")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_LOCATION = re.compile(r"\s+while processing (\S+)")


def explain(reason: str) -> str:
    """A schema refusal that llguidance lifts with an option, said as the keyword and the option that would accept
    it, followed by llguidance's own message; any other reason unchanged."""
    hint = None
    if _ONE_OF.search(reason):
        hint = ("the schema uses 'oneOf' with branches that may overlap, which needs coerce_one_of: true (or "
                "lenient: true) to be compiled as anyOf (an output may then match more than one branch)")
    elif match := _UNIMPLEMENTED.search(reason):
        try:
            keys = [str(key) for key in json.loads(match.group(1))]
        except ValueError:
            keys = [match.group(1)]
        named = ", ".join(repr(key) for key in keys)
        hint = (f"the schema uses {named}, which llguidance cannot enforce; lenient: true accepts "
                f"{'it' if len(keys) == 1 else 'them'} without enforcing {'it' if len(keys) == 1 else 'them'}")
    elif match := _UNKNOWN_FORMAT.search(reason):
        hint = (f"the schema uses 'format': {match.group(1)!r}, a format llguidance does not know; lenient: true "
                "accepts it as any string")
    if hint is None:
        return reason
    if where := _LOCATION.search(reason):
        hint += f" (at {where.group(1)})"
    return f"{hint} [llguidance: {reason}]"


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
    json_options = frozenset(_OPTION_KEYS)

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
        cls.refuse_unsupported(spec)
        message = llguidance.LLMatcher.validate_grammar(grammar_text(spec), None)
        if message and not message.startswith("WARNING"):
            raise ConstraintError(explain(_reason(message)))

    def _compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0, limits=self._limits)
        if template.is_error():
            raise ConstraintError(explain(_reason(template.get_error())))
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
