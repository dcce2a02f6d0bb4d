"""What a component (processor, stopping criterion, strategy, proposer) gets from the engine it serves, and how its
per-request parameters (`Params`) are validated, with errors that name the offending key."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ValidationError

from decodekit.api.errors import ConfigError
from decodekit.api.models import LoadedModel
from decodekit.api.proposer import ProposerModel


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
    """

    tokenizer: Any = None
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    device: torch.device | str = "cpu"
    model_name: str = ""
    draft: LoadedModel | None = None
    open_model: Callable[[LoadedModel], ProposerModel] | None = None


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


def format_validation_error(prefix: str, exc: ValidationError) -> str:
    """One line per pydantic error, each with its dotted key path under `prefix`."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        path = f"{prefix}.{loc}" if prefix and loc else prefix or loc
        got = err.get("input")
        suffix = "" if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f", got {got!r}"
        lines.append(f"{path}: {err['msg']}{suffix}")
    return "; ".join(lines)


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
        raise PlanError("", format_validation_error(path, exc)) from None
