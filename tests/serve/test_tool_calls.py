"""Tool calling on `/v1/chat/completions` with the `openai` client: every `tool_choice` (none, auto, required, a named
function), parallel calls or one, streamed and not, tool calls and results in the history; every call that comes
back parses and validates against its function's schema (a hypothesis property over random parameter schemas); the
same calls under speculative decoding; each bad request a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit.api.errors import RequestError
from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_tools_recipe
from tests.helpers.served import KEY, Served

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tools")
    server = Served(load_recipe(write_tiny_tools_recipe(folder)), api_key=KEY, served_model_name="tiny")
    server.folder = folder / "tiny"  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client()


def _check_calls(calls: Any, tools: list[dict]) -> list[tuple[str, dict]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    found = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schemas[call.function.name])
        found.append((call.function.name, arguments))
    return found


def test_required_returns_calls_that_parse_and_validate(client, served):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                           parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(_check_calls(choice.message.tool_calls, [WEATHER, CLOCK])) == 1
    # parallel calls: as many as the model writes (this random one repeats itself until max_tokens), never half a one
    many = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                          max_tokens=300)
    if many.choices[0].finish_reason == "length":
        assert many.choices[0].message.tool_calls is None
    else:
        assert len(_check_calls(many.choices[0].message.tool_calls, [WEATHER, CLOCK])) >= 1
    served.wait_idle()


def test_a_named_tool_choice_calls_that_function_and_parallel_false_calls_once(client):
    for parallel in (True, False):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, CLOCK], parallel_tool_calls=parallel,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        if parallel and reply.choices[0].finish_reason == "length":
            continue  # this random model repeats its call until max_tokens; nothing half-parsed is returned
        calls = _check_calls(reply.choices[0].message.tool_calls, [WEATHER, CLOCK])
        assert {name for name, _ in calls} == {"get_time"}
        if not parallel:
            assert len(calls) == 1


def test_auto_answers_in_text_or_calls_and_none_never_calls(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="auto")
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None and _check_calls(choice.message.tool_calls, [WEATHER])
    else:  # a text answer (or one cut by max_tokens: a started call completes or stops with length)
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=6)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


CHOICES = ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"]
_CALL = r'\{"name": "[a-z_]+", "arguments": \{[^{}]*\}\}'
TWO_CALLS = {"processors": [{"regex": {"pattern": rf'\{{"tool_calls": \[{_CALL}, {_CALL}\]\}}'}}]}
"""With the tools' own constraint, exactly two calls: this random model left alone repeats calls until max_tokens."""


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named", "auto"])
def test_streamed_calls_add_up_to_the_unstreamed_ones(client, served, choice, parallel):
    kwargs: dict[str, Any] = {"model": "tiny", "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": choice,
                              "parallel_tool_calls": parallel, "max_tokens": 160}
    if parallel:
        kwargs["extra_body"] = TWO_CALLS
    unstreamed = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:  # the openai client's own accumulation of the deltas
        chunks = list(stream)
        streamed = stream.current_completion_snapshot.choices[0]
    assert streamed.finish_reason == unstreamed.finish_reason
    if parallel:
        assert len(unstreamed.message.tool_calls) == 2
    assert streamed.message.content == unstreamed.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in unstreamed.message.tool_calls or []]
    deltas = [d for c in chunks if c.type == "chunk" and c.chunk.choices
              for d in c.chunk.choices[0].delta.tool_calls or []]
    for call in streamed.message.tool_calls or []:  # OpenAI's shape: a call's first delta, then its fragments
        index = next(d for d in deltas if d.id == call.id).index
        first, *rest = [d for d in deltas if d.index == index]
        assert (first.id, first.type, first.function.name, first.function.arguments) == \
            (call.id, "function", call.function.name, "")
        assert rest and all(d.id is None and d.function.name is None for d in rest)
        assert "".join(d.function.arguments for d in rest) == call.function.arguments
    served.wait_idle()


def test_a_long_argument_streams_in_many_fragments(client):
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 60}},
        "required": ["text"], "additionalProperties": False}}}
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[note], tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=200, stream=True))
    fragments = [d.function.arguments for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []
                 if d.id is None]
    arguments = json.loads("".join(fragments))
    assert len(fragments) > 10 and 40 <= len(arguments["text"]) <= 60
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].delta.tool_calls is None


def test_a_conversation_with_calls_and_their_results_continues(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    follow = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=8,
                                            tool_choice="none")
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None


def test_tool_calls_under_speculative_decoding_are_the_greedy_ones(client):
    kwargs = {"model": "tiny", "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required",
              "parallel_tool_calls": False}
    plain = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    fast = client.chat.completions.create(**kwargs, extra_body={"strategy": {"speculative": {
        "proposer": "ngram", "num_speculative_tokens": 4}}}).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in fast] == \
        [(c.function.name, c.function.arguments) for c in plain]


def test_response_format_beside_tools_shapes_only_a_text_answer(client):
    # what the openai-agents SDK sends with an output_type: the format on every turn, tool turns included
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    calls = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, response_format=answer)
    assert calls.choices[0].finish_reason == "tool_calls" and len(_check_calls(calls.choices[0].message.tool_calls,
                                                                               [WEATHER])) == 1
    text = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          response_format=answer)
    assert text.choices[0].message.tool_calls is None
    assert isinstance(json.loads(text.choices[0].message.content)["ok"], bool)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "not json"}}]}]}, "messages[1].tool_calls"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "21 C"}]}, "messages[1].tool_call_id"),
])
def test_a_bad_tool_request_is_a_400_naming_the_field_and_the_server_serves_on(served, body, param):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body},
                          headers=headers, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(param), response.text
    ok = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2},
                    headers=headers, timeout=60)
    assert ok.status_code == 200


_LEAF = st.sampled_from([{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"},
                         {"type": "string", "enum": ["a", "b", "c"]}, {"type": "number", "minimum": 0, "maximum": 1},
                         {"type": "null"}])
_PARAMETERS = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), _LEAF, min_size=1, max_size=3).flatmap(
    lambda props: st.sets(st.sampled_from(sorted(props)), max_size=len(props)).map(lambda required: {
        "type": "object", "properties": props, "required": sorted(required), "additionalProperties": False}))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parameters=st.lists(_PARAMETERS, min_size=1, max_size=3), named=st.booleans(), parallel=st.booleans())
def test_every_call_under_required_or_a_named_choice_parses_and_validates(client, parameters, named, parallel):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": p}}
             for i, p in enumerate(parameters)]
    choice: Any = {"type": "function", "function": {"name": "tool_0"}} if named else "required"
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice=choice,
                                           parallel_tool_calls=parallel, max_tokens=200)
    message = reply.choices[0].message
    if reply.choices[0].finish_reason == "length":  # the budget ran out mid-call: nothing half-parsed is returned
        assert message.tool_calls is None
        return
    calls = _check_calls(message.tool_calls, tools)
    assert calls and (parallel or len(calls) == 1)
    if named:
        assert {name for name, _ in calls} == {"tool_0"}


def test_llm_chat_with_tools_gives_the_calls_the_server_gives(client, served):
    from decodekit import LLM, SamplingParams

    llm = LLM(str(served.folder), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    tools = [WEATHER, CLOCK]
    out = llm.chat(ASK, SamplingParams(max_tokens=96, temperature=0), tools=tools, tool_choice="required",
                   parallel_tool_calls=False)[0].outputs[0]
    assert out.finish_reason == "tool_calls" and out.tool_calls is not None and len(out.tool_calls) == 1
    served_call = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                                 parallel_tool_calls=False).choices[0].message.tool_calls[0]
    assert (out.tool_calls[0].name, out.tool_calls[0].arguments) == \
        (served_call.function.name, json.loads(served_call.function.arguments))
    jsonschema.validate(out.tool_calls[0].arguments, {t["function"]["name"]: t["function"]["parameters"]
                                                      for t in tools}[out.tool_calls[0].name])
    plain = llm.chat(ASK, SamplingParams(max_tokens=4, temperature=0), tools=tools, tool_choice="none")[0]
    assert plain.outputs[0].tool_calls is None
    with pytest.raises(RequestError, match="tool_choice: function 'nope'"):
        llm.chat(ASK, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})


RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in (WEATHER, CLOCK)]


def test_the_responses_api_returns_function_calls_and_continues_from_their_outputs(client, served):
    first = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=RESPONSE_TOOLS,
                                    tool_choice="required", parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments),
                        {t["name"]: t["parameters"] for t in RESPONSE_TOOLS}[calls[0].name])
    named = client.responses.create(model="tiny", input="time?", tools=RESPONSE_TOOLS, parallel_tool_calls=False,
                                    tool_choice={"type": "function", "name": "get_time"})
    assert [item.name for item in named.output] == ["get_time"]
    follow = client.responses.create(model="tiny", previous_response_id=first.id, tools=RESPONSE_TOOLS,
                                     tool_choice="none", max_output_tokens=6,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}])
    assert follow.output[0].type == "message" and isinstance(follow.output_text, str)
    with client.responses.stream(model="tiny", input="What is the weather in Paris?", tools=RESPONSE_TOOLS,
                                 tool_choice="required", parallel_tool_calls=False) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [(i.name, i.arguments) for i in final.output] == [(c.name, c.arguments) for c in calls]
    served.wait_idle()


def test_tool_calls_with_an_int8_self_draft_are_the_greedy_ones(served, client):
    # a second server whose recipe drafts with an int8 copy of the target (speculative decoding's `draft` proposer)
    recipe = served.folder.parent / "draft.yaml"  # type: ignore[attr-defined]
    recipe.write_text(f"model: {served.folder}\ndtype: float32\ndevice: cpu\n"  # type: ignore[attr-defined]
                      "engine: {kv_cache_memory: 64MiB}\ndraft: {model: target, quantization: int8}\n"
                      "sampling: {temperature: 0, max_tokens: 96}\n")
    drafted = Served(load_recipe(recipe), api_key=KEY, served_model_name="tiny")
    try:
        kwargs = {"model": "tiny", "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required",
                  "parallel_tool_calls": False}
        plain = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        reply = drafted.client().chat.completions.create(**kwargs, extra_body={"strategy": {"speculative": {
            "proposer": "draft", "num_speculative_tokens": 4}}})
        assert reply.usage.completion_tokens > 0
        assert [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in plain]
        assert drafted.metrics()[("decodekit_spec_decode_draft_tokens_total", ())] > 0
    finally:
        drafted.stop()


def test_a_client_that_disconnects_during_a_streamed_tool_call_frees_its_blocks(served):
    before = served.metrics().get(("decodekit_requests_total", (("finish_reason", "abort"),)), 0.0)
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required",
            "max_tokens": 400, "stream": True, "processors": ["slow"]}  # about 8 s of calls, 20 ms a step
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        assert served.engine.stats()["kv_blocks_used"] > 0  # the call is being written; the client goes now
    served.wait_idle()
    allocator = served.engine.allocator
    assert allocator.num_free_blocks == allocator.num_blocks
    assert served.metrics()[("decodekit_requests_total", (("finish_reason", "abort"),))] == before + 1
