"""What a component (processor, stopping criterion, strategy, proposer) gets from the engine it serves, and how its
per-request parameters (`Params`) are validated, with errors that name the offending key."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ValidationError

from decodekit.api.errors import ConfigError
from decodekit.api.models import LoadedModel
from decodekit.api.proposer import ProposerModel
from decodekit.api.step_cost import StepCost


@dataclass
class ComponentInfo:
    """What components may need from the engine, given to their `setup` once after construction.

    Attributes:
        tokenizer: the engine's tokenizer (a Hugging Face tokenizer).
        vocab_size: the model's vocabulary size (the logits' width; may exceed the tokenizer's).
        eos_token_ids: the ids that end a sequence.
        device: where logits live.
        model_name: the target model's name.
        draft: the engine's draft model (`LLM(draft=...)`, recipe `draft:`), or None.
        open_model: give a model its own paged KV cache and forward (`ProposerModel`, as many blocks as the
            engine's, run the way the engine runs its own model): how a proposer runs a draft model with public
            API only. None outside an engine (a recipe check).
        target: the engine's own model, for a proposer that reuses its embedding and LM head (a trained draft head,
            the `eagle` proposer); None outside an engine. Read it, never change it.
        step_cost: the seconds of a forward by rows on this machine (`StepCost`) of the target (`step_cost(None)`)
            or of a model `open_model` gave (`step_cost(model)`): measured at the first call, cached on disk,
            None while the KV pool has no blocks to spare for measuring (ask again later). None outside an engine.
    """

    tokenizer: Any = None
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    device: torch.device | str = "cpu"
    model_name: str = ""
    draft: LoadedModel | None = None
    open_model: Callable[[LoadedModel], ProposerModel] | None = None
    target: LoadedModel | None = None
    step_cost: Callable[[ProposerModel | None], StepCost | None] | None = None


class ComponentLookup(Protocol):
    """The engine's built components, for a component that uses others (a strategy's proposers): components with a
    `bind(lookup)` method get it when they are built."""

    def get(self, kind: str, name: str, path: str = "") -> Any:
        """The shared instance of a registered component; `PlanError` at `path` when the name is unknown."""
        ...

    def backend_loaders(self) -> Mapping[str, Callable[[], Any]]:
        """The registered structured-output backends: name -> loader of the `ConstraintBackend` class."""
        ...


class PlanError(ConfigError):
    """A request's or recipe's components are invalid; `path` names the offending key."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.reason = message


def dotted_path(loc: Sequence[Any], prefix: str = "") -> str:
    """A key path as a user writes it in a recipe or request: `processors[0].top_k.top_k` (list indexes in
    brackets, keys joined with dots), under `prefix` when one is given."""
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def closest_key(key: str, known: Sequence[str]) -> str | None:
    """The known key `key` is most likely a typo of (difflib's closest match), or None when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return close[0] if close else None


def unknown_key_message(key: str, known: Sequence[str]) -> str:
    """What to say about a key a model does not have: `unknown key 'penalti' (did you mean 'penalty'?); known
    keys: penalty` (the suggestion only when one is close, the list only when the known keys are known)."""
    close = closest_key(key, known)
    message = f"unknown key {key!r}" + (f" (did you mean {close!r}?)" if close else "")
    return message + (f"; known keys: {', '.join(known)}" if known else "")


def known_keys(model: Any, loc: Sequence[Any] = ()) -> list[str]:
    """The keys the pydantic model at `loc` under `model` accepts (a field's alias when it has one, since that is
    what the input must use), in declaration order, then the other spellings the model lists in a `key_aliases`
    mapping; [] when `loc` does not lead to a model."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):  # an item of a list field (`list[Model]`, or `list[Model] | None`): the item type
            args = typing.get_args(_non_optional(current))
            current = args[0] if args else None
            continue
        cls = _model_class(current)
        if cls is None:
            return []
        field = next((f for name, f in cls.model_fields.items() if (f.alias or name) == part), None)
        if field is None:
            return []
        current = field.annotation
    cls = _model_class(current)
    if cls is None:
        return []
    # a model may accept other spellings too (`SamplingParams.key_aliases`: transformers' names): listed after its
    # fields, so a typo of one is matched to it rather than to a field it merely resembles
    aliases = list(getattr(cls, "key_aliases", {}))
    return [f.alias or name for name, f in cls.model_fields.items()] + aliases


def _non_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # `X | None`: X
        return next((a for a in typing.get_args(annotation) if a is not type(None)), None)
    return annotation


def _model_class(annotation: Any) -> type[BaseModel] | None:
    annotation = _non_optional(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


YAML_BOOLEAN_HINT = " (quote it if you meant text: YAML reads unquoted yes/no/on/off/true/false as booleans)"
"""Added to "a valid string, got True" errors: the usual cause is an unquoted `yes`/`no`/`on` in a recipe."""

_COMPONENT_KEYS = ["name", "params"]  # the fields of `ComponentSpec`: a component named in a recipe or request
_COMPONENT_KINDS = {"processors": "processor", "stopping": "stopping criterion", "strategy": "strategy"}


def _component_kind(path: str) -> str:
    """What a component at `path` is (`processors[0]`: a processor), from the last list key the path goes through."""
    found = [(path.rfind(key), kind) for key, kind in _COMPONENT_KINDS.items() if key in path]
    return max(found)[1] if found else "component"


def _component_shape_message(path: str, loc: Sequence[Any], given: Any) -> str:
    """What to say about a component (`ComponentSpec`) written in a shape it cannot have, naming its kind."""
    kind = _component_kind(path)
    if isinstance(given, dict) and len(given) > 1:
        names = ", ".join(str(k) for k in given)
        if loc and isinstance(loc[-1], int):
            return (f"one {kind} per list item: this item names {len(given)} ({names}); give each its own item "
                    f"(`- {next(iter(given))}: {{...}}`)")
        return f"one {kind} only: got {len(given)} ({names}); name one (`{{{next(iter(given))}: {{...}}}}`)"
    got = "an empty mapping" if given == {} else f"a {type(given).__name__}"
    example = "- top_k: {top_k: 40}" if kind == "processor" else "{name: {parameters}}"
    return f"a {kind} is a name or a mapping of one name to its parameters (`{example}`), got {got}"


def format_validation_error(prefix: str, exc: ValidationError, model: Any = None, *,
                            label: str = "", sep: str = "; ") -> str:
    """Every pydantic error as `label: key.path[i]: message, got value`, joined with `sep`.

    The path is the error's location under `prefix` (the key the validated mapping sits at in the recipe or
    request, e.g. `processors[0].repetition_penalty`). An unknown key names the keys `model` (the model, or type,
    that was validated) accepts at that place, with the closest one suggested (`unknown_key_message`). A component
    written in a shape it cannot have (two names in one list item, a list for a strategy) is told as such, once;
    a boolean where text is expected gets a hint to quote it (YAML's `yes`/`no`/`on`). This is the one formatter
    for recipes, requests and every plugin's `Params`, so all of them read the same.
    """
    errors = exc.errors()
    # components (`ComponentSpec`) given as a mapping of several names: pydantic reports `name` missing and each
    # name an unknown key; say it once, at the item
    shapes = {tuple(err["loc"][:-1]): err.get("input") for err in errors
              if err["type"] == "missing" and err["loc"] and err["loc"][-1] == "name"
              and isinstance(err.get("input"), dict) and "name" not in err["input"]
              and known_keys(model, err["loc"][:-1])[:2] == _COMPONENT_KEYS}
    known = {i: known_keys(model, err["loc"][:-1]) for i, err in enumerate(errors) if err["type"] == "extra_forbidden"}
    # a required key misspelt is also reported missing; the suggestion for the typo already names it, so the
    # "Field required" of the key it suggests is the same mistake told twice
    meant = {(*errors[i]["loc"][:-1], closest_key(str(errors[i]["loc"][-1]), keys)) for i, keys in known.items()}
    lines = []
    for i, err in enumerate(errors):
        loc = tuple(err["loc"])
        if loc[:-1] in shapes:
            if err["type"] == "missing" and loc[-1] == "name":
                path = dotted_path(loc[:-1], prefix)
                lines.append(": ".join(p for p in (label, path, _component_shape_message(path, loc[:-1],
                                                                                         shapes[loc[:-1]])) if p))
            continue  # the unknown keys are the names themselves, told above
        if err["type"] == "missing" and loc in meant:
            continue
        message = err["msg"].removeprefix("Value error, ")  # a validator's own message needs no pydantic preamble
        if i in known:
            message = unknown_key_message(str(err["loc"][-1]), known[i])
        elif err["type"] == "model_type" and (err.get("ctx") or {}).get("class_name") == "ComponentSpec":
            message = _component_shape_message(dotted_path(loc, prefix), (), err.get("input"))
        elif err["type"] == "model_type":  # "a valid dictionary or instance of <a class the user never wrote>"
            message = f"expected a mapping of keys, got a {type(err.get('input')).__name__}"
        elif err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
            # a scalar is short enough to echo back; a mapping or list would swamp the message
            got = f"got {err.get('input')!r}"
            message += "" if got in message else f", {got}"
            if err["type"] == "string_type" and isinstance(err.get("input"), bool):
                message += YAML_BOOLEAN_HINT
        path = dotted_path(err["loc"], prefix)
        lines.append(": ".join(p for p in (label, path, message) if p))
    return sep.join(lines)


def validate_options(component: Any, params: dict[str, Any], path: str) -> BaseModel | None:
    """Validate a component's parameters against its `Params` model (None when it takes none)."""
    model = getattr(component, "Params", None)
    if model is None:
        if params:
            raise PlanError(path, f"takes no parameters, got {sorted(params)}")
        return None
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        raise PlanError("", format_validation_error(path, exc, model)) from None
