"""Structured output: processors that keep generation inside a JSON schema, any JSON object, a regex, a grammar,
or a list of choices.

Each sequence has its own matcher (its processor state): advanced only on accepted tokens, forked with the
sequence (beams, parallel samples). Per step, the masks of all constrained rows are filled in one backend call and
applied as a -inf bias, with no loop over the vocabulary. Once the constraint is complete only EOS is allowed, so
generation ends through the ordinary EOS criterion. A constraint that cannot compile is refused when the request
is submitted (or the recipe loaded) with the backend's reason; a token that breaks the constraint mid-way (another
processor unmasked it) fails that request alone with finish reason "error".

Under speculative verification a sequence spans rows with `draft_offsets` 0..k; the row at offset j gets the mask
after the first j draft tokens (the backend validates the drafts and rolls back), and rows after a draft the
constraint rejects allow only EOS (verification never reaches them).

Recipe examples:
    processors: [{json_schema: {schema: {type: object, properties: {name: {type: string}}, required: [name]}}}]
    processors: [{regex: {pattern: "[0-9]{3}-[0-9]{4}"}}]
    processors: [{choice: {choices: [positive, negative, neutral]}}]
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, field_validator

from decodekit import hookimpl
from decodekit.api.components import ComponentLookup
from decodekit.api.constraints import (
    DEFAULT_BACKEND,
    BackendLoader,
    ConstraintBackend,
    ConstraintError,
    ConstraintSpec,
    JsonOptions,
    Matcher,
    allocate_bitmask,
    apply_bitmask,
    backend_class,
    get_backend,
    lazy_backend,
)
from decodekit.api.params import StrictParams
from decodekit.api.processors import BatchView, LogitsProcessor
from decodekit_plugins.strict_schema import forbid_additional_properties

log = logging.getLogger("decodekit.structured")

_CHECKED_CACHE_SIZE = 256  # constraints remembered as passing the static check (a backend's compile cache's order)

_OWN_BACKENDS: Mapping[str, BackendLoader] = MappingProxyType({
    "llguidance": lazy_backend("decodekit_plugins.llguidance_backend:LLGuidanceBackend"),
    "xgrammar": lazy_backend("decodekit_plugins.xgrammar_backend:XGrammarBackend"),
})
"""The backends this plugin registers (`decodekit_register_constraint_backends`); the engine's registry holds them
with any third party's. A processor not bound to a registry (used on its own, as in a unit test) knows only these."""


class _Params(StrictParams):
    backend: str = Field(DEFAULT_BACKEND, description="Constraint backend: llguidance, or xgrammar (optional extra).")


@dataclass
class ConstraintState:
    """A sequence's constraint state: its matcher and the backend that made it."""

    matcher: Matcher
    backend: str


class ConstraintProcessor(LogitsProcessor):
    """Base class of the constraint processors: subclasses set `name` and `Params` and implement `spec`."""

    stateful = True

    def __init__(self) -> None:
        self._info: Any = None
        self._available: Mapping[str, BackendLoader] = _OWN_BACKENDS  # the registry's, once bound
        self._backends: dict[str, ConstraintBackend] = {}
        self._checked: OrderedDict[tuple[str, ConstraintSpec], None] = OrderedDict()  # passed `check_options`
        self._checked_lock = threading.Lock()  # planning may run beside a server's validation thread

    def bind(self, lookup: ComponentLookup) -> None:
        """Use the backends registered with the engine's (or recipe check's) plugins."""
        self._available = lookup.backend_loaders()

    def spec(self, options: Any) -> ConstraintSpec:
        """The constraint a request's validated parameters describe."""
        raise NotImplementedError

    def setup(self, info: Any) -> None:
        """Build the default backend for the engine's tokenizer and warm it up (once per tokenizer per process),
        so the first constrained step does not pay for it."""
        self._info = info
        try:
            self.backend(DEFAULT_BACKEND).warmup(getattr(info, "device", "cpu") or "cpu")
        except Exception:  # e.g. a tokenizer the backend cannot read: each request is refused with the reason
            log.warning("%s: the %s backend is not usable with this tokenizer", self.name, DEFAULT_BACKEND,
                        exc_info=True)

    def backend(self, name: str) -> ConstraintBackend:
        """The named backend for the engine's tokenizer."""
        if name not in self._backends:
            if self._info is None or self._info.tokenizer is None:
                raise ConstraintError(f"the {self.name} processor needs an engine's tokenizer (setup was not called)")
            self._backends[name] = get_backend(name, self._info.tokenizer, self._info.vocab_size,
                                               self._info.eos_token_ids, self._available)
        return self._backends[name]

    def check_options(self, options: Any) -> None:
        """Check the request's constraint without a tokenizer (a recipe check does only this): `ConstraintError`
        (a `ValueError`) with the backend's reason when it cannot compile, or names an option the backend cannot
        honour. A constraint that passed is remembered, so an engine planning many requests with one schema checks
        it once."""
        spec = self.spec(options)
        key = (options.backend, spec)
        with self._checked_lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return
        try:
            cls = backend_class(options.backend, self._available)
            cls.refuse_unsupported(spec)
            cls.check(spec)
        except ConstraintError:
            raise
        except Exception as exc:  # a backend's unexpected failure still refuses just this request
            raise ConstraintError(f"the {options.backend} backend failed: {exc!r}") from exc
        with self._checked_lock:
            self._checked[key] = None
            while len(self._checked) > _CHECKED_CACHE_SIZE:
                self._checked.popitem(last=False)

    def check_options_with(self, options: Any, info: Any) -> None:
        """Inside an engine: compile the request's constraint for its tokenizer now (cached for its sequences), so
        a constraint the tokenizer cannot serve refuses the request at submission, with the backend's reason."""
        try:
            self.backend(options.backend).compile(self.spec(options))
        except ConstraintError:
            raise
        except Exception as exc:  # a backend's unexpected failure still refuses just this request
            raise ConstraintError(f"the {options.backend} backend failed: {exc!r}") from exc

    def init_state(self, options: Any, prompt_ids: list[int]) -> ConstraintState:
        # the constraint covers the generated text only, so the prompt is not consumed
        backend = self.backend(options.backend)
        return ConstraintState(backend.matcher(backend.compile(self.spec(options))), options.backend)

    def update_state(self, state: ConstraintState, options: Any, token_ids: list[int]) -> ConstraintState:
        if not state.matcher.consume(token_ids):
            raise self._rejected(state)
        return state

    def _rejected(self, state: ConstraintState) -> ConstraintError:
        # raised when the token arrives, and again at the next step if that one is retried
        return ConstraintError(f"the {self.name} constraint rejected a token: {state.matcher.error()}")

    def fork_state(self, state: ConstraintState) -> ConstraintState:
        return ConstraintState(state.matcher.fork(), state.backend)

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        rows = len(batch)
        jobs: dict[str, list[tuple[Matcher, int, list[int]]]] = defaultdict(list)
        seen: set[int] = set()
        row = 0
        while row < rows:
            state: ConstraintState | None = batch.states[row]
            if state is None:
                raise ConstraintError(f"the {self.name} processor got a row without its state")
            if state.matcher.error() is not None:
                raise self._rejected(state)
            # the following rows that score later draft positions of the same sequence
            offset, end = batch.draft_offsets[row], row + 1
            while end < rows and batch.states[end] is state and batch.draft_offsets[end] == offset + end - row:
                end += 1
            history, num_drafts = batch.histories[end - 1], end - 1 - row
            drafts = history[len(history) - num_drafts :] if num_drafts else []
            matcher = state.matcher
            if offset or id(state) in seen:
                # this row scores after unverified tokens the state has not seen: advance a copy over them
                matcher = matcher.fork()
                if not matcher.consume(history[len(history) - num_drafts - offset : len(history) - num_drafts]):
                    row = end
                    continue
            seen.add(id(state))
            jobs[state.backend].append((matcher, row, drafts))
            row = end
        # rows the fill leaves alone (after a rejected draft) allow only EOS; they are never verified
        first = self.backend(next(iter(jobs), DEFAULT_BACKEND))
        bitmask = allocate_bitmask(rows, first.vocab_size, first.eos_only, pin=logits.device.type == "cuda")
        for name, job in jobs.items():
            self.backend(name).fill_bitmask(job, bitmask)
        return apply_bitmask(logits, bitmask)


class JsonSchemaProcessor(ConstraintProcessor):
    """Constrain the output to JSON matching a schema.

    An object schema listing `properties` without `additionalProperties` forbids other keys (`strict`, the
    default); JSON is written with one space after `,` and `:` unless `flexible_whitespace` or the separators say
    otherwise. The JSON compiler's options (`JsonOptions`) are parameters too: `coerce_one_of` accepts a `oneOf`
    whose branches may overlap (as `anyOf`), `lenient` accepts keywords the backend cannot enforce (`uniqueItems`,
    unknown `format`s, ...) without enforcing them; `item_separator`, `key_separator`, `whitespace_pattern`,
    `allowed_escapes` and `allow_general_unicode_escapes` shape the text. A schema the backend refuses is refused
    naming the keyword and the option that would accept it; a backend that cannot honour an option refuses it.

    Example (recipe): `processors: [{json_schema: {schema: {type: object, properties: {age: {type: integer}}}}}]`,
    or with an option: `processors: [{json_schema: {schema: {oneOf: [...]}, coerce_one_of: true}}]`
    """

    name = "json_schema"
    example: ClassVar[dict[str, Any]] = {"schema": {
        "type": "object", "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 6},
                       "age": {"type": "integer", "minimum": 0, "maximum": 99}}}}

    class Params(_Params, JsonOptions):
        schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema (a mapping, or JSON text).")
        strict: bool = Field(True, description="Forbid keys an object schema does not list, unless it sets "
                                               "additionalProperties.")
        flexible_whitespace: bool = Field(False, description="Allow any whitespace between JSON tokens.")

        model_config = ConfigDict(extra="forbid", frozen=False, populate_by_name=True, serialize_by_alias=True)

        @field_validator("schema_", mode="before")
        @classmethod
        def _parse(cls, value: Any) -> Any:
            if isinstance(value, str):
                try:
                    return json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the schema is not valid JSON: {exc}") from None
            return value

    def spec(self, options: Any) -> ConstraintSpec:
        json_options = JsonOptions(**{name: getattr(options, name) for name in JsonOptions.model_fields})
        schema = forbid_additional_properties(options.schema_) if options.strict else options.schema_
        return ConstraintSpec.json_schema(schema, options.flexible_whitespace, json_options)


class JsonProcessor(ConstraintProcessor):
    """Constrain the output to any JSON object.

    Example (recipe): `processors: [json]`
    """

    name = "json"

    class Params(_Params):
        flexible_whitespace: bool = Field(False, description="Allow any whitespace between JSON tokens.")

    def spec(self, options: Any) -> ConstraintSpec:
        return ConstraintSpec.json_object(options.flexible_whitespace)


class RegexProcessor(ConstraintProcessor):
    """Constrain the output to fully match a regular expression (the backend's syntax: Rust `regex` for
    llguidance).

    Example (recipe): `processors: [{regex: {pattern: "(yes|no), because [a-z ]{10,60}\\\\."}}]`
    """

    name = "regex"
    example: ClassVar[dict[str, Any]] = {"pattern": r"[a-d]{2,5}-[0-9]{1,4}"}

    class Params(_Params):
        pattern: str = Field(description="The regular expression the whole output must match.")

    def spec(self, options: Any) -> ConstraintSpec:
        return ConstraintSpec.regex(options.pattern)


class GrammarProcessor(ConstraintProcessor):
    """Constrain the output to a context-free grammar (Lark as llguidance extends it, or llama.cpp's GBNF).

    Example (recipe): `processors: [{grammar: {grammar: "start: NUMBER (\\"+\\" NUMBER)*\\nNUMBER: /[0-9]+/"}}]`
    """

    name = "grammar"
    example: ClassVar[dict[str, Any]] = {"grammar": 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'}

    class Params(_Params):
        grammar: str = Field(description="The grammar text.")
        syntax: Literal["lark", "gbnf"] = Field("lark", description="Grammar syntax: lark or gbnf.")

    def spec(self, options: Any) -> ConstraintSpec:
        return ConstraintSpec.grammar(options.grammar, options.syntax)


class ChoiceProcessor(ConstraintProcessor):
    """Constrain the output to exactly one of a list of strings.

    Example (recipe): `processors: [{choice: {choices: [positive, negative, neutral]}}]`
    """

    name = "choice"
    example: ClassVar[dict[str, Any]] = {"choices": ["alpha", "beta", "gamma delta"]}

    class Params(_Params):
        choices: list[str] = Field(min_length=1, description="The allowed outputs.")

    def spec(self, options: Any) -> ConstraintSpec:
        return ConstraintSpec.choice(options.choices)


@hookimpl
def decodekit_register_processors(register: Callable[..., None]) -> None:
    """Register the structured-output processors (used when a request or recipe names them)."""
    for proc in (JsonSchemaProcessor, JsonProcessor, RegexProcessor, GrammarProcessor, ChoiceProcessor):
        register(proc.name, proc)


@hookimpl
def decodekit_register_constraint_backends(register: Callable[..., None]) -> None:
    """Register the structured-output backends (their libraries are imported when a request names one)."""
    for name, loader in _OWN_BACKENDS.items():
        register(name, loader)
