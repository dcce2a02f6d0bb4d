"""Streamed chat and completions chunks: engine outputs become server-sent events, one chunk per choice that changed
(a tool-calling output whole in its finishing chunk), the usage chunk, and `[DONE]`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decodekit.api.sequence import RequestOutput
from decodekit.serve.convert import PreparedRequest, choice_bases, choice_extras, usage
from decodekit.serve.logprob_shapes import TextOffsets, chat_logprobs, completion_logprobs
from decodekit.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from decodekit.serve.reasoning import delta_fields
from decodekit.serve.tool_calls import read_output


@dataclass
class _Cursor:
    offsets: TextOffsets  # the legacy logprobs' text_offset of the tokens whose logprobs were sent
    tokens: int = 0  # tokens whose logprobs were sent
    started: bool = False
    finished: bool = False


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
                events.append(self._chat_chunk(ChatChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                                content=""))))
            thinking = delta_fields(output, i) if self.chat else {}
            if not delta and not thinking and not new_entries and finish is None:
                continue
            extras = choice_extras(c) if finish is not None else {}
            if self.chat and self.prepared.tools is not None:
                # a tool-calling output is read back whole: its text or its calls come in the finishing chunk
                if finish is None:
                    if thinking:  # the thinking streams; the answer is read back whole at the end
                        events.append(self._chat_chunk(ChatChoice(index=index, delta=DeltaMessage(**thinking))))
                    continue
                content, calls = read_output(self.prepared.tools, c.text)
                for number, call in enumerate(calls):
                    call.index = number
                logprobs = None
                if self.prepared.top_logprobs is not None:
                    logprobs = chat_logprobs(new_tokens, new_entries, self.prepared.top_logprobs)
                events.append(self._chat_chunk(ChatChoice(
                    index=index, delta=DeltaMessage(content=content, tool_calls=calls or None, **thinking),
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls else finish, **extras)))
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
