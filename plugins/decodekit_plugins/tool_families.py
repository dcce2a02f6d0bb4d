"""The tool-call formats of model families trained to call tools, beside the generic `json` one:

- `hermes`: Hermes and Qwen 2.5/3, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call;
- `llama3_json`: Llama 3.1-3.3 custom tools, `{"name": ..., "parameters": {...}}` (calls apart with `; `; a leading
  `<|python_tag|>`, which Llama 3.1 may write before a call, is read back too);
- `mistral`: Mistral, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

Each has a marker, so under `tool_choice: auto` the model writes freely until the marker and a started call is
constrained to the end (`marked_calls`); under `required` the output starts with the marker. Each is picked for a
model whose chat template holds its `template_signature`.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from decodekit import hookimpl
from decodekit.api.constraints import ConstraintSpec
from decodekit.api.partial_calls import PartialOutput, held_content, partial_calls
from decodekit.api.tools import ParsedOutput, ToolCall, ToolCallFormat, ToolMode, ToolSpec, marked_calls

JSON_SPACING = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""Calls written as `json.dumps` writes them (and as the families' templates write history), one way only."""


def _spaced(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_SPACING}, separators=(",", ":"))


def _call_object(tool: ToolSpec, arguments_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _before(text: str, marker: str) -> str | None:
    """The text before the first call, less the whitespace that ends it (None when blank): as `held_content` streams
    it."""
    head = text.split(marker, 1)[0].rstrip()
    return head or None


def _listed(tools: list[ToolSpec]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                                  "parameters": t.parameters}}, ensure_ascii=False)
                     for t in tools)


class HermesToolFormat(ToolCallFormat):
    """Hermes / Qwen calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    marker = "<tool_call>"
    template_signature = "<tool_call>"
    CALL: ClassVar[re.Pattern[str]] = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def system_prompt(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> str | None:
        # the text Qwen 2.5's template writes for its tools
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{_listed(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    def constraint(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> ConstraintSpec:
        call = _spaced({"anyOf": [_call_object(t, "arguments") for t in tools]})
        more = ' ("\\n<tool_call>" body)*' if parallel else ""
        return marked_calls(self.marker, f"body{more}", mode, f'body: "\\n" {call} "\\n</tool_call>"')

    def parse(self, text: str) -> ParsedOutput:
        bodies = self.CALL.findall(text)
        if not bodies:
            return ParsedOutput(text)
        calls = []
        for body in bodies:
            try:
                value = json.loads(body)
            except ValueError:
                return ParsedOutput(text)
            if not isinstance(value, dict) or not isinstance(value.get("arguments"), dict):
                return ParsedOutput(text)
            calls.append(ToolCall(str(value.get("name")), value["arguments"]))
        return ParsedOutput(_before(text, self.marker), calls)

    def partial(self, text: str) -> PartialOutput:
        start = text.find(self.marker)
        content = held_content(text, [self.marker])
        if start < 0:
            return PartialOutput(content)
        calls = partial_calls(text, start + len(self.marker), "arguments", "\n</tool_call>\n<tool_call>")
        return PartialOutput(content, calls)

    def assistant_content(self, content: str | None, calls: list[ToolCall]) -> str:
        blocks = "\n".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}"
                           "\n</tool_call>" for c in calls)
        return "\n".join(filter(None, [content, blocks])) if calls else (content or "")

    def tool_result(self, call_id: str, name: str | None, content: str) -> dict[str, str]:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


class Llama3JsonToolFormat(ToolCallFormat):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several apart with `; `."""

    name = "llama3_json"
    marker = '{"name": '
    template_signature = "<|python_tag|>"
    PYTHON_TAG: ClassVar[str] = "<|python_tag|>"

    def system_prompt(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> str | None:
        # the text Llama 3.1's template writes for custom tools
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n"
                + _listed(tools))

    def constraint(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> ConstraintSpec:
        # after `{"name": `: one tool's quoted name, its parameters, and the closing brace
        rules = [f"rest: {' | '.join(f'rest_{i}' for i in range(len(tools)))}"]
        rules += [f'rest_{i}: {json.dumps(json.dumps(t.name) + ", " + chr(34) + "parameters" + chr(34) + ": ")} '
                  f'{_spaced(t.parameters)} "}}"' for i, t in enumerate(tools)]
        more = f' ("; " {json.dumps(self.marker)} rest)*' if parallel else ""
        return marked_calls(self.marker, f"rest{more}", mode, "\n".join(rules))

    def parse(self, text: str) -> ParsedOutput:
        body = text.replace(self.PYTHON_TAG, "")
        start = body.find(self.marker)
        if start < 0:
            return ParsedOutput(text)
        calls = []
        decoder = json.JSONDecoder()
        position = start
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except ValueError:
                return ParsedOutput(text)
            if not isinstance(value, dict) or not isinstance(value.get("parameters"), dict):
                return ParsedOutput(text)
            calls.append(ToolCall(str(value.get("name")), value["parameters"]))
            rest = body[end:]
            if not rest.strip():
                break
            if not rest.startswith("; "):
                return ParsedOutput(text)
            position = end + 2
        return ParsedOutput(_before(body, self.marker), calls)

    def partial(self, text: str) -> PartialOutput:
        body = text.replace(self.PYTHON_TAG, "")
        content = held_content(body, [self.marker, self.PYTHON_TAG])
        start = body.find(self.marker)
        if start < 0:
            return PartialOutput(content)
        return PartialOutput(content, partial_calls(body, start, "parameters", ";"))

    def assistant_content(self, content: str | None, calls: list[ToolCall]) -> str:
        written = "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False)
                            for c in calls)
        return "\n".join(filter(None, [content, written])) if calls else (content or "")

    def tool_result(self, call_id: str, name: str | None, content: str) -> dict[str, str]:
        # Llama 3.1's template renders a `tool` (or `ipython`) message as the ipython turn
        return {"role": "tool", "content": content}


class MistralToolFormat(ToolCallFormat):
    """Mistral calls: `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}`."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    template_signature = "[TOOL_CALLS]"

    def system_prompt(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> str | None:
        listed = json.dumps([{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                                "parameters": t.parameters}} for t in tools],
                            ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS]{listed}[/AVAILABLE_TOOLS]\nTo call tools, write [TOOL_CALLS] and a JSON list: "
                '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]')

    def constraint(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> ConstraintSpec:
        calls: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": {"anyOf": [_call_object(t, "arguments") for t in tools]}}
        if not parallel:
            calls["maxItems"] = 1
        return marked_calls(self.marker, _spaced(calls), mode)

    def parse(self, text: str) -> ParsedOutput:
        if self.marker not in text:
            return ParsedOutput(text)
        try:
            value = json.loads(text.split(self.marker, 1)[1])
        except ValueError:
            return ParsedOutput(text)
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("arguments"), dict)
                                                  for c in value):
            return ParsedOutput(text)
        return ParsedOutput(_before(text, self.marker), [ToolCall(str(c.get("name")), c["arguments"]) for c in value])

    def partial(self, text: str) -> PartialOutput:
        content = held_content(text, [self.marker])
        start = text.find(self.marker)
        if start < 0:
            return PartialOutput(content)
        opening = text.find("[", start + len(self.marker))
        return PartialOutput(content, partial_calls(text, opening + 1, "arguments", ",") if opening >= 0 else [])

    def assistant_content(self, content: str | None, calls: list[ToolCall]) -> str:
        if not calls:
            return content or ""
        written = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls], ensure_ascii=False)
        return "\n".join(filter(None, [content, self.marker + written]))

    def tool_result(self, call_id: str, name: str | None, content: str) -> dict[str, str]:
        return {"role": "user", "content": f"[TOOL_RESULTS]{json.dumps({'content': content})}[/TOOL_RESULTS]"}


@hookimpl
def decodekit_register_tool_formats(register: Any) -> None:
    """The tool-call formats of model families: Hermes/Qwen, Llama 3 JSON, Mistral."""
    register("hermes", HermesToolFormat)
    register("llama3_json", Llama3JsonToolFormat)
    register("mistral", MistralToolFormat)
