"""Streamed tool calls: a tool-calling output read again at every step as it grows (`ToolCallFormat.partial`), and
what it added since the last step sent as OpenAI sends it: content as it comes (under a lazy `auto`, the text before
the marker), then each call's first delta (its id, name and empty arguments) and its arguments in fragments as the
tokens arrive. The chat endpoint's chunks and the Responses API's events are both written from these deltas.

When the output ends, its finished reading (`read_output`: the calls parsed and validated) closes the stream: what it
holds beyond what was sent goes out, and the calls keep the ids they streamed with, so the streamed deltas add up to
the unstreamed message.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from decodekit.serve.protocol import ToolCallOut
from decodekit.serve.tool_calls import read_output
from decodekit.tool_calling import ToolPlan

log = logging.getLogger("decodekit.serve")


@dataclass(frozen=True)
class CallDelta:
    """What one step adds to call `index`: on its first delta its `id` and `name` (and empty `arguments`), after
    that a fragment of its arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Delta:
    """What one step adds to a tool-calling output: `content` first, then `calls` in order (at most one delta per
    call and step, a call's first delta on its own)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ToolCallStream:
    """One output's stream: what was sent so far, and its finished message once it ends.

    Attributes:
        content: the content sent so far.
        ids: each started call's id (`call_...`), in order.
        arguments: each started call's arguments text sent so far.
        message: the finished reading (content, calls with the streamed ids), once the output ends.
    """

    plan: ToolPlan
    content: str = ""
    ids: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    message: tuple[str | None, list[ToolCallOut]] | None = None

    def update(self, text: str, finished: bool) -> Delta:
        """What the output, now `text`, adds to what was sent (with `finished`, everything left)."""
        if finished:
            content, calls = read_output(self.plan, text, self.ids)
            self.message = content, calls
            if self.ids and not calls:
                # a call cut by max_tokens: its fragments went out, and the text it reads back as is no content
                return Delta()
            return self._advance(content or "", [(c.function.name, c.function.arguments) for c in calls])
        partial = self.plan.format.partial(text)
        named = []
        for call in partial.calls:
            if call.name is None:
                break  # calls are sent in order, each once its name is known
            named.append((call.name, call.arguments))
        return self._advance(partial.content, named)

    def _advance(self, content: str, calls: list[tuple[str, str]]) -> Delta:
        new_content = ""
        if content.startswith(self.content):
            new_content, self.content = content[len(self.content):], content
        elif content:
            log.warning("tool format %r: streamed content %r is not the start of %r; the rest is not sent",
                        self.plan.format.name, self.content, content)
        deltas = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.arguments.append("")
                deltas.append(CallDelta(index, "", self.ids[index], name))
            sent = self.arguments[index]
            if not arguments.startswith(sent):
                log.warning("tool format %r: streamed arguments %r are not the start of %r; the rest is not sent",
                            self.plan.format.name, sent, arguments)
            elif len(arguments) > len(sent):
                deltas.append(CallDelta(index, arguments[len(sent):]))
                self.arguments[index] = arguments
        return Delta(new_content, deltas)
