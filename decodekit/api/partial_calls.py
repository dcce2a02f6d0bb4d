"""Reading a tool-calling output while it is written, for streamed tool calls: the text sure to be content so far,
and the calls started (each one's name once written whole, and the text of its arguments so far).

A format's `ToolCallFormat.partial` reads an unfinished output with these helpers. What they return only grows as
the output does (content and each call's arguments by appending; calls are added, never taken back), so a server
sends the difference from one step to the next as deltas, and the deltas add up to the finished output's reading.

Example:
    >>> text = 'Let me look. <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Pa'
    >>> held_content(text, ["<tool_call>"])
    'Let me look.'
    >>> partial_calls(text, text.index("{"), "arguments", "\\n</tool_call>\\n<tool_call>\\n")
    [PartialCall(name='get_weather', arguments='{"city": "Pa')]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: its name (None until written whole) and its arguments' JSON text so far
    (exactly as the model wrote it: the finished call's `arguments` text starts with it)."""

    name: str | None
    arguments: str = ""


@dataclass(frozen=True)
class PartialOutput:
    """An unfinished output as far as it reads: the content sure to be kept (text before the calls, never a part of a
    marker or whitespace that may end it) and the calls started, in order."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


def held_content(text: str, markers: Sequence[str]) -> str:
    """The text before the first marker, less what may still turn out not to be content: an end that could start a
    marker, and the whitespace before it (a format's finished reading drops the whitespace before its calls)."""
    cut = min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut].rstrip()
    keep = len(text)
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                keep = min(keep, len(text) - size)
                break
    return text[:keep].rstrip()


def skip_space(text: str, pos: int) -> int:
    """The position of the first character at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def partial_string(text: str, pos: int) -> tuple[str, int | None]:
    """The JSON string starting at `pos` (its opening quote) decoded as far as written (an escape cut short is left
    out), and the position after its closing quote (None while it is open).

    Raises:
        ValueError: no string starts at `pos`.
    """
    if pos >= len(text) or text[pos] != '"':
        raise ValueError(f"no JSON string at {pos} of {text!r}")
    out: list[str] = []
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return "".join(out), i + 1
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(text):
            break
        code = text[i + 1]
        if code != "u":
            out.append(_ESCAPES.get(code, code))
            i += 2
            continue
        end = i + 6
        if end > len(text):
            break
        if 0xD800 <= int(text[i + 2:end], 16) < 0xDC00:
            end += 6  # a surrogate pair is two escapes: wait for both (json.loads joins them into one character)
        if end > len(text):
            break
        out.append(json.loads(f'"{text[i:end]}"'))
        i = end
    return "".join(out), None


def value_end(text: str, pos: int) -> int | None:
    """The position after the JSON value starting at `pos` (None while it is unfinished: an open object, array or
    string, or a number or literal that may go on)."""
    depth, i = 0, pos
    while i < len(text):
        ch = text[i]
        if ch == '"':
            _, end = partial_string(text, i)
            if end is None:
                return None
            i = end
            if depth == 0:
                return i
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and (ch in _WHITESPACE or ch in ",:"):
            return i if i > pos else None
        i += 1
    return None


def partial_call(text: str, pos: int, arguments_key: str = "arguments") -> tuple[PartialCall | None, int | None]:
    """The call object `{"name": ..., "<arguments_key>": {...}}` starting at `pos`, as far as written (None until
    its name or arguments begin), and the position after its closing brace (None while it is open)."""
    i = skip_space(text, pos)
    if i >= len(text) or text[i] != "{":
        return None, None
    name, arguments, i = None, None, i + 1
    while True:
        i = skip_space(text, i)
        if i >= len(text) or text[i] != '"':
            break
        key, end = partial_string(text, i)
        if end is None:
            break
        i = skip_space(text, end)
        if i >= len(text) or text[i] != ":":
            break
        i = skip_space(text, i + 1)
        if i >= len(text):
            break
        end = value_end(text, i)
        if key == arguments_key:
            arguments = text[i:end] if end is not None else text[i:]
        elif key == "name" and text[i] == '"':
            value, closed = partial_string(text, i)
            name = value if closed is not None else None
        if end is None:
            break
        i = skip_space(text, end)
        if i < len(text) and text[i] == "}":
            call = PartialCall(name, arguments or "")
            return call, i + 1
        if i >= len(text) or text[i] != ",":
            break
        i += 1
    if name is None and arguments is None:
        return None, None
    return PartialCall(name, arguments or ""), None


def partial_calls(text: str, pos: int, arguments_key: str, between: str) -> list[PartialCall]:
    """The calls written one after another from `pos`, each a call object (`partial_call`) and `between` the text
    from the end of one to the start of the next (`", "` in a JSON list, `"; "` for Llama 3, ...)."""
    calls: list[PartialCall] = []
    while True:
        call, end = partial_call(text, pos, arguments_key)
        if call is None:
            return calls
        calls.append(call)
        if end is None or not text.startswith(between, end):
            return calls
        pos = end + len(between)
