"""What eval harnesses ask of a server: `echo` with `logprobs` (the prompt tokens' logprobs, null for the first, equal
to transformers' own), `max_tokens: 0` with `echo`, token-id prompts passed as given, vLLM's `prompt_logprobs` field
on both endpoints, and the tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`); each bad
combination a 400 naming the field while the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decodekit import hookimpl
from decodekit.recipe import load_recipe
from decodekit_plugins.beam_search import BeamSearchStrategy
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.served import KEY, Served

HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("eval-serve")


class _WideSearch(BeamSearchStrategy):
    """Beam search under another name, as a third party's plugin might ship it."""

    name = "wide_search"


class _WidePlugin:
    @hookimpl
    def decodekit_register_strategies(self, register):
        register("wide_search", _WideSearch)


@pytest.fixture(scope="module")
def served(folder) -> Iterator[Served]:
    server = Served(load_recipe(write_tiny_recipe(folder, max_tokens=8)), plugins=(_WidePlugin(),), api_key=KEY,
                    served_model_name="tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' own model and tokenizer, loaded from the folder the server serves."""
    return (AutoModelForCausalLM.from_pretrained(folder / "tiny", dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder / "tiny"))


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers=HEADERS, timeout=60)


def _reference_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return [float(rows[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_as_transformers_computes_them(served, reference):
    model, _ = reference
    prompts = [[5, 17, 230, 41, 9, 77, 120], [3, 3, 3, 90]]
    response = _post(served, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 1, "logprobs": 1,
                                                 "echo": True, "temperature": 0})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        got = logprobs["token_logprobs"][1 : len(ids)]
        assert got == pytest.approx(_reference_logprobs(model, ids), abs=1e-5)
        for token, value, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:],
                                     logprobs["top_logprobs"][1:]):
            assert top[token] >= value and max(top.values()) >= value  # the chosen token is among the top ones
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        assert choice["text"].startswith(served.service.tokenizer.decode(ids))
    assert response.json()["usage"]["completion_tokens"] == 2
    served.wait_idle()


def test_max_tokens_0_with_echo_returns_the_scored_prompt_and_nothing_generated(served, reference):
    model, _ = reference
    text = "the quick brown fox"
    response = _post(served, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 0, "logprobs": 0,
                                                 "echo": True})
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    ids = served.service.tokenizer(text)["input_ids"]
    assert choice["text"] == text and len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(_reference_logprobs(model, ids), abs=1e-5)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_prompt_logprobs_comes_in_vllms_shape_on_both_endpoints(served, reference):
    model, _ = reference
    ids = [7, 8, 9, 10, 11]
    completion = _post(served, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                   "prompt_logprobs": 2}).json()
    entries = completion["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for position, entry in enumerate(entries[1:], start=1):
        assert next(iter(entry)) == str(ids[position])  # the prompt's own token first
        assert 2 <= len(entry) <= 3 and all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == \
        pytest.approx(_reference_logprobs(model, ids), abs=1e-5)
    chat = _post(served, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    plain = _post(served, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "needs echo: true"),
    ({"prompt": "x", "echo": True, "n": 2}, "echo", "one choice per prompt"),
    ({"prompt": "x", "echo": True, "strategy": {"beam_search": {"num_beams": 2}}}, "echo", "beam_search"),
    # a beam-like strategy of another name is refused by what it declares (continues_prompt), not by its name
    ({"prompt": "x", "echo": True, "strategy": {"wide_search": {"num_beams": 2}}}, "echo", "wide_search"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo", "not with stream"),
])
def test_a_bad_echo_combination_is_a_400_naming_the_field_and_the_server_serves_on(served, body, param, text):
    response = _post(served, "/v1/completions", {"model": "tiny", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert text in response.json()["error"]["message"]
    chat = _post(served, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"
    assert _post(served, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
    served.wait_idle()


def test_tokenize_and_detokenize_round_trip_as_the_engines_tokenizer_does(served):
    tokenizer = served.service.tokenizer
    text = "Hello there, general"
    plain = _post(served, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == served.engine.max_model_len
    special = _post(served, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert special["tokens"] == tokenizer(text)["input_ids"]
    assert special["token_strs"] == tokenizer.convert_ids_to_tokens(special["tokens"])
    assert _post(served, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": tokenizer.decode(
        plain["tokens"])}
    chat = _post(served, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_tokenizer_info_names_the_special_tokens_and_template_and_every_endpoint_needs_the_key(served):
    info = httpx.get(f"{served.url}/tokenizer_info", headers=HEADERS).json()
    tokenizer = served.service.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == served.engine.max_model_len
    assert httpx.get(f"{served.url}/tokenizer_info").status_code == 401
    assert httpx.post(f"{served.url}/tokenize", json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
])
def test_a_bad_tokenizer_request_is_an_error_naming_the_field(served, path, body, param):
    response = _post(served, path, body)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text
