"""The streamed events of a Responses API response, in OpenAI's order: `response.created`, `response.in_progress`;
the message item (added, its text part added, `response.output_text.delta`s, then done); for tool calling, each
`function_call` item added with empty arguments, its `response.function_call_arguments.delta`s as the tokens arrive
(`serve.tool_stream` reads them), then done; and `response.completed` with the whole response.

Without tools the message opens at once. With tools it opens on the first text (a lazy `auto`'s text before the
calls) and closes when the first call starts; each call closes when the next starts or the output ends. The items of
the finished response (`ResponseBuilder.body`) are the ones streamed, with the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from decodekit.api.sequence import RequestOutput
from decodekit.serve.protocol import ToolCallOut
from decodekit.serve.responses_api import ResponseBuilder
from decodekit.serve.tool_stream import Delta, ToolCallStream
from decodekit.tool_calling import ToolPlan


@dataclass
class _OpenCall:
    """A function_call item of the stream: its call id, name and output index, the arguments sent, whether done."""

    call_id: str
    name: str | None
    output_index: int
    arguments: str = ""
    done: bool = False


@dataclass
class ResponseEvents:
    """The events of one streamed response (`opening`, then `step` for each engine output, then `closing` with the
    finished response).

    Attributes:
        built: the response's builder (its ids, the finished body).
        tools: the request's tool plan (None: it calls no tools).
    """

    built: ResponseBuilder
    tools: ToolPlan | None = None
    sequence: int = 0
    text: str = ""  # the message's text sent so far
    message_state: str = "none"  # none, open or done
    calls: list[_OpenCall] = field(default_factory=list)
    stream: ToolCallStream | None = None

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.stream = ToolCallStream(self.tools)

    @property
    def message(self) -> tuple[str | None, list[ToolCallOut]] | None:
        """The finished tool-calling output's reading (its content and calls, with their streamed ids), once it
        ended; None before, and without tools."""
        return self.stream.message if self.stream is not None else None

    def opening(self) -> list[str]:
        """Created, in progress, and (without tools) the message opened."""
        started = self.built.body("in_progress")
        events = [self.event("response.created", response=started),
                  self.event("response.in_progress", response=started)]
        return events + (self._open_message() if self.tools is None else [])

    def step(self, output: RequestOutput) -> list[str]:
        """The events an engine output adds."""
        if self.stream is None:
            delta = output.delta_text[0] if output.delta_text else ""
            return self._text(delta) if delta else []
        return self._tool_events(self.stream.update(output.outputs[0].text, output.finished))

    def closing(self, final: dict[str, Any]) -> list[str]:
        """The items still open closed as the finished response has them (a message never opened, as a text answer
        that streamed nothing, is sent whole), then `response.completed` (also when it ended at `max_output_tokens`:
        its `status` says `incomplete`; clients, the `openai` SDK's stream helpers and the openai-agents SDK among
        them, wait for `response.completed`, as vLLM sends it)."""
        events: list[str] = []
        for item in final["output"]:
            if item["type"] != "message":
                events += self._close_call(item)
                continue
            if self.message_state == "none":
                events += self._open_message()
                text = item["content"][0]["text"]
                events += self._text(text) if text else []
            events += self._close_message(item)
        return [*events, self.event("response.completed", response=final)]

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event of the stream (`event:` names its type, as OpenAI sends them)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _items(self) -> int:
        return (self.message_state != "none") + len(self.calls)

    def _tool_events(self, delta: Delta) -> list[str]:
        events = self._text(delta.content) if delta.content else []
        for call in delta.calls:
            if call.id is None:
                events += self._arguments(self.calls[call.index], call.arguments)
                continue
            # a new call: what was open before it is done
            events += self._close_message(self.built.message(self.text, "completed"))
            if self.calls:
                events += self._close_call(self._item(self.calls[-1]))
            events += self._open_call(call.id, call.name)
        return events

    def _item(self, call: _OpenCall) -> dict[str, Any]:
        return {"type": "function_call", "id": ResponseBuilder.function_call_id(call.call_id),
                "call_id": call.call_id, "name": call.name, "arguments": call.arguments, "status": "completed"}

    def _open_call(self, call_id: str, name: str | None) -> list[str]:
        call = _OpenCall(call_id, name, self._items())
        self.calls.append(call)
        item = {**self._item(call), "status": "in_progress"}
        return [self.event("response.output_item.added", output_index=call.output_index, item=item)]

    def _arguments(self, call: _OpenCall, fragment: str) -> list[str]:
        call.arguments += fragment
        return [self.event("response.function_call_arguments.delta", item_id=self._item(call)["id"],
                           output_index=call.output_index, delta=fragment)]

    def _close_call(self, item: dict[str, Any]) -> list[str]:
        events = []
        call = next((c for c in self.calls if c.call_id == item["call_id"]), None)
        if call is None:  # a call the stream never opened (a format that does not read partial outputs)
            events += self._open_call(item["call_id"], item["name"])
            call = self.calls[-1]
        if call.done:
            return []
        if item["arguments"].startswith(call.arguments) and len(item["arguments"]) > len(call.arguments):
            events += self._arguments(call, item["arguments"][len(call.arguments):])
        call.done = True
        return [*events,
                self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=call.output_index, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=call.output_index, item=item)]

    def _open_message(self) -> list[str]:
        self.message_state = "open"
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        message_id = self.built.message_id
        return [self.event("response.output_item.added", output_index=0, item=self.built.message("", "in_progress")),
                self.event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                           part=part)]

    def _text(self, delta: str) -> list[str]:
        events = self._open_message() if self.message_state == "none" else []
        self.text += delta
        return [*events, self.event("response.output_text.delta", item_id=self.built.message_id, output_index=0,
                                    content_index=0, delta=delta, logprobs=[])]

    def _close_message(self, item: dict[str, Any]) -> list[str]:
        if self.message_state != "open":
            return []
        self.message_state = "done"
        part = item["content"][0]
        message_id = self.built.message_id
        return [self.event("response.output_text.done", item_id=message_id, output_index=0, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=message_id, output_index=0, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=0, item=item)]
