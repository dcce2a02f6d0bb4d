"""`POST /v1/responses` with the `openai` client's own Responses methods (function tools are in
tests/serve/test_tool_calls.py): text and message input, `instructions`,
`previous_response_id` continuing a conversation (and a forgotten id a 404), `text.format` with a JSON schema,
streamed events in OpenAI's order, `max_output_tokens` ending the response as incomplete; each answer the text the
chat endpoint gives for the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.served import KEY, Served


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    server = Served(load_recipe(write_tiny_recipe(tmp_path_factory.mktemp("responses"), max_tokens=6)),
                    api_key=KEY, served_model_name="tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client()


def _chat(client: openai.OpenAI, messages: list[dict], **kwargs) -> str:
    reply = client.chat.completions.create(model="tiny", messages=messages, **kwargs)
    return reply.choices[0].message.content or ""


def test_text_input_and_instructions_answer_as_the_chat_endpoint_does(client, served):
    response = client.responses.create(model="tiny", input="hello there", instructions="be brief")
    assert response.status in ("completed", "incomplete") and response.object == "response"
    assert response.output_text == _chat(client, [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hello there"}])
    assert 0 < response.usage.output_tokens <= 6 and response.usage.input_tokens > 0
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
                {"role": "user", "content": "and then"}]
    listed = client.responses.create(model="tiny", input=messages)
    assert listed.output_text == _chat(client, [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "yes"},
                                                {"role": "user", "content": "and then"}])
    served.wait_idle()


def test_previous_response_id_continues_the_conversation_and_the_response_can_be_read_back(client):
    first = client.responses.create(model="tiny", input="one")
    second = client.responses.create(model="tiny", input="two", previous_response_id=first.id)
    assert second.output_text == _chat(client, [{"role": "user", "content": "one"},
                                                {"role": "assistant", "content": first.output_text},
                                                {"role": "user", "content": "two"}])
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert missing.value.body["param"] == "previous_response_id"


def test_a_json_schema_text_format_constrains_the_output(client):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    response = client.responses.create(model="tiny", input="give json", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "x", "schema": schema,
                                                        "strict": True}})
    assert response.status == "completed" and set(json.loads(response.output_text)) == {"a"}
    assert response.text.format.type == "json_schema"


def test_streamed_events_come_in_openais_order_and_add_up_to_the_text(client, served):
    with client.responses.stream(model="tiny", input="stream me") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed" and final.status in ("completed", "incomplete")
    assert final.output_text == client.responses.create(model="tiny", input="stream me").output_text
    served.wait_idle()


def test_max_output_tokens_ends_the_response_incomplete(client):
    response = client.responses.create(model="tiny", input="go on", max_output_tokens=2,
                                       extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_a_bad_responses_request_is_a_400_naming_the_field(served, body, param):
    response = httpx.post(f"{served.url}/v1/responses", json={"model": "tiny", **body},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
