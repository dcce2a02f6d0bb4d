"""Streamed tool calls read from a growing output (`serve.tool_stream` over each format's `partial`), without a
server: for random calls and texts in every built-in format (hypothesis), cut into random pieces as tokens would,
the deltas add up to the finished reading (content, and each call's name and arguments text), every call's first
delta carries its id and name with empty arguments, nothing streamed is ever taken back, and the partial readers
never see a marker inside an argument as a new call."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.api.partial_calls import held_content, partial_call, partial_string, value_end
from decodekit.api.tools import ToolCall, ToolCallFormat, ToolSpec
from decodekit.serve.tool_calls import read_output
from decodekit.serve.tool_stream import ToolCallStream
from decodekit.tool_calling import ToolPlan
from decodekit_plugins.tool_families import HermesToolFormat, Llama3JsonToolFormat, MistralToolFormat
from decodekit_plugins.tool_formats import JsonToolFormat

FORMATS: list[type[ToolCallFormat]] = [JsonToolFormat, HermesToolFormat, Llama3JsonToolFormat, MistralToolFormat]
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<[{"), max_size=12)
_STRING = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=10) | \
    st.sampled_from(['{"name": ', "[TOOL_CALLS]", '"}', "\\", "é😀", "; {"])
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-999, 999) | _STRING,
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.sampled_from(["name", "arguments", "city", "x"]), inner, max_size=3),
                     max_leaves=6)
_CALLS = st.lists(st.builds(ToolCall, st.sampled_from(["get_weather", "note"]),
                            st.dictionaries(st.sampled_from(["name", "city", "days", "x"]), _JSON, max_size=3)),
                  max_size=3)


def _written(fmt: ToolCallFormat, content: str | None, calls: list[ToolCall], ascii_only: bool) -> str:
    if isinstance(fmt, JsonToolFormat):  # the model may write a JSON string with or without escapes
        value: Any = ({"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]} if calls
                      else {"response": content or ""})
        return json.dumps(value, ensure_ascii=ascii_only)
    return fmt.assistant_content(content, calls)


def _stream(plan: ToolPlan, text: str, cuts: list[int]) -> tuple[ToolCallStream, str, dict[int, list[Any]]]:
    stream, content, calls = ToolCallStream(plan), "", {}
    ends = [*sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    for end in ends:
        delta = stream.update(text[:end], finished=False)
        content += delta.content
        for d in delta.calls:
            calls.setdefault(d.index, []).append(d)
    delta = stream.update(text, finished=True)
    content += delta.content
    for d in delta.calls:
        calls.setdefault(d.index, []).append(d)
    return stream, content, calls


@settings(max_examples=150, deadline=None)
@given(fmt_class=st.sampled_from(FORMATS), content=_TEXT, calls=_CALLS, ascii_only=st.booleans(),
       cuts=st.lists(st.integers(0, 10_000), max_size=40))
def test_streamed_deltas_add_up_to_the_finished_reading(fmt_class, content, calls, ascii_only, cuts):
    fmt = fmt_class()
    if isinstance(fmt, JsonToolFormat) and calls:
        content = ""  # the generic format's output is calls or a text answer, never both
    text = _written(fmt, content or None, calls, ascii_only)
    plan = ToolPlan(fmt, [ToolSpec("get_weather"), ToolSpec("note")], "auto", True)
    stream, streamed_content, deltas = _stream(plan, text, cuts)
    finished_content, finished_calls = read_output(plan, text, stream.ids)
    assert streamed_content == (finished_content or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in finished_calls] == \
        [(c.name, c.arguments) for c in calls]
    assert sorted(deltas) == list(range(len(finished_calls)))
    for index, call in enumerate(finished_calls):
        first, *rest = deltas[index]
        assert (first.id, first.name, first.arguments) == (call.id, call.function.name, "")
        assert all(d.id is None and d.name is None for d in rest)
        assert "".join(d.arguments for d in rest) == call.function.arguments


def test_a_call_cut_by_the_budget_keeps_what_streamed_and_adds_no_content():
    plan = ToolPlan(HermesToolFormat(), [ToolSpec("get_weather")], "auto", True)
    text = 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    stream, content, deltas = _stream(plan, text, list(range(len(text))))
    assert content == "Let me see." and stream.message is not None and stream.message[1] == []
    assert "".join(d.arguments for d in deltas[0]) == '{"city": "Pa'


def test_text_that_may_start_a_marker_is_held_back_until_it_does_not():
    assert held_content("Sure <tool", ["<tool_call>"]) == "Sure"
    assert held_content("Sure <toolbox", ["<tool_call>"]) == "Sure <toolbox"
    assert held_content("Sure  \n", ["<tool_call>"]) == "Sure"
    assert held_content("a\n<tool_call>\n{", ["<tool_call>"]) == "a"


def test_the_partial_readers_follow_json_strings_escapes_and_nesting():
    assert partial_string('"a\\"b\\u00e9\\ud83d', 0) == ('a"bé', None)
    assert partial_string('"a\\"b\\u00e9\\ud83d\\ude00" tail', 0) == ('a"bé😀', 24)
    assert value_end('{"a": "}", "b": [1, {"c": 2}]} x', 0) == 30
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    call, end = partial_call('{"name": "f", "arguments": {"name": "g", "x": "{\\"name\\": "}}; ', 0)
    assert call is not None and call.name == "f" and end is not None
    assert json.loads(call.arguments) == {"name": "g", "x": '{"name": '}
    assert partial_call('{"arguments": {"a": 1', 0) == (partial_call('{"arguments": {"a": 1', 0)[0], None)
    assert partial_call('{"nam', 0) == (None, None)
