"""decodekit's own tool-call format: generic JSON, for models with no tool-call format of their own (the bundled
SmolLM2 among them), as llama.cpp's server does for such models.

The model is told the tools in a system message and answers with one JSON object: `{"tool_calls": [{"name": ...,
"arguments": {...}}]}` to call tools, or `{"response": "..."}` to answer in text (under `tool_choice: auto`). The
output is constrained to exactly those objects (a JSON schema: each call's `name` one of the tools, its
`arguments` that tool's `parameters` schema), so every call that comes back parses and validates; a named
`tool_choice` narrows the calls to that tool, `parallel_tool_calls: false` to one call.
"""

from __future__ import annotations

import json
from typing import Any

from decodekit import hookimpl
from decodekit.api.constraints import ConstraintSpec
from decodekit.api.partial_calls import PartialOutput, partial_calls, partial_string, skip_space
from decodekit.api.tools import ParsedOutput, ToolCall, ToolCallFormat, ToolMode, ToolSpec


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


class JsonToolFormat(ToolCallFormat):
    """Generic JSON tool calls: `{"tool_calls": [{"name", "arguments"}]}` or `{"response": text}`."""

    name = "json"

    def system_prompt(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> str | None:
        listed = json.dumps([{"name": t.name, "description": t.description or "", "parameters": t.parameters}
                             for t in tools], ensure_ascii=False)
        calls = ('{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}' +
                 (", ..." if parallel else "") + "]}")
        answer = ("" if mode == "required" else
                  ' To answer without a tool, reply {"response": "<your answer>"}.')
        return (f"You can call these tools:\n{listed}\nTo call tools, reply with JSON only: {calls}." + answer +
                " Tool results come back in messages from the tool.")

    def constraint(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> ConstraintSpec:
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
        if not parallel:
            calls["maxItems"] = 1
        call_object = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                       "additionalProperties": False}
        if mode == "required":
            return ConstraintSpec.json_schema(call_object)
        text_object = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                       "additionalProperties": False}
        return ConstraintSpec.json_schema({"anyOf": [call_object, text_object]})

    def parse(self, text: str) -> ParsedOutput:
        try:
            value = json.loads(text)
        except ValueError:
            # a text answer cut by max_tokens reads back as the text it got to (as it streamed); anything else as is
            response = self._response(text)
            return ParsedOutput(response if response is not None else text)
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            calls = [ToolCall(c["name"], c["arguments"]) for c in value["tool_calls"]
                     if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)]
            return ParsedOutput(None, calls)
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return ParsedOutput(value["response"])
        return ParsedOutput(text)

    def partial(self, text: str) -> PartialOutput:
        response = self._response(text)
        if response is not None:
            return PartialOutput(response)
        start = self._value_of(text, "tool_calls")
        if start is None or not text.startswith("[", start):
            return PartialOutput()
        return PartialOutput(calls=partial_calls(text, start + 1, "arguments", ","))

    @staticmethod
    def _value_of(text: str, key: str) -> int | None:
        """Where the value of the object's first key starts, when that key is `key` (else None)."""
        i = skip_space(text, 0)
        if not text.startswith("{", i):
            return None
        i = skip_space(text, i + 1)
        if not text.startswith(json.dumps(key), i):
            return None
        i = skip_space(text, i + len(key) + 2)
        if not text.startswith(":", i):
            return None
        return skip_space(text, i + 1)

    def _response(self, text: str) -> str | None:
        """The text answer (`{"response": ...}`) as far as written; None when the output is not one."""
        start = self._value_of(text, "response")
        if start is None or not text.startswith('"', start):
            return None
        return partial_string(text, start)[0]

    def assistant_content(self, content: str | None, calls: list[ToolCall]) -> str:
        if calls:
            return json.dumps({"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]},
                              ensure_ascii=False)
        return json.dumps({"response": content or ""}, ensure_ascii=False)

    def tool_result(self, call_id: str, name: str | None, content: str) -> dict[str, str]:
        result = {"tool_response": {"name": name, "id": call_id, "content": content}}
        return {"role": "user", "content": json.dumps(result, ensure_ascii=False)}


@hookimpl
def decodekit_register_tool_formats(register: Any) -> None:
    """decodekit's own tool-call formats."""
    register("json", JsonToolFormat)
