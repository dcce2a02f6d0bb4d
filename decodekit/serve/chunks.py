"""Streamed chat and completions chunks: engine outputs become server-sent events, one chunk per choice that changed
(a tool-calling output's content and call deltas as `serve.tool_stream` reads them), the usage chunk, and
`[DONE]`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.api.sequence import RequestOutput
from decodekit.serve.convert import PreparedRequest, choice_bases, choice_extras, usage
from decodekit.serve.logprob_shapes import TextOffsets, chat_logprobs, completion_logprobs
from decodekit.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    FunctionCallDelta,
    ToolCallDelta,
    Usage,
)
from decodekit.serve.reasoning import delta_fields
from decodekit.serve.tool_stream import ToolCallStream


@dataclass
class _Cursor:
    offsets: TextOffsets  # the legacy logprobs' text_offset of the tokens whose logprobs were sent
    tokens: int = 0  # tokens whose logprobs were sent
    started: bool = False
    finished: bool = False
    tools: ToolCallStream | None = None  # a tool-calling choice's stream


class ChunkStream:
    """Turns engine outputs into server-sent events, one chunk per choice that changed.

    Args:
        chat: chat chunks (`chat.completion.chunk`, a first chunk with the role) or completions ones.
        response_id, created, model: the fields every chunk repeats.
        prepared: the request (logprobs asked for, usage chunk wanted).
        first_outputs: each prompt's first output (their choice counts number the choices).
    """

    def __init__(self, chat: bool, response_id: str, created: int, model: str, prepared: PreparedRequest,
                 first_outputs: Sequence[RequestOutput]) -> None:
        self.chat = chat
        self.header = {"id": response_id, "created": created, "model": model}
        self.prepared = prepared
        self.bases = choice_bases(first_outputs)
        self.cursors: dict[int, _Cursor] = {}
        self.finals: dict[int, RequestOutput] = {}
        self.latest: dict[int, RequestOutput] = dict(enumerate(first_outputs))  # the usage so far reads these

    def events(self, prompt_index: int, output: RequestOutput) -> list[str]:
        """The events for one engine output (none when it adds nothing)."""
        self.latest[prompt_index] = output
        if output.finished:
            self.finals[prompt_index] = output
        events = []
        for i, c in enumerate(output.outputs):
            index = self.bases[prompt_index] + c.index
            cursor = self.cursors.get(index)
            if cursor is None:
                cursor = self.cursors[index] = _Cursor(TextOffsets(self.prepared.tokenizer,
                                                                   self.prepared.params.skip_special_tokens))
            delta = output.delta_text[i] if i < len(output.delta_text) else ""
            new_tokens = c.token_ids[cursor.tokens:]
            new_entries = (c.logprobs or [])[cursor.tokens:len(c.token_ids)]
            finish = c.finish_reason if c.finish_reason is not None and not cursor.finished else None
            if self.chat and not cursor.started:
                cursor.started = True
                # a tool-calling message may turn out to be calls only (content null, as the unstreamed one)
                opening = DeltaMessage(role="assistant", content="" if self.prepared.tools is None else None)
                events.append(self._chat_chunk(ChatChoice(index=index, delta=opening)))
            thinking = delta_fields(output, i) if self.chat else {}
            if not delta and not thinking and not new_entries and finish is None:
                continue
            extras = choice_extras(c) if finish is not None else {}
            if self.chat and self.prepared.tools is not None:
                if thinking:  # a reasoning request's thinking streams apart; the calls read the answer only
                    events.append(self._chat_chunk(ChatChoice(index=index, delta=DeltaMessage(**thinking))))
                sent = self._tool_chunks(index, cursor, c.text, finish, new_tokens, new_entries, extras)
                events += sent
                if not sent:
                    continue  # nothing to send yet (a part of a marker, a name half written): logprobs wait too
            elif self.chat:
                logprobs = None
                if self.prepared.top_logprobs is not None:
                    logprobs = chat_logprobs(new_tokens, new_entries, self.prepared.top_logprobs)
                message = DeltaMessage(content=delta if delta or not thinking else None, **thinking)
                events.append(self._chat_chunk(ChatChoice(index=index, delta=message, logprobs=logprobs,
                                                          finish_reason=finish, **extras)))
            else:
                legacy = None
                if self.prepared.top_logprobs is not None:
                    offsets = cursor.offsets.extend(new_tokens)
                    legacy = completion_logprobs(new_tokens, new_entries, offsets)
                events.append(self._completion_chunk(CompletionChoice(index=index, text=delta, logprobs=legacy,
                                                                      finish_reason=finish, **extras)))
            cursor.tokens = len(c.token_ids)
            cursor.finished = cursor.finished or finish is not None
        return events

    def _tool_chunks(self, index: int, cursor: _Cursor, text: str, finish: str | None, new_tokens: list[int],
                     new_entries: list[Any], extras: dict[str, Any]) -> list[str]:
        """A tool-calling choice's chunks for this step: its new content, each call's first delta and its arguments'
        new fragment (one chunk each, the step's logprobs on the first), and when it ends a last chunk with the
        finish reason (`tool_calls` when it reads back as calls)."""
        if cursor.tools is None:
            assert self.prepared.tools is not None  # only tool-calling requests come here
            cursor.tools = ToolCallStream(self.prepared.tools)
        delta = cursor.tools.update(text, finish is not None)
        messages = [DeltaMessage(content=delta.content)] if delta.content else []
        messages += [DeltaMessage(tool_calls=[ToolCallDelta(
            index=d.index, id=d.id, type="function" if d.id else None,
            function=FunctionCallDelta(name=d.name, arguments=d.arguments))]) for d in delta.calls]
        if finish is not None:
            messages.append(DeltaMessage())
            message = cursor.tools.message
            if message is not None and message[1]:
                finish = "tool_calls"
        chunks = []
        for number, piece in enumerate(messages):
            logprobs = None
            if number == 0 and self.prepared.top_logprobs is not None:
                logprobs = chat_logprobs(new_tokens, new_entries, self.prepared.top_logprobs)
            last = finish is not None and number == len(messages) - 1
            chunks.append(self._chat_chunk(ChatChoice(index=index, delta=piece, logprobs=logprobs,
                                                      finish_reason=finish if last else None,
                                                      **(extras if last else {}))))
        return chunks

    def usage_event(self) -> str:
        """The last chunk of `stream_options.include_usage`: no choices, the usage of every prompt."""
        totals = usage([self.finals[i] for i in sorted(self.finals)])
        if self.chat:
            return sse(ChatCompletionChunk(**self.header, choices=[], usage=totals).model_dump_json())
        return sse(CompletionResponse(**self.header, choices=[], usage=totals).model_dump_json())

    def _usage_so_far(self) -> Usage | None:
        """The usage of every prompt's tokens so far (`continuous_usage_stats`), else None."""
        if not self.prepared.continuous_usage:
            return None
        return usage([self.latest[i] for i in sorted(self.latest)])

    def _chat_chunk(self, choice: ChatChoice) -> str:
        chunk = ChatCompletionChunk(**self.header, choices=[choice], usage=self._usage_so_far())
        return sse(chunk.model_dump_json(exclude=None if self._sends_usage() else {"usage"}))

    def _completion_chunk(self, choice: CompletionChoice) -> str:
        chunk = CompletionResponse(**self.header, choices=[choice], usage=self._usage_so_far())
        return sse(chunk.model_dump_json(exclude=None if self._sends_usage() else {"usage"}))

    def _sends_usage(self) -> bool:
        return self.prepared.include_usage or self.prepared.continuous_usage


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"


DONE_EVENT = sse("[DONE]")
"""The event that ends a stream."""
