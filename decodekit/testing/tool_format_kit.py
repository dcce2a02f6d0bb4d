"""The tool-call format kit: `check_tool_format` holds a `ToolCallFormat` plugin to its contract on a tiny engine.

For several tool sets (parameter schemas with bounded values, so a random model's output ends), each mode (`auto`,
`required`) and one call or several, it checks: the constraint compiles; under `required`, what a tiny random model
writes under that constraint reads back as calls only, of the offered tools, with arguments valid against their
schemas (one call when not parallel); under `auto` it reads back as text or such calls; an assistant message written
back (`assistant_content`) reads back as the same calls, and the constraint admits it; a text answer, as the format
writes one, is admitted under `auto` and refused under `required`; and a tool result (`tool_result`) is a message
with a role and text content. An output read while it grows (`partial`, at every prefix) only grows (content and
each call's arguments by appending) and ends as its finished reading (content, and calls whose arguments text
parses to the parsed arguments). For a format with a `marker`, `auto` must be lazy: free texts (with `<`, brackets,
braces, a part of the marker) are admitted whole, text before calls is admitted and read back as the content, and
the marker followed by anything but a call is refused.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from decodekit.api.constraints import ConstraintSpec, get_backend
from decodekit.api.params import SamplingParams
from decodekit.api.partial_calls import PartialOutput
from decodekit.api.tools import ParsedOutput, ToolCall, ToolCallFormat, ToolMode, ToolSpec
from decodekit.testing.engine_harness import KitReport
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import tiny_llm

TOOL_SETS: list[list[ToolSpec]] = [
    [ToolSpec("get_weather", "The weather in a city.", {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False})],
    [ToolSpec("add", None, {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["a", "b"], "additionalProperties": False}),
     ToolSpec("flag", None, {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                             "additionalProperties": False})],
]
"""The tool sets the kit offers: one tool; two tools of different shapes. Values are bounded (enums, small
integers, booleans), so a random model's constrained output ends within the kit's token budget."""


def check_tool_format(format_class: type[ToolCallFormat], *plugins: object, max_tokens: int = 160,
                      tool_sets: list[list[ToolSpec]] | None = None) -> KitReport:
    """Check a tool-call format against its contract (module docstring); `plugins` are registered beside
    decodekit's own in the tiny engine (the format's own plugin, if its constraint needs one). Returns what was
    exercised (`requests`: constrained outputs read back).

    Raises:
        ConformanceError: a rule is broken (the message names it and shows the output).
    """
    requests, skipped = 0, []
    llm = tiny_llm(*plugins)
    fmt = format_class()
    tools_seen: dict[str, tuple[list[ToolSpec], list[ToolCall]]] = {}
    modes: tuple[ToolMode, ...] = ("required", "auto")
    cases = [(tools, mode, parallel) for tools in tool_sets or TOOL_SETS for mode in modes
             for parallel in (False, True)]
    outputs = iter(_generate(llm, fmt, cases, max_tokens))
    for tools in tool_sets or TOOL_SETS:
        schemas = {t.name: t.parameters for t in tools}
        for mode in modes:
            for parallel in (False, True):
                prompt = fmt.system_prompt(tools, mode, parallel)
                if prompt is not None and not isinstance(prompt, str):
                    raise ConformanceError(f"{fmt.name}: system_prompt must give a text or None, got {prompt!r}")
                text, finish = next(outputs)
                requests += 1
                parsed = fmt.parse(text)
                if mode == "required" and (parsed.content is not None or not parsed.calls):
                    if finish == "length":  # the budget ran out mid-call: nothing to read back is allowed
                        skipped.append(f"{mode}/{'parallel' if parallel else 'one'}: the budget ran out mid-call")
                        continue
                    raise ConformanceError(f"{fmt.name}: under required, the constrained output {text!r} did not "
                                           f"read back as calls only (got {parsed!r})")
                for call in parsed.calls:
                    if call.name not in schemas:
                        raise ConformanceError(f"{fmt.name}: a call of {call.name!r}, not one of the offered tools "
                                               f"{sorted(schemas)} (output {text!r})")
                    try:
                        jsonschema.validate(call.arguments, schemas[call.name])
                    except jsonschema.ValidationError as exc:
                        raise ConformanceError(f"{fmt.name}: the arguments of {call.name!r} do not validate "
                                               f"against its parameters ({exc.message}); output {text!r}") from None
                if not parallel and len(parsed.calls) > 1:
                    raise ConformanceError(f"{fmt.name}: {len(parsed.calls)} calls with parallel false "
                                           f"(output {text!r})")
                _check_partial(fmt, text, parsed, finish)
                spec = fmt.constraint(tools, mode, parallel)
                if parsed.calls:
                    tools_seen.setdefault(f"{mode}/{parallel}", (tools, parsed.calls))
                    written = fmt.assistant_content(None, parsed.calls)
                    again = fmt.parse(written).calls
                    if again != parsed.calls:
                        raise ConformanceError(f"{fmt.name}: assistant_content({parsed.calls!r}) reads back as "
                                               f"{again!r}, not the same calls")
                    if not constraint_admits(llm, spec, written):
                        raise ConformanceError(f"{fmt.name}: the {mode} constraint refuses the calls as the format "
                                               f"writes them: {written!r}")
                answer = fmt.assistant_content("a text answer", [])
                if constraint_admits(llm, spec, answer) != (mode == "auto"):
                    raise ConformanceError(f"{fmt.name}: the {mode} constraint "
                                           f"{'refuses' if mode == 'auto' else 'admits'} a text answer as the "
                                           f"format writes one: {answer!r}")
    if fmt.marker is not None:
        _check_lazy(llm, fmt, tools_seen)
    result = fmt.tool_result("call_1", "get_weather", "sunny")
    if not isinstance(result, dict) or not isinstance(result.get("role"), str) or \
            not isinstance(result.get("content"), str):
        raise ConformanceError(f"{fmt.name}: tool_result must give a message {{'role', 'content'}} (texts), got "
                               f"{result!r}")
    return KitReport(requests=requests, skipped=tuple(skipped))


FREE_TEXTS = ["", "Let me look that up.", "a < b, [1, 2] and {x}\n", "<", "<tool", "[TOOL", '{"name"']
"""Texts a lazy `auto` constraint must admit whole (where they hold no marker): what a model may write instead of a
call, including the first characters of common markers."""


def _check_lazy(llm: Any, fmt: ToolCallFormat, seen: dict[str, tuple[list[ToolSpec], list[ToolCall]]]) -> None:
    """Under `auto`, a format with a marker leaves text free until the marker and constrains what follows it."""
    marker = str(fmt.marker)
    for tools, calls in seen.values():
        spec = fmt.constraint(tools, "auto", True)
        for text in FREE_TEXTS:
            if marker not in text and not constraint_admits(llm, spec, text):
                raise ConformanceError(f"{fmt.name}: under auto the free text {text!r} is refused (the constraint "
                                       f"must switch on only at the marker {marker!r})")
        junk = f"Sure. {marker} nonsense"
        if constraint_admits(llm, spec, junk):
            raise ConformanceError(f"{fmt.name}: under auto the marker followed by no call is admitted: {junk!r}")
        written = fmt.assistant_content("Let me check.", calls)
        parsed = fmt.parse(written)
        if parsed.calls != calls or parsed.content != "Let me check.":
            raise ConformanceError(f"{fmt.name}: text before calls, {written!r}, reads back as {parsed!r}")
        if not constraint_admits(llm, spec, written):
            raise ConformanceError(f"{fmt.name}: under auto the constraint refuses text before calls: {written!r}")


def _check_partial(fmt: ToolCallFormat, text: str, parsed: ParsedOutput, finish: str | None) -> None:
    """Read at every prefix, the output only grows, and (unless the budget cut it) ends as its finished reading
    (formats that read partial outputs; the default reads nothing and streams the output whole at its end)."""
    previous = PartialOutput()
    for end in range(len(text) + 1):
        now = fmt.partial(text[:end])
        grown = now.content.startswith(previous.content) and len(now.calls) >= len(previous.calls) and all(
            b.arguments.startswith(a.arguments) and a.name in (None, b.name) for a, b in zip(previous.calls, now.calls))
        if not grown:
            raise ConformanceError(f"{fmt.name}: partial({text[:end]!r}) = {now!r} takes back what "
                                   f"partial({text[:end - 1]!r}) = {previous!r} read (streamed text only grows)")
        previous = now
    if previous == PartialOutput() or not parsed.calls or finish == "length":
        return
    if not (parsed.content or "").startswith(previous.content) or \
            [(c.name, _loaded(c.arguments)) for c in previous.calls] != [(c.name, c.arguments) for c in parsed.calls]:
        raise ConformanceError(f"{fmt.name}: the finished output {text!r} reads as {parsed!r}, but partial reads it "
                               f"as {previous!r} (the streamed calls would differ from the finished ones)")


def _loaded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def constraint_admits(llm: Any, spec: ConstraintSpec, text: str) -> bool:
    """Whether the constraint takes `text` whole, token by token as the engine's tokenizer writes it, and ends there
    (compiled by the engine's default backend, llguidance, for `llm`'s engine)."""
    engine = llm.engine
    backend = get_backend("llguidance", engine.tokenizer, engine.vocab_size, engine.eos_token_ids,
                          engine.registry.backend_loaders())
    matcher = backend.matcher(backend.compile(spec))
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume(ids)) and bool(matcher.is_accepting())


def _generate(llm: Any, fmt: ToolCallFormat, cases: list[tuple[list[ToolSpec], ToolMode, bool]],
              max_tokens: int) -> list[tuple[str, str | None]]:
    """What the tiny model writes under the format's constraint for each case (tools, mode, parallel), all in one
    batch (greedy outputs do not depend on the batch), and why each ended. The prompt is short: the tiny model's
    context is 512 tokens, and the constraint alone decides what is valid."""
    from decodekit.tool_calling import ToolPlan

    params = []
    for tools, mode, parallel in cases:
        try:
            processor = ToolPlan(fmt, tools, mode, parallel).processor()
        except Exception as exc:
            raise ConformanceError(f"{fmt.name}: the constraint is not one the engine can apply: {exc}") from None
        processors: list[Any] = [processor]
        if mode == "auto" and fmt.marker:
            # a random model seldom writes a marker by itself: pushed toward it, it starts calls under the lazy
            # constraint (which then carries each to its end), so `auto` is checked with calls, not only free text
            processors.insert(0, {"logit_bias": {"bias_strings": {fmt.marker: 8.0}}})
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0, processors=processors))
    outputs = llm.generate(["user: call a tool\nassistant:"] * len(cases), params)
    for output in outputs:
        if output.error is not None:
            raise ConformanceError(f"{fmt.name}: the constrained request failed: {output.error}")
    return [(str(o.outputs[0].text), o.outputs[0].finish_reason) for o in outputs]
