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

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from decodekit.api.constraints import ConstraintSpec


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

    @abstractmethod
    def assistant_content(self, content: str | None, calls: list[ToolCall]) -> str:
        """An assistant message of the history with these calls, as the model would have written it."""

    @abstractmethod
    def tool_result(self, call_id: str, name: str | None, content: str) -> dict[str, str]:
        """A `role: tool` message of the history (a call's result) as a message the chat template renders."""
