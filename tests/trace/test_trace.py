"""The decoding trace (`SamplingParams(trace=N)`): one event per generated token with each stage's top candidates,
how the token was chosen and the drafts; a stop event last. It agrees with the processed logprobs and the
speculative metrics, and costs nothing to requests that do not ask."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.processors import BatchView, apply_processors
from tests.helpers.faulty_plugins import FaultyProcessors
from tests.helpers.reference import random_prompts


@pytest.fixture(scope="module")
def llm(llama, tokenizer):
    return LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)


def _token_events(trace):
    return [e for e in trace if "token" in e]


def test_each_token_has_an_event_with_every_stage_in_pipeline_order_and_the_last_stage_equals_processed_logprobs(llm):
    prompts = random_prompts(3, 4, 12, seed=31)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=6, max_tokens=5, ignore_eos=True, trace=4,
                            logprobs=4, logprobs_mode="processed",
                            processors=[{"repetition_penalty": {"penalty": 1.2}}])
    outs = llm.generate(prompts, [params, SamplingParams(temperature=0, max_tokens=5), params])
    assert outs[1].outputs[0].trace is None
    for out in (outs[0], outs[2]):
        completion = out.outputs[0]
        events = _token_events(completion.trace)
        assert [e["token"] for e in events] == completion.token_ids
        assert [e["index"] for e in events] == list(range(5))
        assert completion.trace[-1] == {"finished": "length", "stop_reason": None, "criterion": "max_tokens"}
        for event, entry in zip(events, completion.logprobs):
            assert [s["stage"] for s in event["stages"]] == ["model", "repetition_penalty", "temperature", "top_k",
                                                             "top_p"]
            assert event["chosen_by"] == "sampled, seed 6" and event["text"] is not None
            last = event["stages"][-1]["top"]
            assert [p for _, _, p in last] == sorted((p for _, _, p in last), reverse=True)
            for token, _, p in last:  # the last stage is the distribution the processed logprobs describe
                assert token in entry and math.isclose(p, math.exp(entry[token].logprob), abs_tol=1e-5)
        json.dumps(completion.trace)  # JSON-ready as it is


def test_a_speculative_trace_lists_drafts_and_acceptances_that_add_up_to_the_metrics(llm):
    prompts = [(p * 4)[:30] for p in random_prompts(3, 4, 9, seed=32)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, trace=2, strategy={
        "speculative": {"proposer": "draft", "num_speculative_tokens": 3}}))
    for out in outs:
        completion = out.outputs[0]
        events = _token_events(completion.trace)
        assert [e["token"] for e in events] == completion.token_ids
        drafts = [e["drafts"] for e in events if "drafts" in e]
        assert sum(len(d["proposed"]) for d in drafts) == out.metrics.num_draft_tokens > 0
        assert sum(d["accepted"] for d in drafts) == out.metrics.num_accepted_tokens
        assert {d["proposer"] for d in drafts} == {"draft"}
        assert {e["chosen_by"] for e in events} <= {"argmax", "draft accepted"}
        assert all(e["strategy"] == "speculative" for e in events)


def test_a_stop_event_names_the_reason_and_tokens_past_a_stop_leave_no_event(llm):
    prompt = random_prompts(1, 6, 10, seed=33)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop = next(t for t in free[3:] if t not in free[:3])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
                                                trace=1, strategy={"speculative": {"proposer": "draft",
                                                                                   "num_speculative_tokens": 5}}))[0]
    completion = out.outputs[0]
    assert [e["token"] for e in _token_events(completion.trace)] == completion.token_ids
    assert completion.trace[-1] == {"finished": "stop", "stop_reason": stop, "criterion": "stop_token_ids"}


def test_parallel_samples_each_get_their_own_trace(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=8, n=3, max_tokens=4, ignore_eos=True,
                                                   trace=2))[0]
    for completion in out.outputs:
        assert [e["token"] for e in _token_events(completion.trace)] == completion.token_ids


def test_a_beam_search_trace_follows_each_returned_hypothesis_with_every_steps_candidates_and_fates(
        llama, tokenizer):
    llama.generation_config.eos_token_id = 5  # a frequent token, so hypotheses finish at different lengths
    try:
        llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
        out = llm.generate(random_prompts(1, 4, 10, seed=34), SamplingParams(
            temperature=0, max_tokens=8, trace=3, logprobs=0, logprobs_mode="processed",
            strategy={"beam_search": {"num_beams": 3, "num_return_sequences": 3}}))[0]
    finally:
        llama.generation_config.eos_token_id = 2
    for completion in out.outputs:
        events = _token_events(completion.trace)
        assert [e["token"] for e in events] == completion.token_ids
        assert all(e["chosen_by"] == "beam search" and e["strategy"] == "beam_search" for e in events)
        for event in events:
            beam, step = event["beam"], event["beams"]
            # this token is among the step's candidates, from its parent beam, with its running score
            mine = [c for c in step["candidates"] if c["parent"] == beam["parent"] and c["token"] == event["token"]]
            assert len(mine) == 1 and math.isclose(mine[0]["score"], beam["score"], abs_tol=1e-5)
            assert mine[0]["fate"] == ("kept" if beam["index"] is not None else "finished")
            assert {c["fate"] for c in step["candidates"]} <= {"kept", "finished", "dropped"}
            assert sum(c["fate"] == "kept" for c in step["candidates"]) <= 3
            assert all(0 <= b < 3 for b in step["pruned"])
        scores = [e["beam"]["score"] for e in events]  # running scores: the processed logprobs add up to them
        assert scores == pytest.approx(list(itertools.accumulate(
            entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids))), abs=1e-4)
        last = events[-1]["beam"]
        assert last["index"] is None and math.isclose(last["final_score"], completion.score, abs_tol=1e-5)
        assert completion.trace[-1]["criterion"] == "beam_search"
        json.dumps(completion.trace)


def test_a_failed_or_aborted_traced_request_ends_its_trace_with_an_event_that_says_why(llama, tokenizer,
                                                                                      plugin_manager):
    plugin_manager.register(FaultyProcessors(), "faulty_plugin")
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager)
    traced = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, trace=1)
    llm.engine.add_request([5, 6, 7], traced, request_id="aborted")
    llm.engine.add_request([5, 6, 8], traced.model_copy(update={"stopping": ["explodes"]}), request_id="failed")
    outputs = [o for _ in range(4) for o in llm.engine.step() if o.finished]
    assert llm.engine.abort("aborted")
    outputs += [o for o in llm.engine.step() if o.finished]
    by_id = {o.request_id: o.outputs[0] for o in outputs}
    failed, aborted = by_id["failed"], by_id["aborted"]
    assert failed.trace[-1] == {"finished": "error",
                                "error": "stopping criterion 'explodes' failed: RuntimeError('boom')"}
    assert len(_token_events(failed.trace)) == len(failed.token_ids) == 2
    assert aborted.trace[-1] == {"finished": "abort"}
    assert len(_token_events(aborted.trace)) == len(aborted.token_ids) == 4


_STATELESS = [  # processors whose output depends on the logits and the history only
    {"repetition_penalty": {"penalty": 1.3}}, {"presence_penalty": {"penalty": 0.7}},
    {"frequency_penalty": {"penalty": 0.4}}, {"no_repeat_ngram": {"ngram_size": 2}}, {"typical_p": {"mass": 0.9}},
    {"top_n_sigma": {"n": 1.5}}, {"epsilon": {"epsilon": 0.002}}, {"eta": {"epsilon": 0.002}},
    {"dynamic_temperature": {"temperature": 1.2, "delta": 0.5}}, {"logit_bias": {"bias": {"7": 3.0, "9": -2.0}}},
]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(3, 383), min_size=2, max_size=10),
       processors=st.lists(st.sampled_from(_STATELESS), max_size=4, unique_by=lambda p: next(iter(p))),
       temperature=st.sampled_from([0.6, 1.0, 1.4]), top_k=st.sampled_from([0, 20]),
       top_p=st.sampled_from([1.0, 0.85]), keep=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_replaying_each_stage_on_the_previous_stages_logits_reproduces_its_traced_candidates(
        llm, llama, prompt, processors, temperature, top_k, top_p, keep, seed):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=4,
                            ignore_eos=True, trace=keep, processors=processors)
    request = llm.engine.add_request(prompt, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    completion = request.sequences[0]
    events = _token_events(completion.trace)
    stages = request.plan.stages
    assert len(events) == len(completion.generated_ids) == 4
    for j, event in enumerate(events):
        history = prompt + completion.generated_ids[:j]
        with torch.no_grad():  # the model's logits at this position, from a plain forward
            logits = llama(torch.tensor([history])).logits[0, -1:].float()
        traced = event["stages"]
        assert [s["stage"] for s in traced] == ["model", *(stage.processor.name for stage in stages)]
        view = BatchView([params], [history], [len(prompt)], llm.engine.eos_token_ids, "cpu", generators=[None])
        for k, step in enumerate(traced):
            if k > 0:  # replay stage k alone on what stage k - 1 gave
                logits = apply_processors(logits, view, [(stages[k - 1],)], [False], [[None]])
            probs = torch.softmax(logits[0], dim=-1)
            # the same candidates: each traced probability is the replayed one, and the top `keep` agree (a
            # stage's removed tokens are not listed), and so does the chosen token's own probability
            assert [p for _, _, p in step["top"]] == pytest.approx(
                [v for v in probs.topk(keep).values.tolist() if v > 0], abs=1e-4)
            assert all(math.isclose(p, probs[t].item(), abs_tol=1e-4) for t, _, p in step["top"])
            assert math.isclose(step["p"], probs[event["token"]].item(), abs_tol=1e-4)
