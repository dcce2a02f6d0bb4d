"""`decodekit serve`: a real uvicorn server on a free loopback port, serving a recipe over a tiny model saved to a
folder, exercised with the official openai client and raw httpx: chat and completions against the offline `LLM`,
streaming, `n`, logprobs, JSON schemas, beam search and speculative decoding through `extra_body`, every error
path, 32 concurrent clients, disconnects, the waiting-queue bound, metrics, a graceful shutdown; the CLI's errors,
and the CLI on the bundled model, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from typer.testing import CliRunner

from decodekit.cli import app
from decodekit.recipe import Recipe, load_recipe
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.served import KEY, SLOW, Served

ROOT = Path(__file__).parents[2]
HELLO = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory) -> Path:
    """A recipe over a tiny random Llama saved with its tokenizer (given a chat template): greedy, 8 tokens."""
    return write_tiny_recipe(tmp_path_factory.mktemp("serve"), max_tokens=8)


@pytest.fixture(scope="module")
def recipe(tiny_recipe) -> Recipe:
    return load_recipe(tiny_recipe)


@pytest.fixture(scope="module")
def served(recipe) -> Iterator[Served]:
    server = Served(recipe, api_key=KEY, served_model_name="tiny", max_body_bytes=64 << 10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(recipe):
    """The same recipe's model in an offline `LLM`, the reference every answer is compared with."""
    return recipe.build_llm()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client()


def _chat(offline, recipe, messages, **overrides):
    return offline.chat(messages, recipe.params_for(overrides))[0]


def _delta(served: Served, run: Callable[[], Any]) -> tuple[Any, Callable[[str, dict[str, str] | None], float]]:
    """Run `run` and return its result and a function giving how much each metric sample grew meanwhile."""
    before = served.metrics()
    result = run()
    served.wait_idle()
    after = served.metrics()

    def grew(name: str, labels: dict[str, str] | None = None) -> float:
        key = (name, tuple(sorted((labels or {}).items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    return result, grew


# ---- answers -------------------------------------------------------------------------------------------------------
def test_chat_and_completions_answer_like_the_offline_llm_with_usage(client, offline, recipe):
    reply = client.chat.completions.create(model="tiny", messages=HELLO)
    want = _chat(offline, recipe, HELLO)
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert (choice.index, choice.message.role, choice.message.content, choice.finish_reason) == (
        0, "assistant", want.text, want.finish_reason)
    assert reply.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": len(want.prompt_token_ids), "completion_tokens": len(want.token_ids),
        "total_tokens": len(want.prompt_token_ids) + len(want.token_ids)}

    prompts = ["The capital of France is", [5, 6, 7, 8, 9]]
    outs = offline.generate(prompts, recipe.params_for({"max_tokens": 5}))
    for prompt, out in zip(prompts, outs):  # a text, and token ids
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=5)
        assert got.object == "text_completion" and got.choices[0].text == out.text
        assert got.usage.prompt_tokens == len(out.prompt_token_ids) and got.usage.completion_tokens == 5
    both = client.completions.create(model="tiny", prompt=[[5, 6, 7, 8, 9], [11, 12, 13]], max_tokens=5)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == outs[1].text


def test_the_served_name_and_the_recipes_model_name_are_listed_and_both_answer(client, served, recipe):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", recipe.model] and models.data[0].owned_by == "decodekit"
    assert client.models.retrieve("tiny").id == "tiny"
    reply = client.completions.create(model=recipe.model, prompt="Hello", max_tokens=2)
    assert reply.model == recipe.model
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}


LONG = {"ignore_eos": True}
"""An answer of several decode runs (a tiny model's runs are 32 tokens), so that the stream comes in pieces."""


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_deltas_concatenate_to_the_non_streamed_text_and_usage_comes_last(client, chat):
    if chat:
        whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=80, stop=["oou"],
                                               extra_body=LONG)
        chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=80, stop=["oou"],
                                                     extra_body=LONG,
                                                     stream=True, stream_options={"include_usage": True}))
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = whole.choices[0].message.content
    else:
        whole = client.completions.create(model="tiny", prompt="The capital", max_tokens=80, stop=["oou"],
                                          extra_body=LONG)
        chunks = list(client.completions.create(model="tiny", prompt="The capital", max_tokens=80, stop=["oou"],
                                                extra_body=LONG,
                                                stream=True, stream_options={"include_usage": True}))
        texts = [c.choices[0].text for c in chunks if c.choices]
        text = whole.choices[0].text
    # in pieces (a lone greedy request streams a decode run, up to 32 tokens or ~0.1 s of them, per chunk)
    assert "".join(texts) == text and len(texts) > 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_raw_stream_is_server_sent_events_ending_with_done(served):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
                      ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert "usage" not in json.loads(events[0][len("data: "):])


def test_n_gives_n_seeded_choices_streamed_alike(client, offline, recipe):
    kwargs = {"model": "tiny", "messages": HELLO, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 6}
    reply = client.chat.completions.create(**kwargs)
    want = _chat(offline, recipe, HELLO, n=3, temperature=1.0, seed=11, max_tokens=6)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [o.text for o in want.outputs]
    streamed = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert list(streamed.values()) == [o.text for o in want.outputs]
    many = client.completions.create(model="tiny", prompt=["Hello", "The capital"], n=2, temperature=1.0, seed=3,
                                     max_tokens=4)
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and many.usage.completion_tokens == 16


def test_logprobs_equal_the_offline_llms(client, offline, recipe):
    reply = client.chat.completions.create(model="tiny", messages=HELLO, logprobs=True, top_logprobs=3)
    want = _chat(offline, recipe, HELLO, logprobs=3).outputs[0]
    content = reply.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for got, token, entry in zip(content, want.token_ids, want.logprobs):
        assert (got.token, got.logprob) == (entry[token].decoded_token, entry[token].logprob)
        assert got.bytes == list(got.token.encode())
        top = [(t.token, t.logprob) for t in got.top_logprobs]  # the 3 most likely, most likely first
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert set(top) == {(e.decoded_token, e.logprob) for e in entry.values() if e.rank <= 3}

    legacy = client.completions.create(model="tiny", prompt="The capital", max_tokens=4, logprobs=2).choices[0]
    want = offline.generate("The capital", recipe.params_for({"max_tokens": 4, "logprobs": 2}))[0].outputs[0]
    lp = legacy.logprobs
    assert lp.tokens == [e[t].decoded_token for t, e in zip(want.token_ids, want.logprobs)]
    assert lp.token_logprobs == [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)]
    assert lp.top_logprobs == [{x.decoded_token: x.logprob for x in e.values()} for e in want.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt="The capital", max_tokens=4, logprobs=2, stream=True) if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_a_minus_infinite_logprob_is_sent_as_minus_9999(served):
    # processed logprobs under `allowed_token_ids`: every other token is -inf, which JSON cannot carry
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2, "logprobs": True, "top_logprobs": 3,
            "logprobs_mode": "processed", "processors": [{"allowed_token_ids": {"token_ids": [40, 41]}}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and "Infinity" not in response.text and "NaN" not in response.text
    for token in response.json()["choices"][0]["logprobs"]["content"]:
        assert token["logprob"] > -9999.0 and [t["logprob"] for t in token["top_logprobs"]][2] == -9999.0


def test_response_format_json_schema_gives_json_that_validates_and_json_object_a_json_object(client, offline, recipe):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model="tiny", messages=HELLO, response_format=fmt, max_tokens=48)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # a random model writes a never-ending string inside the object: the text is the `json` processor's
    reply = client.chat.completions.create(model="tiny", messages=HELLO, response_format={"type": "json_object"})
    want = _chat(offline, recipe, HELLO, processors=[{"json": {}}])
    assert reply.choices[0].message.content == want.text and want.text.startswith("{")


def test_beam_search_and_speculative_decoding_through_extra_body(client, served, offline, recipe):
    beams = {"beam_search": {"num_beams": 3, "num_return_sequences": 2}}
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, extra_body={"strategy": beams})
    want = _chat(offline, recipe, HELLO, max_tokens=6, strategy=beams)
    assert [(c.index, c.message.content) for c in reply.choices] == [(o.index, o.text) for o in want.outputs]
    assert [c.model_extra["score"] for c in reply.choices] == [o.score for o in want.outputs]
    streamed = {}
    for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, stream=True,
                                                extra_body={"strategy": beams}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert list(streamed.values()) == [o.text for o in want.outputs]

    spec = {"speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"
    overrides = {"max_tokens": 24, "ignore_eos": True}
    reply, grew = _delta(served, lambda: client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, extra_body={"strategy": spec, "ignore_eos": True}))
    plain = offline.generate(prompt, recipe.params_for(overrides))[0]
    fast = offline.generate(prompt, recipe.params_for({**overrides, "strategy": spec}))[0]
    assert reply.choices[0].text == plain.text == fast.text  # lossless
    assert fast.metrics.num_draft_tokens > 0
    assert grew("decodekit_spec_decode_draft_tokens_total") == fast.metrics.num_draft_tokens
    assert grew("decodekit_spec_decode_accepted_tokens_total") == fast.metrics.num_accepted_tokens
    # n > 1 under speculation: each choice drafts on its own, seeded, as the engine gives it offline
    many = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=8,
                                     extra_body={"strategy": spec, "ignore_eos": True})
    sampled = {"max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 8, "ignore_eos": True, "strategy": spec}
    want = offline.generate(prompt, recipe.params_for(sampled))[0]
    assert [(c.index, c.text) for c in many.choices] == [(o.index, o.text) for o in want.outputs]
    assert len({c.text for c in many.choices}) == 3
    streamed: dict[int, str] = {}  # several tokens a step per choice, each choice's deltas in order
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=8,
                                           stream=True, extra_body={"strategy": spec, "ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in sorted(streamed)] == [o.text for o in want.outputs]


def test_decodekits_own_fields_and_openais_penalties_reach_the_engine(client, offline, recipe):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 3, "ignore_eos": True, "trace": 2,
             "processors": [{"no_repeat_ngram": {"ngram_size": 2}}], "stopping": [{"time_limit": {"seconds": 30}}]}
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10, temperature=0.8, seed=5,
                                           top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                                           logit_bias={"7": -100}, stop=["zzz"], extra_body=extra, user="u1",
                                           metadata={"k": "v"})
    want = _chat(offline, recipe, HELLO, max_tokens=10, temperature=0.8, seed=5, top_p=0.9, top_k=5, min_p=0.05,
                 min_tokens=3, ignore_eos=True, trace=2, stop=["zzz"], stopping=extra["stopping"],
                 processors=[{"no_repeat_ngram": {"ngram_size": 2}}, {"repetition_penalty": {"penalty": 1.3}},
                             {"presence_penalty": {"penalty": 0.5}}, {"frequency_penalty": {"penalty": 0.3}},
                             {"logit_bias": {"bias": {7: -100}}}])
    assert reply.choices[0].message.content == want.text and reply.usage.completion_tokens == 10
    trace = reply.choices[0].model_extra["trace"]
    assert len(trace) == 11 and trace[-1]["finished"] == "length"
    assert [s["stage"] for s in trace[0]["stages"]][:3] == ["model", "no_repeat_ngram", "repetition_penalty"]


# ---- errors --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "param", "text"), [
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"extra_body": {"temprature": 1}}, "temprature", "did you mean 'temperature'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
     "Field required"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"extra_body": {"processors": ["top_q"]}}, "processors", "unknown processor 'top_q' (did you mean 'top_p'?)"),
    ({"extra_body": {"processors": [{"dry": {"multiplier": -1}}]}}, "processors", "dry.multiplier"),
    ({"extra_body": {"strategy": {"beam_search": {"num_beams": 2}}}, "temperature": 0.5}, "strategy",
     "beam search is deterministic"),
    ({"extra_body": {"strategy": {"speculative": {"proposer": "draft"}}}}, "strategy", "needs a draft model"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "bogus"),
    ({"extra_body": {"min_tokens": 20}, "max_tokens": 4}, "min_tokens", "must be <= `max_tokens`"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "Input should be"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages", "the prompt has"),
])
def test_a_bad_request_is_a_400_naming_the_field(client, served, kwargs, param, text):
    body = {"model": "tiny", "messages": HELLO, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and text in error["message"], error
    served.wait_idle()


def test_a_bad_completions_prompt_and_a_bad_body_are_400s(served):
    headers = {"Authorization": f"Bearer {KEY}"}
    for body, param in (({"model": "tiny", "prompt": [1.5, 2]}, "prompt"), ({"model": "tiny", "prompt": []}, "prompt"),
                        ({"model": "tiny", "prompt": "x", "echo": True, "n": 2}, "echo"),
                        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens")):
        response = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    response = httpx.post(f"{served.url}/v1/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    stream = {"model": "tiny", "prompt": "x", "stream": True, "processors": ["top_q"]}
    response = httpx.post(f"{served.url}/v1/completions", json=stream, headers=headers)  # refused before streaming
    assert response.status_code == 400 and response.json()["error"]["param"] == "processors"


def test_an_unknown_model_is_a_404_and_a_wrong_key_a_401_while_health_and_metrics_stay_open(served, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=HELLO)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError) as denied:
        served.client(api_key="wrong").models.list()
    assert denied.value.body["code"] == "invalid_api_key"
    response = httpx.get(f"{served.url}/v1/models")  # no key at all
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/metrics").status_code == 200
    response = httpx.get(f"{served.url}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404 and "error" in response.json()


def test_a_body_over_the_limit_is_a_413(served):
    body = json.dumps({"model": "tiny", "prompt": "x" * (100 << 10)}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{served.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it is read
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    response = httpx.post(f"{served.url}/v1/completions", content=chunked(), headers=headers)
    assert response.status_code == 413


# ---- load, disconnects, metrics ------------------------------------------------------------------------------------
def test_32_concurrent_clients_each_get_exactly_their_own_greedy_output(client, offline, recipe, served):
    prompts = [f"Hello world! {i} The capital of France is" for i in range(32)]
    want = offline.generate(prompts, recipe.params_for({"max_tokens": 12, "ignore_eos": True}))

    def ask(i: int) -> str:
        kwargs = {"model": "tiny", "prompt": prompts[i], "max_tokens": 12, "extra_body": {"ignore_eos": True}}
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
        return client.completions.create(**kwargs).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, range(32)))
    assert got == [o.text for o in want]
    served.wait_idle()


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_blocks(served):
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, **SLOW}  # about 10 s

    def disconnect_both() -> None:
        with httpx.stream("POST", f"{served.url}/v1/completions", json={**long, "stream": True}, headers=headers
                          ) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert served.engine.stats()["kv_blocks_used"] > 0
        with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
            httpx.post(f"{served.url}/v1/completions", json=long, headers=headers, timeout=0.3)

    _, grew = _delta(served, disconnect_both)
    served.wait_idle()
    assert grew("decodekit_requests_total", {"finish_reason": "abort"}) == 2
    allocator = served.engine.allocator
    assert allocator.num_free_blocks == allocator.num_blocks


def test_metrics_parse_and_count_what_was_sent(client, served):
    def send() -> list[Any]:
        replies = [client.completions.create(model="tiny", prompt=[7 + i % 50 for i in range(40)], max_tokens=3,
                                             extra_body={"ignore_eos": True}) for _ in range(2)]
        replies.append(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, n=2,
                                                      temperature=1.0, seed=1, extra_body={"ignore_eos": True}))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"processors": ["nope"]})
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")
        return replies

    replies, grew = _delta(served, send)
    assert grew("decodekit_requests_total", {"finish_reason": "length"}) == 3
    assert grew("decodekit_requests_total", {"finish_reason": "error"}) == 1  # refused by the engine: still counted
    assert grew("decodekit_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies) + 1
    assert grew("decodekit_generation_tokens_total") == sum(r.usage.completion_tokens for r in replies) == 14
    assert grew("decodekit_time_to_first_token_seconds_count") == 3
    assert grew("decodekit_e2e_request_latency_seconds_count") == 3
    assert grew("decodekit_time_per_output_token_seconds_count") == 3
    assert grew("decodekit_http_errors_total", {"status": "400"}) == 1
    assert grew("decodekit_http_errors_total", {"status": "404"}) == 1
    assert grew("decodekit_prefix_cache_hit_tokens_total") >= 32  # the second prompt reused the first's two blocks
    now = served.metrics()
    assert now[("decodekit_num_requests_running", ())] == 0 and now[("decodekit_num_requests_waiting", ())] == 0
    assert now[("decodekit_kv_cache_blocks_used", ())] == 0
    assert now[("decodekit_kv_cache_blocks_total", ())] == served.engine.allocator.num_blocks
    assert ("decodekit_num_preemptions_total", ()) in now


def test_a_full_waiting_queue_answers_429_then_admits_again(tiny_recipe):
    served = Served(load_recipe(tiny_recipe, ["engine.max_num_seqs=1"]), max_waiting=1)
    try:
        client = served.client()
        model = served.service.names[0]
        long = client.completions.create(model=model, prompt="Hello", max_tokens=400, stream=True, extra_body=SLOW)
        next(iter(long))  # running: it holds the only sequence slot
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.completions.create, model=model, prompt="Hi", max_tokens=2)
            deadline = time.monotonic() + 10
            while served.service.waiting() < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=model, prompt="Hi", max_tokens=2)
            assert caught.value.body["code"] == "rate_limit_exceeded"
            assert caught.value.response.headers["retry-after"] == "1"
            long.close()  # the running request is aborted: the queued one starts and finishes
            assert queued.result(timeout=20).choices[0].finish_reason in ("stop", "length")
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices
        served.wait_idle()
    finally:
        served.stop()


def test_shutdown_lets_the_requests_in_flight_finish_and_stops_the_engine_thread(recipe):
    served = Served(recipe)
    client = served.client()
    stream = client.completions.create(model=served.service.names[0], prompt="Hello", max_tokens=40, stream=True,
                                       stream_options={"include_usage": True}, extra_body=SLOW)  # about 0.8 s
    next(iter(stream))
    served.server.should_exit = True  # what uvicorn's SIGTERM handler does
    rest = list(stream)
    assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 40
    served.thread.join(30)
    assert not served.thread.is_alive() and not served.service.llm._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health")


# ---- the command line ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(("text", "message"), [
    ("model: m\nmodle: n\n", "x.yaml: modle: unknown key 'modle' (did you mean 'model'?)"),
    ("model: /nowhere/at/all\n", "no such file or folder: '/nowhere/at/all'"),
])
def test_serve_reports_a_bad_recipe_or_model_in_one_line_and_exits_2(text, message, tmp_path):
    (tmp_path / "x.yaml").write_text(text)
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "x.yaml"), "--port", str(_free_port())])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and message in result.stderr and "Traceback" not in result.stderr


def test_the_cli_serves_the_bundled_model_and_exits_cleanly_on_sigterm():
    port = _free_port()
    env = {**os.environ, "DECODEKIT_API_KEY": "secret"}
    process = subprocess.Popen([sys.executable, "-m", "decodekit", "serve", str(ROOT / "recipes" / "quickstart.yaml"),
                                "--port", str(port), "--set", "sampling.temperature=0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()  # type: ignore
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0)
        reply = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output
        assert f"at http://127.0.0.1:{port}/v1 (API key required)" in output and "Traceback" not in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
