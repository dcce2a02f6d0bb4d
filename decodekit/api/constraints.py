"""Structured-output constraints: what a constraint is (`ConstraintSpec`) and the backend interface behind it.

A backend (llguidance by default, xgrammar as an optional second one) turns a spec into a compiled grammar and
gives one `Matcher` per sequence. Per step the constraint processors ask the backend to fill a token bitmask for
all their rows in one call (`ConstraintBackend.fill_bitmask`), then apply it with `apply_bitmask`, which unpacks
the bits with tensor ops (no loop over the vocabulary, nothing compiled on first use).

Backends are found by name in a table of loaders: an engine's is its registry's (`ComponentLookup.backend_loaders`),
which plugins fill with `decodekit_register_constraint_backends`. Costs are paid once: the tokenizer-level setup of
a backend (about 1 s) once per tokenizer (`get_backend`), and a grammar's compilation once per spec
(`ConstraintBackend.compile`, cached by the spec's text).

JSON options (`JsonOptions`: `coerce_one_of`, `lenient`, separators, whitespace and escapes) travel in the spec; a
backend honours those it lists in `ConstraintBackend.json_options` and refuses a spec that sets any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import re
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from decodekit.api.bitmask import allocate_bitmask, apply_bitmask, bitmask_to_bool, token_bitmask

__all__ = [  # the bitmask helpers are re-exported: backends and processors have always imported them from here
    "DEFAULT_BACKEND",
    "BackendLoader",
    "ConstraintBackend",
    "ConstraintError",
    "ConstraintKind",
    "ConstraintSpec",
    "EosAfterStopMatcher",
    "GrammarSyntax",
    "JsonOptions",
    "Matcher",
    "allocate_bitmask",
    "apply_bitmask",
    "backend_class",
    "bitmask_to_bool",
    "get_backend",
    "lazy_backend",
    "token_bitmask",
    "tokenizer_fingerprint",
]

ConstraintKind = Literal["json_schema", "json", "regex", "grammar", "choice"]
GrammarSyntax = Literal["lark", "gbnf"]


class ConstraintError(ValueError):
    """A constraint cannot be compiled, or a token broke it; the message is the backend's reason."""


_JSON_WHITESPACE = r"[ \t\n\r]*"
_JSON_ESCAPES = frozenset('"\\/bfnrtu')


class JsonOptions(BaseModel):
    """Options of the JSON compiler (kinds `json_schema` and `json`) beyond `flexible_whitespace`; the defaults ask
    for nothing. llguidance's `JsonCompileOptions` names them the same (the escapes as `json_allowed_escapes` and
    `json_allow_general_unicode_escapes`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coerce_one_of: bool = Field(False, description="Accept a `oneOf` whose branches may overlap, compiled as `anyOf` "
                                                   "(an output may then match more than one branch).")
    lenient: bool = Field(False, description="Accept keywords the backend cannot enforce (`uniqueItems`, `contains`, "
                                             "`if`/`then`, dependencies, unknown `format`s, ...) without enforcing "
                                             "them, and overlapping `oneOf` as `coerce_one_of` does.")
    item_separator: str | None = Field(None, description="The text between array items and object members, e.g. "
                                                         "`\",\"` (default: `\", \"`, or free with flexible "
                                                         "whitespace).")
    key_separator: str | None = Field(None, description="The text between an object key and its value, e.g. `\":\"` "
                                                        "(default: `\": \"`).")
    whitespace_pattern: str | None = Field(None, description="A regex (the backend's syntax) for the whitespace "
                                                             "allowed between JSON tokens; it must match only JSON "
                                                             "whitespace, or the output is not JSON.")
    allowed_escapes: str | None = Field(None, description="The escape letters strings may use (a subset of "
                                                          "`\"\\/bfnrtu`; default: all).")
    allow_general_unicode_escapes: bool = Field(False, description="Allow `\\uXXXX` escapes of any printable "
                                                                   "character in strings without a pattern.")

    @field_validator("item_separator", "key_separator")
    @classmethod
    def _separator(cls, value: str | None, info: ValidationInfo) -> str | None:
        mark = "," if info.field_name == "item_separator" else ":"
        if value is not None and not re.fullmatch(f"{_JSON_WHITESPACE}{mark}{_JSON_WHITESPACE}", value):
            raise ValueError(f"{info.field_name} must be {mark!r} with optional JSON whitespace around it, "
                             f"got {value!r}")
        return value

    @field_validator("allowed_escapes")
    @classmethod
    def _escapes(cls, value: str | None) -> str | None:
        if value is not None and (bad := sorted(set(value) - _JSON_ESCAPES)):
            raise ValueError(f"allowed_escapes may only hold JSON escape letters {''.join(sorted(_JSON_ESCAPES))!r}, "
                             f"got {''.join(bad)!r}")
        return value

    @field_validator("whitespace_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("whitespace_pattern must not be empty (leave it out for the default)")
        return value

    def set_options(self) -> dict[str, Any]:
        """The options that ask for something (differ from their defaults)."""
        return {name: value for name, value in self if value != type(self).model_fields[name].default}


_NO_JSON_OPTIONS = JsonOptions()


class ConstraintSpec(BaseModel):
    """One constraint, as text a backend compiles; equal specs share one compiled grammar.

    Build it with the class methods (`json_schema`, `json_object`, `regex`, `grammar`, `choice`), which put the
    constraint in canonical text form.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ConstraintKind = Field(description="What `text` is.")
    text: str = Field(description="JSON schema (JSON text), regex, grammar, or a JSON list of choices.")
    syntax: GrammarSyntax = Field("lark", description="Grammar syntax (kind `grammar` only).")
    flexible_whitespace: bool = Field(False, description="JSON kinds: allow any whitespace between tokens.")
    json_options: JsonOptions = Field(default_factory=JsonOptions, description="JSON kinds: compiler options.")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, flexible_whitespace: bool = False,
                    options: JsonOptions | None = None) -> ConstraintSpec:
        """A JSON value matching `schema` (a dict or JSON text) exactly as written; `options` are the JSON
        compiler's (`JsonOptions`). The `json_schema` processor applies its `strict` policy to the schema first."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"the schema must be a JSON object, got {type(schema).__name__}")
        return cls(kind="json_schema", text=json.dumps(schema, separators=(",", ":")),
                   flexible_whitespace=flexible_whitespace, json_options=options or JsonOptions())

    @classmethod
    def json_object(cls, flexible_whitespace: bool = False) -> ConstraintSpec:
        """Any JSON object."""
        return cls(kind="json", text='{"type":"object"}', flexible_whitespace=flexible_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        """Text that fully matches `pattern` (the backend's regex syntax; anchored at both ends)."""
        return cls(kind="regex", text=pattern)

    @classmethod
    def grammar(cls, grammar: str, syntax: GrammarSyntax = "lark") -> ConstraintSpec:
        """Text in a context-free grammar (Lark, or GBNF as llama.cpp writes it)."""
        return cls(kind="grammar", text=grammar, syntax=syntax)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> ConstraintSpec:
        """Exactly one of `choices`."""
        if not choices:
            raise ConstraintError("`choices` must not be empty")
        return cls(kind="choice", text=json.dumps(list(choices)))

    @property
    def choices(self) -> list[str]:
        """The choices of a `choice` spec."""
        return list(json.loads(self.text))


class Matcher(ABC):
    """One sequence's position in a compiled grammar. Never raises for a rejected token: it returns False and
    `error()` says why (a matcher in error stays there)."""

    @abstractmethod
    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance over tokens; False when one is rejected (the matcher is then in error)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens."""

    @abstractmethod
    def validate(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` could be consumed now (the state is not changed)."""

    @abstractmethod
    def is_stopped(self) -> bool:
        """The grammar is complete and admits no more text: only EOS is allowed next."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed, though more text may be too)."""

    @abstractmethod
    def fast_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (may be empty)."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher is in error, or None."""

    @abstractmethod
    def fork(self) -> Matcher:
        """An independent copy at the same position."""


class EosAfterStopMatcher(Matcher):
    """A matcher that takes EOS after its grammar has stopped as a no-op. The libraries refuse a token after the
    stop, but the engine feeds a sequence every token it accepts, EOS included; the no-op EOS tokens are always the
    last ones consumed, so `rollback` undoes them first. Subclasses implement `_eos_is_noop`, `_consume_one` and
    `_rollback_inner`."""

    def __init__(self, eos_token_ids: frozenset[int], noop_eos: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.noop_eos = noop_eos  # EOS tokens taken after the stop

    @abstractmethod
    def _eos_is_noop(self) -> bool:
        """Whether an EOS now would be taken as a no-op (the grammar has stopped)."""

    @abstractmethod
    def _consume_one(self, token: int) -> bool:
        """Advance the library's matcher over one token; False when it is rejected."""

    @abstractmethod
    def _rollback_inner(self, num_tokens: int) -> None:
        """Undo the library matcher's last `num_tokens` tokens."""

    def consume(self, token_ids: Sequence[int]) -> bool:
        for token in token_ids:
            if token in self.eos_token_ids and self._eos_is_noop():
                self.noop_eos += 1
            elif not self._consume_one(token):
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        noops = min(num_tokens, self.noop_eos)
        self.noop_eos -= noops
        if num_tokens > noops:
            self._rollback_inner(num_tokens - noops)


class ConstraintBackend(ABC):
    """A structured-output library behind one interface; one instance per tokenizer (see `get_backend`).

    Args:
        tokenizer: a Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary size (mask width; may exceed the tokenizer's).
        eos_token_ids: the ids that end generation, allowed exactly when the grammar is complete.
    """

    name: ClassVar[str] = "backend"
    cache_size: ClassVar[int] = 256
    json_options: ClassVar[frozenset[str]] = frozenset()
    """The `JsonOptions` fields this backend honours; a spec that sets any other is refused, not ignored."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_only = token_bitmask(self.eos_token_ids, vocab_size)  # the mask of a stopped grammar
        self._compiled: OrderedDict[ConstraintSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    @abstractmethod
    def check(cls, spec: ConstraintSpec) -> None:
        """Compile `spec` without a tokenizer, raising `ConstraintError` with the reason it cannot compile
        (used where no engine is built yet, e.g. a recipe check)."""

    @classmethod
    def refuse_unsupported(cls, spec: ConstraintSpec) -> None:
        """Raise `ConstraintError` naming the JSON options `spec` sets that this backend cannot honour."""
        if spec.json_options == _NO_JSON_OPTIONS:
            return
        unsupported = {name: value for name, value in spec.json_options.set_options().items()
                       if name not in cls.json_options}
        if unsupported:
            listed = ", ".join(f"{name}: {json.dumps(value)}" for name, value in unsupported.items())
            other = f" (the {DEFAULT_BACKEND} backend does)" if cls.name != DEFAULT_BACKEND else ""
            raise ConstraintError(f"the {cls.name} backend cannot honour the JSON option {listed}{other}")

    def compile(self, spec: ConstraintSpec) -> Any:
        """The compiled grammar of `spec`, cached by its text; raise `ConstraintError` with the backend's reason
        (or naming a JSON option the backend cannot honour)."""
        self.refuse_unsupported(spec)
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    @abstractmethod
    def _compile(self, spec: ConstraintSpec) -> Any:
        """Compile one spec (uncached)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A new matcher at the start of a compiled grammar."""

    @abstractmethod
    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
        """Fill allowed-token bits for many rows in one call.

        Args:
            rows: `(matcher, row, drafts)`: the matcher's mask goes to `bitmask[row]`, and the mask after each of
                the first i+1 draft tokens to `bitmask[row + i + 1]`, as long as the drafts are accepted (rows
                after a rejected draft, or after the grammar stops, are left as they are). Matchers end where
                they started.
            bitmask: `[rows, ceil(vocab_size / 32)]` int32 on the CPU (bit `t % 32` of word `t // 32` is token t).
        """

    def warmup(self, device: torch.device | str = "cpu") -> None:
        """Pay first-use costs now (a compile, a mask fill, the unpack tables and kernels on `device`) instead of
        at the first constrained step."""
        matcher = self.matcher(self.compile(ConstraintSpec.json_schema({"type": "object", "properties": {
            "a": {"type": "integer"}}, "additionalProperties": False})))
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask([(matcher, 0, [])], bitmask)
        apply_bitmask(torch.zeros(1, self.vocab_size, device=device), bitmask)


# ---- backends by name ----------------------------------------------------------------------------------------
BackendLoader = Callable[[], type[ConstraintBackend]]


def lazy_backend(path: str) -> BackendLoader:
    """A loader for `"module:Class"`, imported on first use, so an optional backend's library is imported only
    when a request names it."""

    def load() -> type[ConstraintBackend]:
        module, _, attr = path.partition(":")
        cls: type[ConstraintBackend] = getattr(importlib.import_module(module), attr)
        return cls

    return load


DEFAULT_BACKEND = "llguidance"
"""The backend a request gets when it names none (registered by decodekit's structured-output plugin)."""


def backend_class(name: str, backends: Mapping[str, BackendLoader]) -> type[ConstraintBackend]:
    """A backend's class from `backends` (name -> loader: an engine's registry's, `ComponentLookup.backend_loaders`);
    `ConstraintError` when it is unknown or its library is not installed."""
    if name not in backends:
        raise ConstraintError(f"unknown constraint backend {name!r}; known: {', '.join(sorted(backends))}")
    try:
        return backends[name]()
    except ImportError as exc:
        raise ConstraintError(f"constraint backend {name!r} is not installed ({exc}); "
                              f"pip install 'decodekit[structured-{name}]'") from None


# Built backends, one per (class, tokenizer, vocabulary, EOS ids) per process: a cache, since the tokenizer-level
# setup takes about a second and engines (tests, benchmarks) are often built many times over one tokenizer.
_INSTANCES: dict[tuple[type[ConstraintBackend], str, int, tuple[int, ...]], ConstraintBackend] = {}
_INSTANCES_LOCK = threading.Lock()


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of a tokenizer's full definition, so equal tokenizers loaded twice share one backend (tens of
    milliseconds for a large vocabulary, so remembered per tokenizer object)."""
    try:
        return _FINGERPRINTS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr((type(tokenizer).__name__,
                                                               getattr(tokenizer, "name_or_path", ""),
                                                               len(tokenizer)))
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    with contextlib.suppress(TypeError):  # not weak-referenceable: computed each time
        _FINGERPRINTS[tokenizer] = digest
    return digest


def get_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                backends: Mapping[str, BackendLoader]) -> ConstraintBackend:
    """The backend `name` (from `backends`, name -> loader: an engine's registry's) for this tokenizer, built
    (tokenizer-level setup, ~1 s) once per process and cached."""
    cls = backend_class(name, backends)
    key = (cls, tokenizer_fingerprint(tokenizer), vocab_size, tuple(eos_token_ids))
    with _INSTANCES_LOCK:
        backend = _INSTANCES.get(key)
        if backend is None:
            backend = cls(tokenizer, vocab_size, eos_token_ids)
            _INSTANCES[key] = backend
    return backend
