"""Bad requests and faulty stopping criteria fail alone: the rest of the batch finishes, later calls work, and no
KV block or request record is left behind (issue 14's first items)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from decodekit import LLM, AsyncLLM, SamplingParams, StopDecision, StoppingCriterion, hookimpl
from decodekit.api.errors import RequestError
from tests.helpers.faulty_plugins import Explodes
from tests.helpers.reference import assert_idle, random_prompts


class _Answers(StoppingCriterion):
    name = "answers_yes"

    def check(self, seq, params, eos_token_ids, options=None):
        return "yes"


class _Criteria:
    @hookimpl
    def decodekit_register_stopping_criteria(self, register):
        register(Explodes.name, Explodes)
        register(_Answers.name, _Answers)


@pytest.mark.parametrize(("criterion", "message"), [
    ("explodes", "stopping criterion 'explodes' failed: RuntimeError('boom')"),
    ("answers_yes", "stopping criterion 'answers_yes' returned str, not a StopDecision or None"),
])
def test_a_faulty_stopping_criterion_fails_its_request_alone(llama, tokenizer, plugin_manager, criterion, message):
    plugin_manager.register(_Criteria(), "criteria")
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager)
    prompts = random_prompts(3, 4, 12, seed=1)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    solo = [o.token_ids for o in llm.generate(prompts, plain)]
    named = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stopping=[criterion])
    outs = llm.generate(prompts, [plain, named, plain])
    assert outs[1].finish_reason == "error" and outs[1].error == message
    assert [outs[0].token_ids, outs[2].token_ids] == [solo[0], solo[2]]
    assert [o.token_ids for o in llm.generate(prompts, plain)] == solo  # the engine goes on serving
    assert_idle(llm)


@pytest.mark.parametrize(("prompt", "message"), [
    ([float(t) for t in range(5, 25)], "the prompt's token ids must be integers, got 5.0 (float)"),
    ([5.0, 6.0], "the prompt's token ids must be integers, got 5.0 (float)"),
    ([5, True, 7], "the prompt's token ids must be integers, got True (bool)"),
    (None, "the prompt must be a string or a list of token ids, got NoneType"),
    ([[5, 6], [7, 8]], "the prompt's token ids must be integers, got [5, 6] (list)"),
    ({"prompt": "hi", "multi_modal_data": {}}, "a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (vLLM's "
     "TextPrompt and TokensPrompt) and nothing else; got keys ['multi_modal_data', 'prompt']"),
    ({"prompt_token_ids": [5.0]}, "the prompt's token ids must be integers, got 5.0 (float)"),
])
def test_a_malformed_prompt_in_a_batch_fails_alone_with_its_reason(llama, tokenizer, prompt, message):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    good = random_prompts(2, 4, 12, seed=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([good[0], prompt, good[1]], params)
    assert outs[1].finish_reason == "error" and outs[1].error == message
    assert [len(o.token_ids) for o in (outs[0], outs[2])] == [4, 4]
    assert len(llm.generate(good, params)) == 2
    assert_idle(llm)


def test_vllm_prompt_dicts_generate_what_their_text_and_ids_generate(llama, tokenizer):
    """`{"prompt": text}` and `{"prompt_token_ids": ids}` (vLLM's TextPrompt / TokensPrompt), alone or in a list,
    mixed with plain prompts; where a dict has both, its ids are the prompt, as in vLLM."""
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = random_prompts(1, 6, 7, seed=4)[0]
    plain = [o.token_ids for o in llm.generate(["Hello world", ids], params)]
    dicts = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": ids},
                          {"prompt": "ignored", "prompt_token_ids": ids}], params)
    assert [o.token_ids for o in dicts] == [plain[0], plain[1], plain[1]]
    assert dicts[0].prompt == "Hello world"
    assert llm.generate({"prompt_token_ids": ids}, params)[0].token_ids == plain[1]
    assert_idle(llm)


def test_a_seed_outside_the_generators_range_is_refused_when_the_params_are_made():
    with pytest.raises(ValidationError, match="seed"):
        SamplingParams(seed=2**70)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_a_second_stream_with_a_running_request_id_is_refused_and_the_first_finishes(llama, tokenizer):
    llm = AsyncLLM(engine=LLM(llama, tokenizer, kv_cache_memory="16MiB").engine)

    async def main() -> tuple[list[int], str]:
        first = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                             request_id="same")
        out = await first.__anext__()  # the first stream is running now (it has 199 tokens to go)
        try:
            async for _ in llm.generate([8, 9], SamplingParams(max_tokens=2), request_id="same"):
                pass
            error = ""
        except RequestError as exc:
            error = str(exc)
        async for later in first:
            out = later
        return out.outputs[0].token_ids, error

    try:
        tokens, error = asyncio.run(asyncio.wait_for(main(), timeout=120))
    finally:
        llm.shutdown()
    assert len(tokens) == 200 and error == "request id 'same' is already in use by a running stream"


def test_a_greedy_request_keeps_an_argmax_invariant_stage_that_a_later_stage_depends_on(llama, tokenizer):
    """`top_k(1)` then a logit bias: the bias can only act on what top-k kept, for greedy and sampled rows alike
    (greedy rows used to skip top-k and take the biased token)."""
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompt = random_prompts(1, 6, 10, seed=3)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    biased_token = next(t for t in range(3, 300) if t not in plain)
    processors = [{"top_k": {"top_k": 1}}, {"logit_bias": {"bias": {str(biased_token): 100.0}}}]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   processors=processors))[0]
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True,
                                                    processors=processors))[0]
    assert greedy.token_ids == plain == sampled.token_ids  # top-1 leaves one candidate; the bias cannot revive others


class _StopsAtThree(StoppingCriterion):
    name = "stops_at_three"

    def check(self, seq, params, eos_token_ids, options=None):
        return StopDecision("stop", "three", 0) if seq.num_generated >= 3 else None


def test_a_criterion_stopping_on_the_max_tokens_token_keeps_its_reason_and_text_trimming(llama, tokenizer,
                                                                                        plugin_manager):
    class Plugin:
        @hookimpl
        def decodekit_register_stopping_criteria(self, register):
            register(_StopsAtThree.name, _StopsAtThree)

    plugin_manager.register(Plugin(), "stops")
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                   stopping=["stops_at_three"]))[0]
    assert (out.finish_reason, out.outputs[0].stop_reason, out.text) == ("stop", "three", "")
    assert len(out.token_ids) == 3


def test_asking_for_cuda_without_a_cuda_device_is_a_clear_error(llama, tokenizer, monkeypatch):
    import torch

    from decodekit.api.errors import ModelLoadError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="device 'cuda' was asked for, but this torch build sees no CUDA"):
        LLM(llama, tokenizer, device="cuda")


def test_beam_search_refuses_a_named_stopping_criterion_instead_of_ignoring_it(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, strategy={"beam_search": {}},
                                                   stopping=[{"time_limit": {"seconds": 1e-6}}]))[0]
    assert out.finish_reason == "error"
    assert "stopping criteria (time_limit) are not applied by beam search" in out.error


def test_a_text_prompt_the_tokenizer_cannot_take_fails_alone_and_the_engine_goes_on(llama, tokenizer):
    """A lone surrogate (which JSON can carry) makes the tokenizer raise: that request fails with the reason, the
    others in the batch decode, and the engine is left idle (it used to raise out of `add_request`)."""
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["hello", "hi \ud800 there", "world"], params)
    assert outs[1].finish_reason == "error" and outs[1].error.startswith("the prompt could not be tokenized: ")
    assert [len(o.token_ids) for o in (outs[0], outs[2])] == [4, 4]
    assert_idle(llm)
