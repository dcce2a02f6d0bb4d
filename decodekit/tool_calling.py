"""Tool calling, shared by `LLM.chat(..., tools=...)` and the server's chat endpoint: OpenAI-shaped tools and
`tool_choice` resolved against a tool-call format (`decodekit.api.tools.ToolCallFormat`, a plugin kind) into a
`ToolPlan`, the conversation's calls and results written as the format writes them, the constraint processor that
makes every returned call parse and validate, and a finished output read back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.api.errors import ConfigError, RequestError
from decodekit.api.params import ComponentSpec, SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.api.tools import ParsedOutput, ToolCall, ToolCallFormat, ToolMode, ToolSpec, detect_tool_format


class ToolRequestError(RequestError):
    """A request's tools, `tool_choice` or tool messages are invalid; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls tools: the format, the tools it may call, `auto` or `required`, one call or several."""

    format: ToolCallFormat
    tools: list[ToolSpec]
    mode: ToolMode
    parallel: bool
    template_renders_tools: bool = False
    """The model's chat template is its family's (it holds the format's signature) and takes `tools=`: it describes
    the tools as the model was trained to read them, so the format's own system prompt is left out."""

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
        raise RequestError(f"tool format {self.format.name!r} gave a {spec.kind} constraint; tool calls need a "
                           "json_schema or a grammar")

    def read(self, text: str) -> ParsedOutput:
        """A finished output read back: its text, or its calls."""
        return self.format.parse(text)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the calls' constraint added after its own processors."""
        return params.model_copy(update={"processors": [*params.processors, self.processor()]})

    def read_into(self, output: RequestOutput) -> RequestOutput:
        """A finished output with each choice's calls read back into its `tool_calls` (finish reason
        `tool_calls`); a choice that reads back as text is left as it is."""
        for choice in output.outputs:
            calls = self.read(choice.text).calls
            if calls:
                choice.tool_calls, choice.finish_reason = calls, "tool_calls"
        return output

    def system_prompt(self) -> str | None:
        """The format's description of the tools (None: the chat template is given `tools=`)."""
        if self.template_renders_tools:
            return None
        return self.format.system_prompt(self.tools, self.mode, self.parallel)


def calls_row(calls: Sequence[ToolCall] | None) -> list[dict[str, str]] | None:
    """Calls as an output row holds them (`decodekit run --output`, batch outputs): `{"name", "arguments"}`, the
    arguments as JSON text (OpenAI's shape); None for no calls."""
    if not calls:
        return None
    return [{"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)} for c in calls]


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """OpenAI's tool definitions (`{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}`) as `ToolSpec`s.

    Raises:
        ToolRequestError: a definition that is not a function tool with a name, or two with one name.
    """
    specs = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping) \
                or not isinstance(function.get("name"), str):
            raise ToolRequestError(f"tools[{i}]: a function tool is {{\"type\": \"function\", \"function\": "
                                   "{\"name\": ..., \"parameters\": {...}}}", param=f"tools[{i}]")
        parameters = function.get("parameters") or {"type": "object"}
        specs.append(ToolSpec(function["name"], function.get("description"), dict(parameters),
                              bool(function.get("strict"))))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ToolRequestError(f"tools: function names must be unique, got {names}", param="tools")
    return specs


def plan_tools(tools: list[ToolSpec], choice: str | Mapping[str, Any] | None, parallel: bool | None,
               format_class: type[ToolCallFormat], chat_template: str | None = None) -> ToolPlan | None:
    """The request's tool plan (None: no tools, or `tool_choice: none`); `choice` is OpenAI's `tool_choice` (`none`,
    `auto`, `required`, or `{"type": "function", "function": {"name": ...}}`). A `chat_template` of the format's
    family that takes `tools` describes them itself (`ToolPlan.template_renders_tools`).

    Raises:
        ToolRequestError: a `tool_choice` naming a function the request does not offer, or asking for calls with
            no tools.
    """
    if choice == "none" or (choice is None and not tools):
        return None
    tools, mode = choose_tools(tools, choice)
    signature = format_class.template_signature
    own_template = bool(chat_template and signature and signature in chat_template and "tools" in chat_template)
    return ToolPlan(format_class(), tools, mode, parallel is not False, own_template)


def choose_tools(tools: list[ToolSpec], choice: str | Mapping[str, Any] | None) -> tuple[list[ToolSpec], ToolMode]:
    """The tools a request may call under `choice` (`auto`, `required` or a named function; not `none`) and the
    mode.

    Raises:
        ToolRequestError: a `tool_choice` naming a function the request does not offer, or asking for calls with
            no tools.
    """
    if not tools:
        raise ToolRequestError("tool_choice: asks for a tool call, but the request offers no tools",
                               param="tool_choice")
    if choice == "required":
        return tools, "required"
    if isinstance(choice, Mapping):
        wanted = (choice.get("function") or {}).get("name")
        if wanted not in [t.name for t in tools]:
            raise ToolRequestError(f"tool_choice: function {wanted!r} is not one of the request's tools "
                                   f"{[t.name for t in tools]}", param="tool_choice")
        return [t for t in tools if t.name == wanted], "required"
    if choice not in (None, "auto"):
        raise ToolRequestError(f"tool_choice: none, auto, required or a named function, got {choice!r}",
                               param="tool_choice")
    return tools, "auto"


def choose_format(name: str, formats: Mapping[str, type[ToolCallFormat]], chat_template: str | None
                  ) -> type[ToolCallFormat]:
    """The format named `name`, or with `auto` the one the chat template shows (`detect_tool_format`: the format
    whose signature, its call marker, the template holds; `json` where none does).

    Raises:
        ConfigError: an unknown name (the known ones named).
    """
    if name == "auto":
        name = detect_tool_format(chat_template, dict(formats))
    if name not in formats:
        raise ConfigError(f"tool_format: unknown tool-call format {name!r}; known: auto, "
                          f"{', '.join(sorted(formats))}")
    return formats[name]


def conversation(messages: Sequence[Mapping[str, Any]], tool_format: ToolCallFormat, plan: ToolPlan | None
                 ) -> list[dict[str, str]]:
    """OpenAI-shaped messages as the chat template gets them: assistant tool calls and tool results written as the
    format writes them, a `developer` message as `system`, and (with a plan whose format describes the tools) that
    description as a system message first (joined to the conversation's own system message).

    Raises:
        ToolRequestError: a tool call whose arguments are not a JSON object, or a tool result that answers no
            earlier call, naming the message.
    """
    out: list[dict[str, str]] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role, text = m.get("role"), _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                function = call.get("function") or {}
                arguments = function.get("arguments", "{}")
                try:
                    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    parsed = None
                if not isinstance(parsed, dict):
                    raise ToolRequestError(f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object",
                                           param=f"messages[{i}].tool_calls")
                calls.append(ToolCall(str(function.get("name")), parsed))
                if call.get("id"):
                    names[call["id"]] = str(function.get("name"))
            out.append({"role": "assistant", "content": tool_format.assistant_content(text or None, calls)})
        elif role == "tool":
            call_id = m.get("tool_call_id") or ""
            if call_id not in names:
                raise ToolRequestError(f"messages[{i}].tool_call_id: a tool message answers a call an earlier "
                                       f"assistant message made; no call has id {call_id!r}",
                                       param=f"messages[{i}].tool_call_id")
            out.append(tool_format.tool_result(call_id, names[call_id], text))
        else:
            out.append({"role": "system" if role == "developer" else str(role), "content": text})
    prompt = plan.system_prompt() if plan is not None else None
    if prompt:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return "" if content is None else str(content)


def template_tools(plan: ToolPlan | None, tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
    """The tool definitions the chat template is given (`tools=`) where the plan's format leaves the tools to it;
    None where the format describes them itself (or there is no plan)."""
    if plan is None or plan.system_prompt() is not None:
        return None
    offered = {t.name for t in plan.tools}
    return [t for t in tools if (t.get("function") or {}).get("name") in offered]


def formats_of(registry: Any) -> Mapping[str, type[ToolCallFormat]]:
    """The registered tool-call formats: name -> class."""
    return {name: entry.factory for name, entry in registry.tool_formats.items()}


def template_text(tokenizer: Any) -> str | None:
    """The tokenizer's chat template as text (all of them, where it has several by name)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None
