"""The reasoning-format kit: `check_reasoning_format` holds a `ReasoningFormat` plugin to its contract.

Statically: its phases name every transition's target and origin, its reasoning phases and where it begins; each
closing completes a transition out of its phase; a prompt ending with the opening (whitespace after it aside) starts
in the phase it opens, one without it in `begins`; and `split` cuts an output written as opening, text, closing, text
into those two stretches, markers removed (hypothesis draws the texts). On a tiny engine, whose tokenizer splits the
markers into several tokens: under a budget (0, a few, more than the output), the opening is forced when the prompt
did not open the phase, the closing follows the wrap-up exactly at the budget unless the model closed the phase
itself, and the engine's reasoning and answer are what `split` makes of the same text.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit.api.hookspecs import hookimpl
from decodekit.api.params import SamplingParams
from decodekit.api.reasoning import START, ReasoningFormat
from decodekit.testing.engine_harness import KitReport
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import tiny_llm

WRAP_UP = " OK, the answer."
"""The wrap-up message the kit forces before the closing."""


class _Registers:
    """Registers the format under test where the engine's plugins do not."""

    def __init__(self, format_class: type[ReasoningFormat]) -> None:
        self.format_class = format_class

    @hookimpl
    def decodekit_register_reasoning_formats(self, register: Any) -> None:
        register(self.format_class.name, self.format_class)


def check_reasoning_format(format_class: type[ReasoningFormat], *plugins: object, budgets: tuple[int, ...] = (0, 3, 9),
                           max_tokens: int = 128) -> KitReport:
    """Check a reasoning format against its contract (module docstring); `plugins` are registered beside decodekit's
    own in the tiny engine. Returns what was exercised (`requests`: outputs checked on the engine).

    Raises:
        ConformanceError: a rule is broken (the message names it and shows the output).
    """
    fmt = format_class()
    _check_shape(fmt)
    _check_split(fmt)
    llm = tiny_llm(*plugins)
    known = llm.engine.components.registry.reasoning_formats.get(fmt.name)
    if known is None:
        llm = tiny_llm(*plugins, _Registers(format_class))
    elif known.factory is not format_class:
        raise ConformanceError(f"{fmt.name}: another format is registered under this name ({known.factory!r})")
    requests = 0
    closing = fmt.closing(fmt.begins)
    for budget in budgets:
        if closing is None:
            break
        rules = {"format": fmt.name, fmt.begins: {"budget": budget, "wrap_up": WRAP_UP}}
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, skip_special_tokens=False,
                                reasoning=rules)
        out = llm.generate(["The quick brown fox"], params)[0]
        requests += 1
        if out.error is not None:
            raise ConformanceError(f"{fmt.name}: a request with a {fmt.begins} budget of {budget} failed: {out.error}")
        _check_output(fmt, llm.tokenizer, out.outputs[0], budget, closing)
    return KitReport(requests=requests, skipped=() if closing is not None else (
        f"{fmt.begins!r} has no closing: no budget to check",))


def _check_shape(fmt: ReasoningFormat) -> None:
    phases = set(fmt.phases)
    if not fmt.name:
        raise ConformanceError(f"{type(fmt).__name__}: `name` is empty")
    if fmt.begins not in phases or not fmt.reasoning_phases <= phases:
        raise ConformanceError(f"{fmt.name}: `begins` and `reasoning_phases` must be among its phases {fmt.phases}")
    for t in fmt.transitions:
        if not t.marker or t.to not in phases or not set(t.after) <= phases | {START}:
            raise ConformanceError(f"{fmt.name}: transition {t!r} names a phase the format lacks (or no marker)")
    for phase in fmt.phases:
        closing = fmt.closing(phase)
        if closing is not None and not any(closing.endswith(t.marker) and t.applies(phase) and t.to != phase
                                           for t in fmt.transitions):
            raise ConformanceError(f"{fmt.name}: closing({phase!r}) = {closing!r} completes no transition out of it")
    opening = fmt.opening(fmt.begins)
    if fmt.initial_phase("A question?") != (fmt.begins, False):
        raise ConformanceError(f"{fmt.name}: a prompt without markers must start in {fmt.begins!r}, not yet opened")
    if opening and fmt.initial_phase(f"A question?{opening}\n") != (fmt.begins, True):
        raise ConformanceError(f"{fmt.name}: a prompt ending with the opening {opening!r} must start in "
                               f"{fmt.begins!r}, opened")


def _check_split(fmt: ReasoningFormat) -> None:
    closing = fmt.closing(fmt.begins)
    if closing is None:
        return
    after = next(t.to for t in fmt.transitions if closing.endswith(t.marker) and t.applies(fmt.begins))
    opening = fmt.opening(fmt.begins)
    words = st.lists(st.sampled_from(["fox", " jumps", " 42", "\n", ".", " über"]), max_size=6).map("".join)

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(thinking=words, answer=words)
    def split_round_trips(thinking: str, answer: str) -> None:
        text = f"{opening}{thinking}{closing}{answer}"
        got = [(s.phase, s.text) for s in fmt.split(text, START if opening else fmt.begins)]
        want = [(p, t) for p, t in ((fmt.begins, thinking), (after, answer)) if t]
        if got != want:
            raise ConformanceError(f"{fmt.name}: split({text!r}) gave {got}, expected {want}")

    split_round_trips()


def _check_output(fmt: ReasoningFormat, tokenizer: Any, output: Any, budget: int, closing: str) -> None:
    ids, opening = list(output.token_ids), fmt.opening(fmt.begins)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    opened = tokenizer.encode(opening, add_special_tokens=False) if opening else []
    if ids[: len(opened)] != opened:
        raise ConformanceError(f"{fmt.name}: the opening {opening!r} was not forced first: {text!r}")
    forced = tokenizer.encode(WRAP_UP, add_special_tokens=False) + tokenizer.encode(closing, add_special_tokens=False)
    start = len(opened) + budget
    early = closing in tokenizer.decode(ids[len(opened) : start], skip_special_tokens=False)
    if not early and len(ids) >= start + len(forced) and ids[start : start + len(forced)] != forced:
        raise ConformanceError(f"{fmt.name}: with a budget of {budget}, the wrap-up and {closing!r} must follow "
                               f"{budget} tokens of thinking: {text!r}")
    if len(ids) < start + len(forced) and not early:
        return  # the output ended while the closing was being forced: the text holds part of a marker
    segments = fmt.split(text, START if opening else fmt.begins)
    reasoning = "".join(s.text for s in segments if s.phase in fmt.reasoning_phases)
    answer = "".join(s.text for s in segments if s.phase not in fmt.reasoning_phases)
    if (output.reasoning_text, output.text) != (reasoning, answer):
        raise ConformanceError(f"{fmt.name}: the engine's split ({output.reasoning_text!r}, {output.text!r}) is "
                               f"not the format's split of the same text ({reasoning!r}, {answer!r})")
