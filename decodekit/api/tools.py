"""The tool-call format contract: how a model family writes tool calls, and how the server constrains and reads them.

A `ToolCallFormat` is a plugin kind (`decodekit_register_tool_formats`). Given the request's function tools and its
`tool_choice`, a format says what the model is told (a system prompt describing the tools, where the model's chat
template does not take them itself), the constraint its output must match (`ConstraintSpec`: a JSON schema or a
grammar that admits exactly the calls the tools' parameter schemas allow, so a call that comes back always parses
and validates), how a finished output reads back (`parse`: text, or calls), and how calls and their results in the
conversation's history are written back for the template. decodekit's own `json` format (the generic JSON one, for
models with no format of their own) is in `decodekit_plugins.tool_formats`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from decodekit.api.constraints import ConstraintSpec
from decodekit.api.partial_calls import PartialOutput


@dataclass(frozen=True)
class ToolSpec:
    """One function tool a request offers: its name, what it does, and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    strict: bool = False


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments (a JSON object, parsed)."""

    name: str
    arguments: dict[str, Any]


ToolMode = Literal["auto", "required"]
"""`auto`: the model answers in text or calls tools; `required`: it calls at least one."""


@dataclass(frozen=True)
class ParsedOutput:
    """A finished output read back: its text (None when it is only calls) and its calls."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallFormat(ABC):
    """How one model family writes tool calls. Stateless: one instance serves every request."""

    name: ClassVar[str] = ""
    marker: ClassVar[str | None] = None
    """The text every call starts with (`<tool_call>`, `[TOOL_CALLS]`), for a format whose calls have one: under
    `auto` the model writes freely until it writes the marker, and from there the constraint holds (build it with
    `marked_calls`). None: the format has no marker (the whole output is constrained, as the generic JSON format)."""
    template_signature: ClassVar[str | None] = None
    """A text the chat templates of the model family that writes this format hold (their call marker, as a rule):
    the format is picked for a model whose template holds it (`detect_tool_format`); None: never picked so."""

    @abstractmethod
    def system_prompt(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> str | None:
        """What the model is told about the tools and how to call them, as a system message (None: the chat
        template is given the tools itself, `tools=`)."""

    @abstractmethod
    def constraint(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> ConstraintSpec:
        """The constraint the whole output must match: under `required`, one call (several when `parallel`) of
        the `tools` with arguments valid against each tool's `parameters`; under `auto`, that or a text answer."""

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """A finished output read back. An output that does not parse (cut by `max_tokens`) is text."""

    def partial(self, text: str) -> PartialOutput:
        """An unfinished output read as far as it goes, for streaming: the content sure to be kept and the calls
        started (`decodekit.api.partial_calls` has the readers). Read again as the text grows, content and each call's
        arguments only grow by appending, and on the finished text they are `parse`'s content and the calls'
        arguments as written (so the streamed deltas add up to the finished reading). The default reads nothing: a
        format without it streams its output whole when it ends."""
        return PartialOutput()

    @abstractmethod
    def assistant_content(self, content: str | None, calls: list[ToolCall]) -> str:
        """An assistant message of the history with these calls, as the model would have written it."""

    @abstractmethod
    def tool_result(self, call_id: str, name: str | None, content: str) -> dict[str, str]:
        """A `role: tool` message of the history (a call's result) as a message the chat template renders."""


def marked_calls(marker: str, after: str, mode: ToolMode, rules: str = "") -> ConstraintSpec:
    """The Lark grammar of calls that start at `marker` and go on as the rule body `after` (with the `rules` it
    names): under `required` the output is the marker and the calls; under `auto` a lazy grammar, as llama.cpp's:
    any text, until the text reaches the marker, then the calls to the end (llguidance's lazy lexeme ends the free
    text at the first marker, so a started call can only complete validly or be cut by the token budget)."""
    lead = json.dumps(marker)
    lazy = f"start: TEXT | lead {after}\nlead[lazy]: TEXT {lead}"
    start = f"start: {lead} {after}" if mode == "required" else lazy
    return ConstraintSpec.grammar("\n".join(filter(None, [start, "TEXT: /(.|\\n)*/", rules])))


def detect_tool_format(chat_template: str | None, formats: dict[str, type[ToolCallFormat]],
                       default: str = "json") -> str:
    """The name of the format whose `template_signature` the chat template holds (the first registered), else
    `default`."""
    for name, fmt in formats.items():
        if chat_template and fmt.template_signature and fmt.template_signature in chat_template:
            return name
    return default
