"""Tool calling on the chat endpoint: the request's `tools`, `tool_choice` and `parallel_tool_calls` planned with
`decodekit.tool_calling` (shared with `LLM.chat`), its errors as 400s naming the field, and a finished output read
back as OpenAI's `message.tool_calls` (each call with a new id, its arguments as JSON text)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from decodekit.api.tools import ToolCallFormat
from decodekit.serve.errors import APIError
from decodekit.serve.protocol import ChatCompletionRequest, FunctionCallOut, ToolCallOut
from decodekit.tool_calling import ToolPlan, ToolRequestError, conversation, plan_tools, template_tools, tool_specs


def request_tools(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tool definitions as OpenAI-shaped dicts."""
    return [t.model_dump(exclude_none=True) for t in request.tools or []]


def plan_request(request: ChatCompletionRequest, format_class: type[ToolCallFormat], chat_template: str | None = None
                 ) -> tuple[ToolPlan | None, list[dict[str, str]], list[Mapping[str, Any]] | None]:
    """The request's tool plan (None: no tool calling), its conversation as the chat template gets it, and the tool
    definitions for the template where the format leaves them to it (or the template is the format's family's).

    Raises:
        APIError: 400 naming the field (a bad tool, `tool_choice` or tool message, `response_format` beside
            `tool_choice: auto`).
    """
    tools = request_tools(request)
    choice = request.tool_choice.model_dump() if request.tool_choice is not None and \
        not isinstance(request.tool_choice, str) else request.tool_choice
    try:
        plan = plan_tools(tool_specs(tools), choice, request.parallel_tool_calls, format_class, chat_template)
        if plan is not None and plan.mode == "auto" and request.response_format is not None and \
                request.response_format.type != "text":
            # under `required` the output is calls (their arguments follow their own schemas) and `response_format`
            # has no text to shape; under `auto` the text answer would need both constraints at once
            raise ToolRequestError("response_format: not with tool_choice auto (a text answer in a format beside "
                                   "tool calls); use tool_choice required, a named function, or none",
                                   param="response_format")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        return plan, conversation(messages, format_class(), plan), template_tools(plan, tools)
    except ToolRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def read_output(plan: ToolPlan, text: str, ids: Sequence[str] = ()) -> tuple[str | None, list[ToolCallOut]]:
    """A finished output's message: its text (under `auto`, what a format with a marker wrote before its calls, or
    None), and its calls, each with its id (`ids`: those a stream gave the first calls; new ones for the rest) and
    its arguments as JSON text: as the model wrote them (what a stream sent), else (a format that does not read
    partial outputs) written anew."""
    parsed = plan.read(text)
    written = plan.format.partial(text).calls
    calls = []
    for i, call in enumerate(parsed.calls):
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        if i < len(written) and written[i].name == call.name and _same_json(written[i].arguments, call.arguments):
            arguments = written[i].arguments
        call_id = ids[i] if i < len(ids) else f"call_{uuid.uuid4().hex[:24]}"
        calls.append(ToolCallOut(id=call_id, function=FunctionCallOut(name=call.name, arguments=arguments)))
    return parsed.content, calls


def _same_json(text: str, value: Any) -> bool:
    try:
        return bool(json.loads(text) == value)
    except ValueError:
        return False
