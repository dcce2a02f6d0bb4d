"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), the default of OpenAI's newer clients, for
text: a text or a list of messages as `input`, `instructions`, `previous_response_id` (the earlier turns kept in
memory, a bounded number of responses), `text.format` (free text, a JSON object, or a JSON schema), and function
tools: `tools` (`{"type": "function", "name", "parameters", ...}`), `tool_choice`, `parallel_tool_calls`,
`function_call` output items (after a message item holding the text the model wrote before its calls), and
`function_call` / `function_call_output` items in the input (an agent's loop). The streamed events are
`serve.responses_stream`'s.

A request becomes a chat completion request (`to_chat`) and runs exactly as one: the same recipe defaults, fields,
constraints, tool calling and field policy; decodekit's own fields (`top_k`, `processors`, `strategy`, ...) go next to
OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decodekit.api.sequence import RequestOutput
from decodekit.serve.errors import APIError, validation_error
from decodekit.serve.protocol import Bool, ChatCompletionRequest, Float, Int, WireModel

STORE_LIMIT = 1024
"""How many stored responses `previous_response_id` can name; the oldest are forgotten first."""

_IGNORED = ("metadata", "user", "truncation", "include", "reasoning", "service_tier",
            "prompt_cache_key", "safety_identifier", "background")
"""Responses fields that do not change decoding here: accepted and ignored."""


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: Bool | None = None


class TextConfig(BaseModel):
    """`text`: the output's format."""

    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class ResponsesRequest(WireModel):
    """`POST /v1/responses`; unknown fields follow the chat endpoint's field policy."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    stream: Bool | None = None
    store: Bool | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None


@dataclass
class Turn:
    """A stored response: the conversation it continued (without `instructions`) and what it answered, as chat
    messages."""

    messages: list[dict[str, Any]]
    body: dict[str, Any]


@dataclass
class ResponseStore:
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}`, at most `limit`, oldest out first."""

    limit: int = STORE_LIMIT
    turns: OrderedDict[str, Turn] = field(default_factory=OrderedDict)

    def get(self, response_id: str, param: str = "previous_response_id") -> Turn:
        """The stored response.

        Raises:
            APIError: 404 for an id never stored, or forgotten.
        """
        turn = self.turns.get(response_id)
        if turn is None:
            raise APIError(404, f"{param}: no stored response with id {response_id!r} (this server keeps the last "
                                f"{self.limit})", param=param, code="response_not_found")
        return turn

    def put(self, response_id: str, turn: Turn) -> None:
        """Keep a response, forgetting the oldest past the limit."""
        self.turns[response_id] = turn
        while len(self.turns) > self.limit:
            self.turns.popitem(last=False)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.content[{i}]: only text parts (input_text, output_text) are taken",
                               param="input")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where}.content: a text or a list of text parts", param="input")


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: messages with text, a model's `function_call` items as an assistant
    message's `tool_calls` (consecutive calls together), `function_call_output` items as `tool` messages.

    Raises:
        APIError: 400 for an item of another kind, naming it.
    """
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "message" and role in ("user", "system", "developer", "assistant"):
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        else:
            raise APIError(400, f"{where}: only messages (role user, system, developer or assistant), function_call "
                                f"and function_call_output items are taken on this server, got type {kind!r}",
                           param="input")
    if not messages:
        raise APIError(400, "input: must not be empty", param="input")
    return messages


def _chat_tools(request: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """The Responses `tools` and `tool_choice` in the chat endpoint's shapes (function tools only)."""
    tools = None
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{i}]: only function tools are taken on this server, got type "
                                    f"{tool.get('type')!r}", param="tools")
            tools.append({"type": "function", "function": {k: tool[k] for k in
                                                           ("name", "description", "parameters", "strict")
                                                           if tool.get(k) is not None}})
    choice = request.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def to_chat(request: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completion request a Responses request runs as, and the conversation to store with its answer.

    Raises:
        APIError: 400 naming the field (404 for an unknown `previous_response_id`).
    """
    tools, tool_choice = _chat_tools(request)
    conversation = list(store.get(request.previous_response_id).messages) if request.previous_response_id else []
    conversation += input_messages(request)
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "max_tokens": request.max_output_tokens,
                            "temperature": request.temperature, "top_p": request.top_p, "tools": tools,
                            "tool_choice": tool_choice, "parallel_tool_calls": request.parallel_tool_calls}
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema: required with type json_schema", param="text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    extra = {k: v for k, v in (request.model_extra or {}).items() if k not in _IGNORED}
    try:
        return ChatCompletionRequest.model_validate({**extra, **chat}), conversation
    except ValidationError as exc:
        error = validation_error(exc)
        raise APIError(400, error.message, param=error.param) from None


@dataclass
class ResponseBuilder:
    """The response object and its streamed events for one request, in OpenAI's shapes."""

    request: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, text: str | None = None, output: RequestOutput | None = None,
             calls: list[Any] | None = None) -> dict[str, Any]:
        """The response object: `in_progress` (no output yet), or finished with its items and the usage: the message
        (its `text`), and with `calls` the model's `function_call` items after it (the message left out when the
        model wrote no text before its calls)."""
        request = self.request
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        body: dict[str, Any] = {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [], "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "previous_response_id": request.previous_response_id,
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto" if request.tools
            else "none", "tools": request.tools or [], "store": request.store is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "error": None, "incomplete_details": None, "metadata": (request.model_extra or {}).get("metadata") or {},
            "usage": None,
        }
        if output is not None:
            choice = output.outputs[0]
            text = text if text is not None else choice.text
            message = [self.message(text, "completed")] if text or not calls else []
            body["output"] = message + [self.function_call(call) for call in calls or []]
            if choice.finish_reason == "length":
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            prompt, generated = len(output.prompt_token_ids), len(choice.token_ids)
            body["usage"] = {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                             "input_tokens_details": {"cached_tokens": output.metrics.num_cached_prompt_tokens},
                             "output_tokens_details": {"reasoning_tokens": 0}}
        return body

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output message item."""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
            else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def function_call(self, call: Any) -> dict[str, Any]:
        """A `function_call` output item (`call` is the chat endpoint's `ToolCallOut`)."""
        return {"type": "function_call", "id": self.function_call_id(call.id), "call_id": call.id,
                "name": call.function.name, "arguments": call.function.arguments, "status": "completed"}

    @staticmethod
    def function_call_id(call_id: str) -> str:
        """The `function_call` item's id of a call (`fc_...` of its `call_...`): one id however often it is sent."""
        return f"fc_{call_id.removeprefix('call_')}"
