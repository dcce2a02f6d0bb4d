"""`decodekit serve`'s checks of what a request sends, against a real uvicorn server over a tiny model, with raw
HTTP bodies (so that they can hold what the openai client would never send: `Infinity`, lone surrogates, strings
for numbers): `logit_bias` keys that are not plain token ids, lone surrogates in any text, `null` for OpenAI's
nullable fields, strings and booleans where numbers are due, non-finite numbers; each refusal is a 400 naming the
field, and the server answers the next good request. Also the legacy logprobs' `text_offset` where tokens carry
parts of characters, streamed and not, on the tiny model and on the bundled SmolLM2."""

from __future__ import annotations

import bisect
import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decodekit.recipe import Recipe, load_recipe
from tests.helpers.batch_cases import write_tiny_recipe
from tests.serve.test_serve import Served

ROOT = Path(__file__).parents[2]
HELLO = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Recipe:
    """A recipe over a tiny random Llama with a byte-level tokenizer: greedy, 8 tokens."""
    return load_recipe(write_tiny_recipe(tmp_path_factory.mktemp("serve-checks"), max_tokens=8))


@pytest.fixture(scope="module")
def served(recipe) -> Iterator[Served]:
    server = Served(recipe, served_model_name="tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(recipe):
    """The same recipe's model in an offline `LLM` (for the token ids behind a served answer)."""
    return recipe.build_llm()


def _post(served: Served, path: str, body: str | bytes | dict[str, Any]) -> httpx.Response:
    """POST a body as it is written (a `str` is sent as UTF-8, lone surrogates as their surrogatepass bytes)."""
    if isinstance(body, dict):
        body = json.dumps(body)
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return httpx.post(f"{served.url}/v1/{path}", content=raw, headers={"Content-Type": "application/json"},
                      timeout=60)


def _assert_400(response: httpx.Response, param: str, text: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert text in error["message"], error


def _assert_still_serves(served: Served) -> None:
    """A good request of each kind is answered after the refusal, and nothing is left running."""
    reply = _post(served, "completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
    reply = _post(served, "chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant", reply.text
    served.wait_idle()


# ---- logit_bias ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["--5", "²", "٣", " 5", "5 ", "+5", "-5", "1_0", "5.0", "0x5", "", "x", "9" * 5000])
def test_logit_bias_keys_that_are_not_plain_decimal_token_ids_are_a_400_naming_logit_bias(served, key):
    response = _post(served, "completions", {"model": "tiny", "prompt": "Hello", "logit_bias": {key: 5}})
    _assert_400(response, "logit_bias", "token id")
    _assert_still_serves(served)


def test_logit_bias_naming_one_token_id_twice_is_a_400_naming_logit_bias(served):
    response = _post(served, "chat/completions", {"model": "tiny", "messages": HELLO,
                                                  "logit_bias": {"5": 5, "05": -5}})
    _assert_400(response, "logit_bias", "token id 5 is given twice ('5' and '05')")
    _assert_still_serves(served)


@pytest.mark.parametrize("key", ["384", "99999", "12345678901234567890"])
def test_logit_bias_token_ids_past_the_vocabulary_are_a_400_naming_logit_bias(served, key):
    response = _post(served, "completions", {"model": "tiny", "prompt": "Hello", "logit_bias": {key: 1}})
    _assert_400(response, "logit_bias")
    assert "vocabulary" in response.json()["error"]["message"]
    _assert_still_serves(served)


def test_logit_bias_with_leading_zeros_and_integer_biases_is_taken(served):
    plain = _post(served, "completions", {"model": "tiny", "prompt": "Hello", "logit_bias": {"7": 100}})
    zeros = _post(served, "completions", {"model": "tiny", "prompt": "Hello", "logit_bias": {"007": 100.0}})
    assert plain.status_code == zeros.status_code == 200, (plain.text, zeros.text)
    assert plain.json()["choices"][0]["text"] == zeros.json()["choices"][0]["text"]


# ---- lone surrogates -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "param", "where"), [
    ("completions", r'{"prompt": "hi \ud800 there"}', "prompt", "prompt:"),
    ("completions", r'{"prompt": ["fine", "hi \udfff"]}', "prompt", "prompt[1]:"),
    ("completions", '{"prompt": "raw bytes \ud800"}', "prompt", "prompt:"),  # UTF-8-like bytes, not an escape
    ("chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud800 there"}]}', "messages",
     "messages[0].content:"),
    ("chat/completions", r'{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": '
                         r'[{"type": "text", "text": "a \udc00"}]}]}', "messages", "messages[1].content[0].text:"),
    ("completions", r'{"prompt": "hi", "stop": "\ud83d"}', "stop", "stop:"),
    ("chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "x\ud83dy"]}', "stop",
     "stop[1]:"),
    ("completions", r'{"prompt": "hi", "logit_bias": {"\ud800": 1}}', "logit_bias", "a key of logit_bias:"),
    ("completions", r'{"prompt": "hi", "model": "\udbff"}', "model", "model:"),
])
def test_a_lone_surrogate_in_any_text_is_a_400_naming_the_field_and_the_server_keeps_serving(served, path, body,
                                                                                             param, where):
    response = _post(served, path, body)
    _assert_400(response, param, "lone surrogate")
    assert response.json()["error"]["message"].startswith(where)
    _assert_still_serves(served)


def test_a_surrogate_pair_is_one_character_and_is_served(served):
    body = r'{"model": "tiny", "prompt": "smile \ud83d\ude00", "stop": "\ud83d\ude00"}'
    response = _post(served, "completions", body)
    assert response.status_code == 200, response.text


# ---- null is "not given" ---------------------------------------------------------------------------------------------
NULLS = {"stream": None, "stream_options": None, "n": None, "max_tokens": None, "temperature": None, "top_p": None,
         "stop": None, "seed": None, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
         "response_format": None, "user": None}


@pytest.mark.parametrize(("path", "body", "extra"), [
    ("completions", {"prompt": "Hello"}, {"logprobs": None, "echo": None, "suffix": None, "best_of": None}),
    ("chat/completions", {"messages": HELLO}, {"logprobs": None, "top_logprobs": None, "max_completion_tokens": None,
                                               "tools": None, "tool_choice": None}),
])
def test_null_for_openais_nullable_fields_means_not_given(served, path, body, extra):
    plain = _post(served, path, {"model": "tiny", **body})
    nulls = _post(served, path, {"model": "tiny", **body, **NULLS, **extra})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.headers["content-type"].startswith("application/json")  # stream: null is not a stream
    assert nulls.json()["choices"] == plain.json()["choices"]
    no_usage = _post(served, path, {"model": "tiny", **body, "stream": True, "stream_options": {"include_usage": None}})
    assert no_usage.status_code == 200 and no_usage.headers["content-type"].startswith("text/event-stream")
    assert '"usage"' not in no_usage.text and no_usage.text.endswith("data: [DONE]\n\n")


# ---- strict types ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "fields", "param", "text"), [
    ("completions", '"max_tokens": "5"', "max_tokens", "valid integer"),
    ("completions", '"max_tokens": true', "max_tokens", "valid integer"),
    ("completions", '"max_tokens": 5.0', "max_tokens", "valid integer"),
    ("chat/completions", '"max_completion_tokens": "5"', "max_completion_tokens", "valid integer"),
    ("completions", '"n": "2"', "n", "valid integer"),
    ("completions", '"seed": "1"', "seed", "valid integer"),
    ("completions", '"logprobs": "1"', "logprobs", "valid integer"),
    ("completions", '"logprobs": true', "logprobs", "valid integer"),
    ("chat/completions", '"logprobs": "true"', "logprobs", "valid boolean"),
    ("chat/completions", '"logprobs": 1', "logprobs", "valid boolean"),
    ("chat/completions", '"logprobs": true, "top_logprobs": "2"', "top_logprobs", "valid integer"),
    ("completions", '"stream": "yes"', "stream", "valid boolean"),
    ("completions", '"stream": 1', "stream", "valid boolean"),
    ("completions", '"stream": true, "stream_options": {"include_usage": "yes"}', "stream_options.include_usage",
     "valid boolean"),
    ("completions", '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, '
                    '"strict": "yes"}}', "response_format.json_schema.strict", "valid boolean"),
    ("completions", '"temperature": Infinity', "temperature", "finite number"),
    ("completions", '"temperature": NaN', "temperature", "finite number"),
    ("completions", '"temperature": 1e999', "temperature", "finite number"),
    ("completions", '"temperature": "0.5"', "temperature", "valid number"),
    ("completions", '"temperature": true', "temperature", "valid number"),
    ("completions", '"top_p": NaN', "top_p", "finite number"),
    ("completions", '"presence_penalty": -Infinity', "presence_penalty", "finite number"),
    ("completions", '"frequency_penalty": "1"', "frequency_penalty", "valid number"),
    ("completions", '"logit_bias": {"5": NaN}', "logit_bias.5", "finite number"),
    ("completions", '"logit_bias": {"5": "5"}', "logit_bias.5", "valid number"),
    ("completions", '"top_k": "5"', "top_k", "valid integer"),
    ("completions", '"min_p": Infinity', "min_p", "finite number"),
    ("completions", '"repetition_penalty": Infinity', "repetition_penalty", "finite number"),
    ("completions", '"min_tokens": true', "min_tokens", "valid integer"),
    ("completions", '"ignore_eos": "true"', "ignore_eos", "valid boolean"),
    ("completions", '"stop_token_ids": ["2"]', "stop_token_ids[0]", "valid integer"),
    ("completions", '"trace": true', "trace", "valid integer"),
])
def test_strings_booleans_and_non_finite_numbers_where_openai_wants_numbers_or_booleans_are_a_400(
        served, path, fields, param, text):
    start = '"prompt": "Hello"' if path == "completions" else f'"messages": {json.dumps(HELLO)}'
    response = _post(served, path, f'{{"model": "tiny", {start}, {fields}}}')
    _assert_400(response, param, text)
    _assert_still_serves(served)


def test_integers_are_taken_for_number_fields(served):
    body = {"model": "tiny", "prompt": "Hello", "temperature": 1, "top_p": 1, "seed": 3, "presence_penalty": 0,
            "frequency_penalty": 1, "logit_bias": {"7": -100}}
    response = _post(served, "completions", body)
    assert response.status_code == 200, response.text
    floats = _post(served, "completions", {**body, "temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0,
                                           "frequency_penalty": 1.0, "logit_bias": {"7": -100.0}})
    assert response.json()["choices"] == floats.json()["choices"]


# ---- text_offset -----------------------------------------------------------------------------------------------------
def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _reference_offsets(tokenizer: Any, token_ids: list[int]) -> tuple[str, list[int]]:
    """The text of byte-level tokens (special ones skipped) and each token's offset in it, worked out from bytes:
    the index of the character that holds the token's first byte (past the end: the text's length)."""
    table = _byte_table()
    special = set(tokenizer.all_special_ids)
    pieces = [b"" if t in special else bytes(table[c] for c in tokenizer.convert_ids_to_tokens(t)) for t in token_ids]
    data = b"".join(pieces)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text, starts = "", []  # starts: the first byte of each character of the text
    for at in range(len(data)):
        pending = len(decoder.getstate()[0])
        out = decoder.decode(data[at:at + 1])
        text += out
        starts += [at - pending, at][:len(out)]  # a character for the pending bytes, then one for this byte
    pending = len(decoder.getstate()[0])
    out = decoder.decode(b"", final=True)
    text += out
    starts += [len(data) - pending][:len(out)]
    assert len(starts) == len(text)
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(len(text) if at >= len(data) else bisect.bisect_right(starts, at) - 1)
        at += len(piece)
    return text, offsets


def _streamed_offsets(served: Served, body: dict[str, Any]) -> tuple[str, list[int]]:
    response = _post(served, "completions", {**body, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [json.loads(e[len("data: "):]) for e in response.text.split("\n\n") if e.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return text, [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]


def test_every_text_offset_is_where_its_token_starts_in_the_text_streamed_and_not(served, offline, recipe):
    # the tiny random model writes stray bytes and parts of characters: many tokens are "\ufffd" on their own
    tokenizer = served.service.tokenizer
    partial = 0
    for seed in range(12):
        body = {"model": "tiny", "prompt": f"Hello {seed} world", "max_tokens": 24, "temperature": 1.0, "seed": seed,
                "logprobs": 0}
        reply = _post(served, "completions", body).json()["choices"][0]
        want = offline.generate(body["prompt"], recipe.params_for({"max_tokens": 24, "temperature": 1.0,
                                                                   "seed": seed}))[0].outputs[0]
        text, offsets = _reference_offsets(tokenizer, list(want.token_ids))
        assert reply["text"] == want.text == text
        assert reply["logprobs"]["text_offset"] == offsets, (text, reply["logprobs"])
        assert _streamed_offsets(served, body) == (text, offsets)
        assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
        special = set(tokenizer.all_special_ids)
        for token_id, token, offset in zip(want.token_ids, reply["logprobs"]["tokens"], offsets):
            if "\ufffd" not in token and token_id not in special:  # a whole text: it is there, at its offset
                assert text[offset:offset + len(token)] == token
        partial += sum("\ufffd" in t for t in reply["logprobs"]["tokens"])
    assert partial > 10  # the case this is about did come up


def test_the_bundled_models_chinese_text_offsets_stay_inside_its_text_streamed_and_not():
    # the reviewer's case: 16 tokens, most of them parts of CJK characters, give a 10-character text
    served = Served(load_recipe(ROOT / "recipes" / "quickstart.yaml"))
    try:
        body = {"model": "smollm2-135m-instruct", "prompt": "Translate to Chinese: I love you. ", "max_tokens": 16,
                "temperature": 0, "logprobs": 0}
        reply = _post(served, "completions", body).json()["choices"][0]
        text, offsets = reply["text"], reply["logprobs"]["text_offset"]
        tokens = reply["logprobs"]["tokens"]
        assert sum("\ufffd" in t for t in tokens) >= 4 and len(text) < len(tokens)
        assert offsets == sorted(offsets) and offsets[0] == 0 and max(offsets) < len(text)
        for token, offset in zip(tokens, offsets):
            if "\ufffd" not in token:
                assert text[offset:offset + len(token)] == token
        assert _streamed_offsets(served, body) == (text, offsets)
    finally:
        served.stop()


@pytest.mark.parametrize("message", [
    "request needs 88 KV blocks but the cache has only 22; raise the KV cache memory or shorten the prompt",
    "the prompt has 6000 tokens but the context is 5824 tokens (what the KV cache holds; raise kv_cache_memory "
    "for longer contexts)",
    "the prompt could not be tokenized: TextEncodeInput must be Union[...]",
])
def test_refusals_about_the_prompts_size_or_text_name_the_prompt_field(message):
    from decodekit.serve.errors import param_of

    assert param_of(message, None, {}, "messages") == "messages"
    assert param_of(message, None, {}, "prompt") == "prompt"
