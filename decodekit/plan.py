"""Resolving what a request names (processors, stopping criteria, strategy) into built, validated components.

Each registered component is built once per engine (`Components`) and shared by every request that names it;
a request's own parameters are validated against the component's pydantic `Params` model. Errors say where:
`processors[1].repetition_penalty.penalty: Input should be greater than 0`, and an unknown name lists the
known ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from decodekit.errors import ConfigError, PluginError
from decodekit.params import ComponentSpec, SamplingParams
from decodekit.processors import LogitsProcessor, Stage
from decodekit.registry import Registry
from decodekit.stopping import StoppingCriterion
from decodekit.strategy import Strategy


class PlanError(ConfigError):
    """A request's or recipe's components are invalid; `path` names the offending key."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.reason = message


@dataclass
class ComponentInfo:
    """What components may need from the engine, given to their `setup` once after construction."""

    tokenizer: Any = None
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    device: Any = "cpu"
    model_name: str = ""
    draft: Any = None  # a `LoadedModel` when the engine has a draft model
    engine: Any = None


@dataclass(frozen=True)
class Plan:
    """A request's resolved components: processor stages in order, extra criteria, and the strategy."""

    stages: tuple[Stage, ...]
    criteria: tuple[tuple[StoppingCriterion, BaseModel | None], ...]
    strategy: Strategy
    strategy_options: BaseModel | None = None


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


@dataclass
class Components:
    """One built instance per registered name, and plan resolution against them."""

    registry: Registry
    info: ComponentInfo | None = None
    _built: dict[tuple[str, str], Any] = field(default_factory=dict)

    def get(self, kind: str, name: str, path: str = "") -> Any:
        """The shared instance of a registered component (built and set up on first use)."""
        key = (kind, name)
        if key not in self._built:
            try:
                entry = self.registry.get(kind, name)
            except PluginError as exc:
                raise PlanError(path, str(exc)) from None
            instance = entry.factory()
            if hasattr(instance, "bind"):  # components that look up other components (a strategy's proposers)
                instance.bind(self)
            if self.info is not None and hasattr(instance, "setup"):
                instance.setup(self.info)
            self._built[key] = instance
        return self._built[key]

    def implied_processors(self) -> list[LogitsProcessor]:
        """The default processors, which `SamplingParams` fields switch on (registration order)."""
        return [self.get("processors", e.name) for e in self.registry.processors.values() if e.default]

    def default_criteria(self) -> list[StoppingCriterion]:
        """The default stopping criteria, which apply to every request."""
        return [self.get("stopping_criteria", e.name) for e in self.registry.stopping_criteria.values() if e.default]

    def resolve(self, params: SamplingParams) -> Plan:
        """Build a request's plan; raise `PlanError` naming the offending key."""
        stages: list[Stage] = []
        listed: set[str] = set()
        for i, spec in enumerate(params.processors):
            path = f"processors[{i}].{spec.name}"
            proc = self.get("processors", spec.name, f"processors[{i}]")
            options = validate_options(proc, spec.params, path)
            check = getattr(proc, "check_options", None)
            if check is not None:
                try:
                    check(options)
                except ValueError as exc:
                    raise PlanError(path, str(exc)) from None
            stages.append(Stage(proc, options))
            listed.add(spec.name)
        for proc in self.implied_processors():
            implied = proc.from_sampling_params(params)
            if implied is None:
                continue
            if proc.name in listed:
                raise PlanError(f"processors.{proc.name}",
                                "set either in the sampling parameters or in the processors list, not both")
            stages.append(Stage(proc, implied))
        criteria = []
        for i, spec in enumerate(params.stopping):
            crit = self.get("stopping_criteria", spec.name, f"stopping[{i}]")
            criteria.append((crit, validate_options(crit, spec.params, f"stopping[{i}].{spec.name}")))
        spec = params.strategy or ComponentSpec(name="sample")
        strategy: Strategy = self.get("strategies", spec.name, "strategy")
        strategy_options = validate_options(strategy, spec.params, f"strategy.{spec.name}")
        try:
            strategy.check_compatible(strategy_options, params, tuple(stages))
        except ValueError as exc:
            raise PlanError(f"strategy.{spec.name}", str(exc)) from None
        return Plan(tuple(stages), tuple(criteria), strategy, strategy_options)
