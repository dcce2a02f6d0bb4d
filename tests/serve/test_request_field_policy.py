"""Which request fields the server takes: an unknown field that is not a typo of a known one is accepted, logged and
named in the `X-Decodekit-Ignored-Fields` header (as vLLM accepts them), a typo is a 400 naming the known field,
`--strict-fields` refuses every unknown field; and the chat template's own switches (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`) and `stream_options.continuous_usage_stats` work."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from decodekit.recipe import load_recipe
from tests.helpers.served import KEY, Served
from tests.helpers.tiny_folders import save_tiny_llama

HEADERS = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}(no thinking)\n{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("field-policy")
    save_tiny_llama(folder / "tiny", chat_template=TEMPLATE)
    path = folder / "tiny.yaml"
    path.write_text(f"model: {folder / 'tiny'}\ndtype: float32\ndevice: cpu\nengine: {{kv_cache_memory: 16MiB}}\n"
                    "sampling: {temperature: 0, max_tokens: 6}\n")
    return path


@pytest.fixture(scope="module")
def served(recipe_path) -> Iterator[Served]:
    server = Served(load_recipe(recipe_path), api_key=KEY, served_model_name="tiny")
    yield server
    server.stop()


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json={"model": "tiny", **body}, headers=HEADERS, timeout=60)


def _prompt_ids(served: Served, body: dict) -> list[int]:
    """The prompt's token ids as the engine got them (after the first, which nothing predicts): from
    `prompt_logprobs`, whose entries start with the prompt's own token."""
    response = _post(served, "/v1/chat/completions", {**body, "prompt_logprobs": 0, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return [int(next(iter(entry))) for entry in response.json()["prompt_logprobs"][1:]]


def _expected_ids(served: Served, **options) -> list[int]:
    tokenizer = served.service.tokenizer
    text = tokenizer.apply_chat_template(options.pop("messages", CHAT), tokenize=False, **options)
    return tokenizer(text, add_special_tokens=False)["input_ids"][1:]


def test_an_unknown_field_is_accepted_and_named_in_a_header_and_changes_nothing(served):
    plain = _post(served, "/v1/completions", {"prompt": "one two", "max_tokens": 4})
    extra = _post(served, "/v1/completions", {"prompt": "one two", "max_tokens": 4, "reasoning_summary_v9": {"a": 1},
                                              "brand_new_flag": True})
    assert extra.status_code == 200 and extra.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert extra.headers["x-decodekit-ignored-fields"] == "reasoning_summary_v9, brand_new_flag"
    assert "x-decodekit-ignored-fields" not in plain.headers
    chat = _post(served, "/v1/chat/completions", {"messages": [{**CHAT[0], "new_message_field": 1}]})
    assert chat.status_code == 200 and chat.headers["x-decodekit-ignored-fields"] == "messages[0].new_message_field"


@pytest.mark.parametrize(("field", "known"), [("repetiton_penalty", "repetition_penalty"),
                                              ("temprature", "temperature"), ("max_token", "max_tokens")])
def test_a_typo_of_a_known_field_is_a_400_suggesting_it(served, field, known):
    response = _post(served, "/v1/completions", {"prompt": "x", field: 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert f"did you mean {known!r}" in response.json()["error"]["message"]


def test_strict_fields_refuses_every_unknown_field(recipe_path):
    strict = Served(load_recipe(recipe_path), api_key=KEY, served_model_name="tiny", strict_fields=True)
    try:
        response = _post(strict, "/v1/completions", {"prompt": "x", "brand_new_flag": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == "brand_new_flag"
        assert "unknown field" in response.json()["error"]["message"]
        assert _post(strict, "/v1/completions", {"prompt": "x", "user": "u"}).status_code == 200  # OpenAI's own
    finally:
        strict.stop()


def test_chat_template_kwargs_reach_the_template(served):
    assert _prompt_ids(served, {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}) == \
        _expected_ids(served, add_generation_prompt=True, enable_thinking=False)
    assert _prompt_ids(served, {"messages": CHAT}) == _expected_ids(served, add_generation_prompt=True)
    assert _expected_ids(served, add_generation_prompt=True) != \
        _expected_ids(served, add_generation_prompt=True, enable_thinking=False)


def test_continue_final_message_leaves_the_assistants_message_open(served):
    messages = [*CHAT, {"role": "assistant", "content": "general kenobi"}]
    got = _prompt_ids(served, {"messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert got == _expected_ids(served, messages=messages, add_generation_prompt=False, continue_final_message=True)
    closed = _prompt_ids(served, {"messages": messages, "add_generation_prompt": False})
    assert closed == _expected_ids(served, messages=messages, add_generation_prompt=False) and closed != got


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [*CHAT, {"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ({"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
    ({"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_contradicting_template_switches_are_a_400_naming_the_field(served, body, param):
    response = _post(served, "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(served):
    body = {"prompt": "one two three", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", f"{served.url}/v1/completions", json={"model": "tiny", **body}, headers=HEADERS,
                      timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages) and len(usages) >= 2
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
