"""Resolving what a request names (processors, stopping criteria, strategy) into built, validated components.

Each registered component is built once per engine (`Components`) and shared by every request that names it;
a request's own parameters are validated against the component's pydantic `Params` model. Errors say where:
`processors[1].repetition_penalty.penalty: Input should be greater than 0`, and an unknown name lists the
known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from decodekit.api.components import ComponentInfo, PlanError, validate_options
from decodekit.api.constraints import BackendLoader
from decodekit.api.errors import PluginError
from decodekit.api.params import ComponentSpec, SamplingParams
from decodekit.api.processors import LogitsProcessor, Stage
from decodekit.api.sequence import Sequence
from decodekit.api.stopping import StopDecision, StoppingCriterion
from decodekit.api.strategy import Strategy
from decodekit.core.registry import Registry


@dataclass(frozen=True)
class CriterionStage:
    """One stopping criterion of a request's plan, with that request's validated parameters."""

    criterion: StoppingCriterion
    options: BaseModel | None = None
    default: bool = False  # a default criterion (always on where `is_active`): its `check` takes no options

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> StopDecision | None:
        """The criterion's decision on the newest token of `seq`."""
        if self.default:
            return self.criterion.check(seq, params, eos_token_ids)
        return self.criterion.check(seq, params, eos_token_ids, self.options)


@dataclass(frozen=True)
class Plan:
    """A request's resolved components: processor stages in order, stopping criteria in the order they are checked
    (the default ones its parameters switch on, then the ones it names), and the strategy."""

    stages: tuple[Stage, ...]
    criteria: tuple[CriterionStage, ...]
    strategy: Strategy
    strategy_options: BaseModel | None = None


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
            if hasattr(instance, "bind"):  # components that use others (a strategy's proposers, a backend table)
                instance.bind(self)
            if self.info is not None and hasattr(instance, "setup"):
                instance.setup(self.info)
            self._built[key] = instance
        return self._built[key]

    def built(self, kind: str) -> list[Any]:
        """The instances of one kind ("processors", "proposers", ...) built so far (by `get`, or by `resolve`)."""
        return [instance for (k, _), instance in self._built.items() if k == kind]

    def backend_loaders(self) -> Mapping[str, BackendLoader]:
        """The registered structured-output backends: name -> loader of the backend class."""
        return self.registry.backend_loaders()

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
        criteria = [CriterionStage(crit, default=True) for crit in self.default_criteria() if crit.is_active(params)]
        for i, spec in enumerate(params.stopping):
            crit = self.get("stopping_criteria", spec.name, f"stopping[{i}]")
            criteria.append(CriterionStage(crit, validate_options(crit, spec.params, f"stopping[{i}].{spec.name}")))
        spec = params.strategy or ComponentSpec(name="sample")
        strategy: Strategy = self.get("strategies", spec.name, "strategy")
        strategy_options = validate_options(strategy, spec.params, f"strategy.{spec.name}")
        try:
            strategy.check_compatible(strategy_options, params, tuple(stages))
        except ValueError as exc:
            raise PlanError(f"strategy.{spec.name}", str(exc)) from None
        return Plan(tuple(stages), tuple(criteria), strategy, strategy_options)
