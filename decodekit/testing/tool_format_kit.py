"""The tool-call format kit: `check_tool_format` holds a `ToolCallFormat` plugin to its contract on a tiny engine.

For several tool sets (parameter schemas with bounded values, so a random model's output ends), each mode (`auto`,
`required`) and one call or several, it checks: the constraint compiles; under `required`, what a tiny random model
writes under that constraint reads back as calls only, of the offered tools, with arguments valid against their
schemas (one call when not parallel); under `auto` it reads back as text or such calls; an assistant message written
back (`assistant_content`) reads back as the same calls, and the constraint admits it; a text answer, as the format
writes one, is admitted under `auto` and refused under `required`; and a tool result (`tool_result`) is a message
with a role and text content.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from decodekit.api.constraints import ConstraintSpec, get_backend
from decodekit.api.params import SamplingParams
from decodekit.api.tools import ToolCallFormat, ToolMode, ToolSpec
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
    for tools in tool_sets or TOOL_SETS:
        schemas = {t.name: t.parameters for t in tools}
        modes: tuple[ToolMode, ...] = ("required", "auto")
        for mode in modes:
            for parallel in (False, True):
                prompt = fmt.system_prompt(tools, mode, parallel)
                if prompt is not None and not isinstance(prompt, str):
                    raise ConformanceError(f"{fmt.name}: system_prompt must give a text or None, got {prompt!r}")
                text, finish = _generate(llm, fmt, tools, mode, parallel, max_tokens)
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
                spec = fmt.constraint(tools, mode, parallel)
                if parsed.calls:
                    written = fmt.assistant_content(None, parsed.calls)
                    again = fmt.parse(written).calls
                    if again != parsed.calls:
                        raise ConformanceError(f"{fmt.name}: assistant_content({parsed.calls!r}) reads back as "
                                               f"{again!r}, not the same calls")
                    if not _admits(llm, spec, written):
                        raise ConformanceError(f"{fmt.name}: the {mode} constraint refuses the calls as the format "
                                               f"writes them: {written!r}")
                answer = fmt.assistant_content("a text answer", [])
                if _admits(llm, spec, answer) != (mode == "auto"):
                    raise ConformanceError(f"{fmt.name}: the {mode} constraint "
                                           f"{'refuses' if mode == 'auto' else 'admits'} a text answer as the "
                                           f"format writes one: {answer!r}")
    result = fmt.tool_result("call_1", "get_weather", "sunny")
    if not isinstance(result, dict) or not isinstance(result.get("role"), str) or \
            not isinstance(result.get("content"), str):
        raise ConformanceError(f"{fmt.name}: tool_result must give a message {{'role', 'content'}} (texts), got "
                               f"{result!r}")
    return KitReport(requests=requests, skipped=tuple(skipped))


def _admits(llm: Any, spec: ConstraintSpec, text: str) -> bool:
    """Whether the constraint takes `text` whole (compiled by the engine's default backend, llguidance)."""
    engine = llm.engine
    backend = get_backend("llguidance", engine.tokenizer, engine.vocab_size, engine.eos_token_ids,
                          engine.registry.backend_loaders())
    matcher = backend.matcher(backend.compile(spec))
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume(ids)) and bool(matcher.is_accepting())


def _generate(llm: Any, fmt: ToolCallFormat, tools: list[ToolSpec], mode: ToolMode, parallel: bool,
              max_tokens: int) -> tuple[str, str | None]:
    """What the tiny model writes under the format's constraint (the prompt is short: the tiny model's context is
    512 tokens, and the constraint alone decides what is valid), and why it ended."""
    from decodekit.tool_calling import ToolPlan

    plan = ToolPlan(fmt, tools, mode, parallel)
    try:
        processor = plan.processor()
    except Exception as exc:
        raise ConformanceError(f"{fmt.name}: the constraint is not one the engine can apply: {exc}") from None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, processors=[processor])
    output = llm.generate(["user: call a tool\nassistant:"], params)[0]
    if output.error is not None:
        raise ConformanceError(f"{fmt.name}: the constrained request failed: {output.error}")
    return str(output.outputs[0].text), output.outputs[0].finish_reason
