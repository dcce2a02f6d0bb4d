"""Planning a reasoning request's phases (`SamplingParams.reasoning`) into its `PhaseProgram`.

The checks that need no engine run wherever a plan is made (`decodekit recipe check` too): the format is registered,
every configured phase is one of the format's, a budget is set only on a phase the format can close, a wrap-up
message contains none of the format's markers (it would end the phase early), and every phase's processors resolve.
Inside an engine the markers, openings, wrap-ups and closings are encoded with its tokenizer. Errors name the key:
`reasoning.format`, `reasoning.commentary`, `reasoning.answer.budget`, `reasoning.answer.processors[0].json_schema`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from decodekit.api.components import PlanError
from decodekit.api.errors import PluginError
from decodekit.api.params import ComponentSpec, PhaseParams, ReasoningParams, SamplingParams
from decodekit.api.processors import Stage
from decodekit.api.reasoning import ReasoningFormat
from decodekit.core.phases import ARGMAX, CompiledMarker, PhaseProgram, PhaseRuntime

Pipeline = Callable[[SamplingParams, list[tuple[ComponentSpec, str]]], list[Stage]]
"""Builds one pipeline: the listed processors (each with its key path), then the ones the parameters imply."""


def plan_phases(params: SamplingParams, reasoning: ReasoningParams, fmt_lookup: Callable[[str], Any],
                pipeline: Pipeline, tokenizer: Any) -> PhaseProgram:
    """The request's phases; raises `PlanError` naming the offending key."""
    try:
        fmt: ReasoningFormat = fmt_lookup(reasoning.format)()
    except PluginError as exc:
        raise PlanError("reasoning.format", str(exc)) from None
    configured = reasoning.phases
    for name in configured:
        if name not in fmt.phases:
            raise PlanError(f"reasoning.{name}", f"the {fmt.name} format has no phase {name!r}; its phases: "
                            f"{', '.join(fmt.phases)}")
    listed = [(spec, f"processors[{i}]") for i, spec in enumerate(params.processors)]
    phases: dict[str, PhaseRuntime] = {}
    for name in fmt.phases:
        settings = configured.get(name, PhaseParams())
        _check_budget(fmt, name, settings)
        try:
            phase_params = params.for_phase(settings)
        except ValidationError as exc:  # the phase's sampling value is out of range
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise PlanError(f"reasoning.{name}.sampling.{where}", error["msg"]) from None
        own = [(spec, f"reasoning.{name}.processors[{i}]") for i, spec in enumerate(settings.processors)]
        stages = pipeline(phase_params, listed + own)
        if phase_params.temperature == 0.0 and not params.greedy:
            stages.append(Stage(ARGMAX))  # greedy here, sampled elsewhere: the strategy samples this row's argmax
        forced, end_to = _forced_end(fmt, name, settings, tokenizer)
        phases[name] = PhaseRuntime(name, tuple(stages), phase_params, settings.budget, forced, end_to)
    markers = tuple(CompiledMarker(_encode(tokenizer, t.marker), t.to, t.after) for t in fmt.transitions
                    ) if tokenizer is not None else ()
    openings = {name: _encode(tokenizer, fmt.opening(name)) for name in fmt.phases} if tokenizer is not None else {}
    program = PhaseProgram(format=fmt, phases=phases, markers=markers, openings=openings, tokenizer=tokenizer)
    if tokenizer is not None:
        for name, runtime in phases.items():
            if runtime.forced_end and runtime.end_to is None:
                raise PlanError(f"reasoning.{name}.budget", f"the {fmt.name} format's closing of {name!r} leads to "
                                "no other phase (a format bug)")
    return program


def _check_budget(fmt: ReasoningFormat, name: str, settings: PhaseParams) -> None:
    if settings.budget is not None and fmt.closing(name) is None:
        raise PlanError(f"reasoning.{name}.budget", f"the {fmt.name} format cannot end its {name!r} phase early; "
                        "limit the whole output with max_tokens instead")
    bad = [m for m in fmt.markers() if m and m in settings.wrap_up]
    if bad:
        raise PlanError(f"reasoning.{name}.wrap_up", f"the wrap-up message contains the marker {bad[0]!r}, which "
                        "would end the phase before the budget does")


def _forced_end(fmt: ReasoningFormat, name: str, settings: PhaseParams, tokenizer: Any
                ) -> tuple[tuple[tuple[int, bool], ...], str | None]:
    """The tokens forced when the phase's budget runs out (wrap-up text, then closing marker) and where they lead."""
    closing = fmt.closing(name)
    if settings.budget is None or closing is None or tokenizer is None:
        return (), None
    wrap = _encode(tokenizer, settings.wrap_up) if settings.wrap_up else ()
    close = _encode(tokenizer, closing)
    leads = [t for t in fmt.transitions if t.applies(name) and closing.endswith(t.marker)]
    return (*((t, False) for t in wrap), *((t, True) for t in close)), (leads[0].to if leads else None)


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()
