"""Resolving what a request names (processors, stopping criteria, strategy) into built, validated components.

Each registered component is built once per engine (`Components`) and shared by every request that names it;
a request's own parameters are validated against the component's pydantic `Params` model. Errors say where:
`processors[1].repetition_penalty.penalty: Input should be greater than 0`, and an unknown name lists the
known ones.

Checking a request's options has two parts (`Components.check_options`), the same for every kind of component:

- `check_options(options)`: static checks, run wherever a plan is made: by `decodekit recipe check` (no engine,
  `setup` never called) and when an engine plans a request;
- `check_options_with(options, info)`: checks that need the engine (its tokenizer, vocabulary, draft model), run
  only by `Components` that serve an engine, after the component's `setup(info)`, with the same `info`.

Both are optional and raise `ValueError`; the message gets the key path of the options (`processors[0].logit_bias`,
`stopping[1].my_criterion`, `strategy.my_strategy`, `strategy.speculative.proposer_options`).
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
from decodekit.api.sampling import TEMPERATURE_PROCESSOR
from decodekit.api.sequence import Sequence
from decodekit.api.stopping import StopDecision, StoppingCriterion
from decodekit.api.strategy import Strategy
from decodekit.core.phase_plan import plan_phases
from decodekit.core.phases import ROUTER, PhaseProgram
from decodekit.core.registry import Registry

GREEDY_FIELD_PROCESSOR = TEMPERATURE_PROCESSOR
"""The default processor behind `SamplingParams.temperature`: at temperature 0 (greedy) it implies no stage, but
the temperature is set all the same, so naming it in the processors list too is the same conflict as at 0.8."""


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
    (the default ones its parameters switch on, then the ones it names), the strategy, and a reasoning request's
    phases (`decodekit.core.phases`)."""

    stages: tuple[Stage, ...]
    criteria: tuple[CriterionStage, ...]
    strategy: Strategy
    strategy_options: BaseModel | None = None
    phases: PhaseProgram | None = None
    """A reasoning request's phases (its one stage is then the phase router), else None."""


@dataclass
class Components:
    """One built instance per registered name, and plan resolution against them."""

    registry: Registry
    info: ComponentInfo | None = None
    _built: dict[tuple[str, str], Any] = field(default_factory=dict)

    def check_options(self, component: Any, options: BaseModel | None, path: str) -> None:
        """Run a component's own checks of a request's validated options, raising `PlanError` at `path`.

        First its `check_options(options)` (static: no engine needed), then, when these components serve an
        engine, its `check_options_with(options, info)` (after `setup(info)`: the tokenizer, vocabulary and draft
        model are there). Either is optional; a `ValueError` from either refuses the request (or recipe). A
        component with options of its own to check in turn (the `speculative` strategy's proposer) calls this for
        them, so they follow the same lifecycle and their errors name their own key path.
        """
        try:
            static = getattr(component, "check_options", None)
            if static is not None:
                static(options)
            if self.info is not None:
                with_engine = getattr(component, "check_options_with", None)
                if with_engine is not None:
                    with_engine(options, self.info)
        except ValueError as exc:  # PlanError is no ValueError: one raised by a nested check keeps its own path
            raise PlanError(path, str(exc)) from None

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
        phases: PhaseProgram | None = None
        if params.reasoning is not None:
            tokenizer = self.info.tokenizer if self.info is not None else None
            phases = plan_phases(params, params.reasoning,
                                 lambda name: self.registry.get("reasoning_formats", name).factory,
                                 self._pipeline, tokenizer)
            stages = [Stage(ROUTER, phases)]
            checked = tuple(stage for rt in phases.phases.values() for stage in rt.stages)
        else:
            stages = self._pipeline(params, [(spec, f"processors[{i}]") for i, spec in enumerate(params.processors)])
            checked = tuple(stages)
        criteria = [CriterionStage(crit, default=True) for crit in self.default_criteria() if crit.is_active(params)]
        for i, spec in enumerate(params.stopping):
            path = f"stopping[{i}].{spec.name}"
            crit = self.get("stopping_criteria", spec.name, f"stopping[{i}]")
            crit_options = validate_options(crit, spec.params, path)
            self.check_options(crit, crit_options, path)
            criteria.append(CriterionStage(crit, crit_options))
        spec = params.strategy or ComponentSpec(name="sample")
        strategy: Strategy = self.get("strategies", spec.name, "strategy")
        strategy_options = validate_options(strategy, spec.params, f"strategy.{spec.name}")
        self.check_options(strategy, strategy_options, f"strategy.{spec.name}")
        try:
            strategy.check_compatible(strategy_options, params, checked)
        except ValueError as exc:
            raise PlanError(f"strategy.{spec.name}", str(exc)) from None
        return Plan(tuple(stages), tuple(criteria), strategy, strategy_options, phases)

    def _pipeline(self, params: SamplingParams, listed: list[tuple[ComponentSpec, str]]) -> list[Stage]:
        """One pipeline: the listed processors in order (each spec with its key path), then the default processors
        the sampling fields switch on."""
        stages: list[Stage] = []
        names: set[str] = set()
        for spec, at in listed:
            path = f"{at}.{spec.name}"
            proc = self.get("processors", spec.name, at)
            options = validate_options(proc, spec.params, path)
            self.check_options(proc, options, path)
            stages.append(Stage(proc, options))
            names.add(spec.name)
        for proc in self.implied_processors():
            implied = proc.from_sampling_params(params)
            # temperature 0 implies no stage (greedy takes the argmax), yet it is a temperature set in the sampling
            # parameters all the same: a listed temperature would be silently overridden by greedy decoding
            greedy_conflict = proc.name == GREEDY_FIELD_PROCESSOR and params.temperature == 0.0
            if implied is None and not greedy_conflict:
                continue
            if proc.name in names:
                hint = (" (sampling.temperature is 0: greedy decoding, which the listed temperature cannot change; "
                        "give the temperature in one place)" if greedy_conflict else "")
                raise PlanError(f"processors.{proc.name}",
                                "set either in the sampling parameters or in the processors list, not both" + hint)
            if implied is None:
                continue
            stages.append(Stage(proc, implied))
        return stages
