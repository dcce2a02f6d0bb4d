"""Text before tool calls under the lazy `auto` grammar (a server in the Hermes format, `<tool_call>`), with the
`openai` client: on chat completions the text streams as content deltas before the first call's delta and adds up,
with the calls, to the unstreamed message; the Responses API returns it as a message item before the function_call
items (as OpenAI does), and streams that message's text, then each call's item and argument deltas, into the same
response. The tiny random model is led to write text and then a call by a regex beside the tools' own grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_tools_recipe
from tests.helpers.served import KEY, Served

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
LEAD = "Let me look that up."
TEXT_THEN_CALL = {"processors": [{"regex": {"pattern": LEAD.replace(".", "\\.") + "\\n<tool_call>(.|\\n)*"}}]}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    recipe = load_recipe(write_tiny_tools_recipe(tmp_path_factory.mktemp("hermes"), max_tokens=120))
    server = Served(recipe, api_key=KEY, served_model_name="tiny", tool_format="hermes")
    yield server.client()
    server.stop()


def test_text_before_a_call_streams_as_content_first_and_adds_up_to_the_unstreamed_message(client):
    kwargs: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": ASK}],
                              "tools": [CHAT_WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
                              "extra_body": TEXT_THEN_CALL}
    unstreamed = client.chat.completions.create(**kwargs).choices[0]
    assert unstreamed.finish_reason == "tool_calls" and unstreamed.message.content == LEAD
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [c.chunk.choices[0].delta for c in stream if c.type == "chunk" and c.chunk.choices]
        streamed = stream.current_completion_snapshot.choices[0]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    texts = [d.content for d in deltas[:first_call] if d.content]
    assert len(texts) > 1 and "".join(texts) == LEAD  # as the tokens came, none after the calls began
    assert not any(d.content for d in deltas[first_call:])
    assert streamed.message.content == LEAD and streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in unstreamed.message.tool_calls]


def test_the_responses_api_returns_text_before_calls_as_a_message_item_streamed_or_not(client):
    kwargs: dict[str, Any] = {"model": "tiny", "input": ASK, "tools": [WEATHER], "tool_choice": "auto",
                              "parallel_tool_calls": False, "extra_body": TEXT_THEN_CALL}
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == LEAD and json.loads(response.output[1].arguments)["city"] in ("Paris", "Oslo")
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events if e.type.endswith(("added", "done"))]
    assert kinds == [("response.output_item.added", 0), ("response.content_part.added", 0),
                     ("response.output_text.done", 0), ("response.content_part.done", 0),
                     ("response.output_item.done", 0), ("response.output_item.added", 1),
                     ("response.function_call_arguments.done", 1), ("response.output_item.done", 1)]
    text_deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    argument_deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(text_deltas) > 1 and "".join(text_deltas) == LEAD
    assert len(argument_deltas) > 1 and "".join(argument_deltas) == final.output[1].arguments
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == \
        [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output]
    assert final.output_text == LEAD
    added = next(e for e in events if e.type == "response.output_item.added" and e.output_index == 1)
    assert (added.item.id, added.item.call_id) == (final.output[1].id, final.output[1].call_id)
