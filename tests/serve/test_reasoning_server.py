"""A reasoning model behind the server, with the `openai` client: the thinking in `message.reasoning_content` (and
vLLM's `reasoning`) apart from `content`, streamed apart too and adding up to the same; the budget set by the
`thinking_token_budget` field; `usage.completion_tokens_details.reasoning_tokens`; `response_format` constraining the
answer only; `chat_template_kwargs.enable_thinking` and `reasoning_effort` reaching the template; bad reasoning
settings a 400 naming the field while the server serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from decodekit.recipe import load_recipe
from tests.helpers.reasoning_models import save_tiny_qwen3
from tests.helpers.served import KEY, Served

ASK = [{"role": "user", "content": "Is Paris the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("reasoning")
    save_tiny_qwen3(folder / "qwen3")
    recipe = folder / "qwen3.yaml"
    recipe.write_text(f"model: {folder / 'qwen3'}\ndtype: float32\ndevice: cpu\nengine: {{kv_cache_memory: 32MiB}}\n"
                      "sampling: {temperature: 0, max_tokens: 24, ignore_eos: true}\nreasoning: {format: think_tags}\n")
    server = Served(load_recipe(recipe), api_key=KEY, served_model_name="qwen3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client()


def test_the_thinking_comes_back_apart_from_the_answer_and_is_counted(client):
    response = client.chat.completions.create(model="qwen3", messages=ASK, extra_body={"thinking_token_budget": 5})
    message = response.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == thinking and thinking and message.content
    assert "<think>" not in thinking + message.content and "</think>" not in thinking + message.content
    details = response.usage.completion_tokens_details
    # the forced `<think>`, at most 5 tokens of thinking, `</think>`
    assert 2 <= details.reasoning_tokens <= 7 and details.reasoning_tokens < response.usage.completion_tokens


def test_a_budget_of_0_closes_the_thinking_at_once(client):
    response = client.chat.completions.create(model="qwen3", messages=ASK, extra_body={"thinking_token_budget": 0})
    assert response.choices[0].message.model_extra["reasoning_content"] == ""
    assert response.usage.completion_tokens_details.reasoning_tokens == 2  # `<think>` `</think>`, both forced


def test_streamed_thinking_and_answer_arrive_apart_and_add_up_to_the_unstreamed_message(client):
    body = dict(model="qwen3", messages=ASK, extra_body={"thinking_token_budget": 6})
    whole = client.chat.completions.create(**body).choices[0].message
    thinking, content = [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            thinking.append(extra.get("reasoning_content") or "")
            assert extra.get("reasoning") == extra.get("reasoning_content")
            content.append(choice.delta.content or "")
    assert "".join(thinking) == whole.model_extra["reasoning_content"]
    assert "".join(content) == whole.content


def test_response_format_constrains_the_answer_and_leaves_the_thinking_free(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.chat.completions.create(
        model="qwen3", messages=ASK, max_tokens=40, extra_body={"thinking_token_budget": 4, "ignore_eos": False},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    message = response.choices[0].message
    assert json.loads(message.content) in ({"ok": True}, {"ok": False})
    assert message.model_extra["reasoning_content"]  # free text, not JSON


def test_enable_thinking_false_and_reasoning_effort_reach_the_chat_template(client):
    off = client.chat.completions.create(model="qwen3", messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.model_extra["reasoning_content"] == ""
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # the template closed the thinking
    plain = client.chat.completions.create(model="qwen3", messages=ASK, max_tokens=1)
    effort = client.chat.completions.create(model="qwen3", messages=ASK, max_tokens=1, reasoning_effort="low")
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"thinking_token_budget": -1}, "thinking_token_budget", "greater than or equal to 0"),
    ({"reasoning": {"format": "nope"}}, "reasoning", "reasoning.format: unknown reasoning format 'nope'"),
    ({"reasoning": {"commentary": {"processors": [{"regex": {"pattern": "a+"}}]}}}, "reasoning",
     "reasoning.commentary: the think_tags format has no phase 'commentary'"),
    ({"reasoning": {"answer": {"budget": 3}}}, "reasoning", "reasoning.answer.budget"),
])
def test_bad_reasoning_settings_are_a_400_naming_the_field_and_the_server_serves_on(served, body, param, message):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "qwen3", "messages": ASK, **body},
                          headers=headers, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], response.text
    ok = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "qwen3", "messages": ASK, "max_tokens": 2},
                    headers=headers, timeout=60)
    assert ok.status_code == 200
