"""Tool calling on the chat endpoint: a request's `tools`, `tool_choice` and `parallel_tool_calls` resolved against
the server's tool-call format (`decodekit.api.tools.ToolCallFormat`, a plugin kind), the conversation's tool calls
and results written as the format writes them, the constraint that makes every returned call parse and validate, and
a finished output read back as OpenAI's `message.tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.api.params import ComponentSpec
from decodekit.api.tools import ParsedOutput, ToolCall, ToolCallFormat, ToolMode, ToolSpec
from decodekit.serve.errors import APIError
from decodekit.serve.protocol import ChatCompletionRequest, ChatMessage, FunctionCallOut, ToolCallOut


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls tools: the format, the tools it may call, `auto` or `required`, one call or several."""

    format: ToolCallFormat
    tools: list[ToolSpec]
    mode: ToolMode
    parallel: bool

    def processor(self) -> ComponentSpec:
        """The constraint processor of the calls (the structured-output plugin's `json_schema` or `grammar`)."""
        spec = self.format.constraint(self.tools, self.mode, self.parallel)
        if spec.kind == "json_schema":
            # a function with `strict: true` gets OpenAI's strict objects (only the keys they list), else its schema
            # is taken as written (JSON Schema's rule: other keys allowed)
            strict = any(t.strict for t in self.tools)
            return ComponentSpec(name="json_schema", params={"schema": json.loads(spec.text), "strict": strict})
        if spec.kind == "grammar":
            return ComponentSpec(name="grammar", params={"grammar": spec.text, "syntax": spec.syntax})
        raise APIError(500, f"tool format {self.format.name!r} gave a {spec.kind} constraint; tool calls need a "
                            "json_schema or a grammar", type="server_error")


def plan_tools(request: ChatCompletionRequest, format_class: type[ToolCallFormat]) -> ToolPlan | None:
    """The request's tool plan (None: no tools, or `tool_choice: none`).

    Raises:
        APIError: 400 for a `tool_choice` naming a function the request does not offer, or asking for calls with
            no tools, or `response_format` beside tools (one constraint per output).
    """
    tools = [ToolSpec(t.function.name, t.function.description, t.function.parameters or {"type": "object"},
                      bool(t.function.strict)) for t in request.tools or []]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique, got {names}", param="tools")
    choice = request.tool_choice
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise APIError(400, "tool_choice: asks for a tool call, but the request offers no tools", param="tool_choice")
    mode: ToolMode = "auto"
    if choice == "required":
        mode = "required"
    elif choice is not None and not isinstance(choice, str):
        wanted = choice.function.name
        if wanted not in names:
            raise APIError(400, f"tool_choice: function {wanted!r} is not one of the request's tools {names}",
                           param="tool_choice")
        tools, mode = [t for t in tools if t.name == wanted], "required"
    if request.response_format is not None and request.response_format.type != "text":
        raise APIError(400, "response_format: not with tools (a tool call's arguments follow its own schema)",
                       param="response_format")
    return ToolPlan(format_class(), tools, mode, request.parallel_tool_calls is not False)


def conversation(messages: Sequence[ChatMessage], tool_format: ToolCallFormat, plan: ToolPlan | None
                 ) -> list[dict[str, str]]:
    """The messages as the chat template gets them: assistant tool calls and tool results written as the format
    writes them, and (with a plan) the format's description of the tools as a system message first (joined to the
    conversation's own system message).

    Raises:
        APIError: 400 for a tool call whose arguments are not a JSON object, or a tool result that answers no
            earlier call, naming the message.
    """
    out: list[dict[str, str]] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object",
                                   param=f"messages[{i}].tool_calls")
                calls.append(ToolCall(call.function.name, arguments))
                if call.id:
                    names[call.id] = call.function.name
            out.append({"role": "assistant", "content": tool_format.assistant_content(m.text() or None, calls)})
        elif m.role == "tool":
            call_id = m.tool_call_id or ""
            if call_id not in names:
                raise APIError(400, f"messages[{i}].tool_call_id: a tool message answers a call an earlier assistant "
                                    f"message made; no call has id {call_id!r}", param=f"messages[{i}].tool_call_id")
            out.append(tool_format.tool_result(call_id, names[call_id], m.text()))
        else:
            out.append({"role": role, "content": m.text()})
    if plan is not None:
        prompt = plan.format.system_prompt(plan.tools, plan.mode, plan.parallel)
        if prompt:
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_formats_of(registry: Any) -> Mapping[str, type[ToolCallFormat]]:
    """The registered tool-call formats: name -> class."""
    return {name: entry.factory for name, entry in registry.tool_formats.items()}


def read_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCallOut]]:
    """A finished output's message: its text, or its calls (each with a new id, arguments as JSON text)."""
    parsed: ParsedOutput = plan.format.parse(text)
    calls = [ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                         function=FunctionCallOut(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)))
             for c in parsed.calls]
    return (None if calls else parsed.content), calls
