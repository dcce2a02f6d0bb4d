"""A faulty plugin fails only the requests it serves: processors that raise or return something unusable (wrong
shape, dtype or device, NaN, +inf, every token masked), stateful processors whose state hooks raise, and lifecycle
hooks that raise. The error names the plugin; the other requests' tokens equal their solo runs; the engine ends
idle with every KV block free (issue 14)."""

from __future__ import annotations

import pytest

from decodekit import LLM, SamplingParams
from tests.helpers.faulty_plugins import FaultyHooks, FaultyProcessors
from tests.helpers.reference import assert_idle, random_prompts


@pytest.fixture
def faulty_llm(llama, tokenizer, plugin_manager):
    plugin_manager.register(FaultyProcessors(), "faulty_plugin")
    return LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager)


_MESSAGES = {
    "raise": "processor 'faulty' raised RuntimeError('boom')",
    "none": "processor 'faulty' returned NoneType, not a tensor",
    "shape": "processor 'faulty' returned a torch.float32 tensor of shape (1, 10) on cpu for torch.float32 logits "
             "of shape (1, 384) on cpu",
    "int": "processor 'faulty' returned a torch.int64 tensor of shape (1, 384) on cpu for torch.float32 logits of "
           "shape (1, 384) on cpu",
    "meta": "processor 'faulty' returned a torch.float32 tensor of shape (1, 384) on meta for torch.float32 logits "
            "of shape (1, 384) on cpu",
    "nan": "processor 'faulty' returned NaN logits",
    "posinf": "processor 'faulty' returned +inf logits (softmax of them is NaN)",
    "neginf": "processor 'faulty' left no token to choose: every logit is -inf",
}

_STRATEGIES = {
    "greedy": {"temperature": 0, "ignore_eos": True},
    "sampled": {"temperature": 0.9, "seed": 11, "ignore_eos": True},
    "speculative (draft model)": {"temperature": 0, "ignore_eos": True,
                                  "strategy": {"speculative": {"proposer": "draft", "num_speculative_tokens": 3}}},
    "beam search": {"temperature": 0, "strategy": {"beam_search": {"num_beams": 2}}},
}


@pytest.mark.parametrize("strategy", list(_STRATEGIES))
@pytest.mark.parametrize("mode", list(_MESSAGES))
def test_a_faulty_processor_fails_its_request_alone_naming_the_processor(faulty_llm, mode, strategy):
    prompts = random_prompts(3, 4, 12, seed=5)
    base = dict(max_tokens=5, **_STRATEGIES[strategy])
    good = SamplingParams(**base, processors=[{"faulty": {"mode": mode, "fault": False}}])
    solo = [faulty_llm.generate([p], good)[0].token_ids for p in prompts]
    bad = SamplingParams(**base, processors=[{"faulty": {"mode": mode}}])
    outs = faulty_llm.generate(prompts, [good, bad, good])
    assert (outs[1].finish_reason, outs[1].error) == ("error", _MESSAGES[mode])
    assert outs[0].error is None and outs[2].error is None
    assert [outs[0].token_ids, outs[2].token_ids] == [solo[0], solo[2]]
    assert_idle(faulty_llm)


def test_a_processor_faulting_after_some_tokens_fails_its_request_there_and_others_finish(faulty_llm):
    prompts = random_prompts(2, 4, 12, seed=6)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = faulty_llm.generate(prompts, [plain, plain.model_copy(update={"processors": ["late_nan"]})])
    assert outs[1].finish_reason == "error" and outs[1].error == "processor 'late_nan' returned NaN logits"
    assert len(outs[1].token_ids) == 3 and len(outs[0].token_ids) == 6
    assert_idle(faulty_llm)


@pytest.mark.parametrize(("fails_in", "n"), [("init_state", 1), ("update_state", 1), ("fork_state", 2)])
def test_a_stateful_processor_whose_state_hook_raises_fails_its_request_alone(faulty_llm, fails_in, n):
    prompts = random_prompts(2, 4, 12, seed=7)
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, n=n)
    solo = faulty_llm.generate([prompts[0]], plain)[0]
    bad = plain.model_copy(update={"processors": [{"stateful": {"fails_in": fails_in}}]})
    outs = faulty_llm.generate(prompts, [plain, bad])
    assert outs[1].finish_reason == "error"
    assert outs[1].error.startswith(f"processor 'stateful': {fails_in} raised ValueError(")
    assert [o.token_ids for o in outs[0].outputs] == [o.token_ids for o in solo.outputs]
    assert_idle(faulty_llm)


def test_allowed_token_ids_and_bad_words_that_cover_each_other_fail_naming_the_processor_that_masked_all(
        llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, processors=[
        {"allowed_token_ids": {"token_ids": [5, 6]}}, {"bad_words": {"words_ids": [[5], [6]]}}])
    out = llm.generate([[5, 6, 7]], params)[0]
    assert (out.finish_reason, out.error, out.token_ids) == (
        "error", "processor 'bad_words' left no token to choose: every logit is -inf", [])
    assert_idle(llm)


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45, 1e-300])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1e-300])
def test_a_vanishing_temperature_samples_the_greedy_tokens_instead_of_nan(llama, tokenizer, temperature, top_p):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(3, 4, 12, seed=8)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                        ignore_eos=True))]
    cold = llm.generate(prompts, SamplingParams(temperature=temperature, top_p=top_p, seed=1, max_tokens=6,
                                                ignore_eos=True))
    assert [o.error for o in cold] == [None] * 3
    assert [o.token_ids for o in cold] == greedy


def test_a_raising_lifecycle_hook_fails_only_the_request_being_added_and_never_the_step(llama, tokenizer,
                                                                                      plugin_manager):
    plain_llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = [[20, 21, 22], [13, 14, 15], [30, 31]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    solo = [o.token_ids for o in plain_llm.generate(prompts, params)]
    plugin_manager.register(FaultyHooks(), "flaky_metrics")
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager)
    outs = llm.generate(prompts, params)
    assert outs[1].finish_reason == "error"
    assert outs[1].error == "plugin 'flaky_metrics': its decodekit_request_added hook raised KeyError('no room for 13')"
    assert [outs[0].token_ids, outs[2].token_ids] == [solo[0], solo[2]]
    assert_idle(llm)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_top_p_too_small_for_any_token_keeps_the_top_token_as_transformers_does(llama, tokenizer, temperature):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(2, 4, 12, seed=9)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5,
                                                                        ignore_eos=True))]
    tiny = llm.generate(prompts, SamplingParams(temperature=temperature, top_p=1e-300, seed=2, max_tokens=5,
                                                ignore_eos=True))
    assert [(o.error, o.token_ids) for o in tiny] == [(None, g) for g in greedy]


def test_a_failing_proposer_beside_a_seeded_draft_model_request_fails_alone_and_the_other_keeps_its_tokens(
        faulty_llm):
    prompts = random_prompts(2, 6, 12, seed=34)
    good = SamplingParams(temperature=0.9, seed=12, max_tokens=8, ignore_eos=True, strategy={"speculative": {
        "proposer": "draft", "num_speculative_tokens": 3}})
    solo = faulty_llm.generate([prompts[0]], good)[0].token_ids
    bad = good.model_copy(update={"strategy": {"speculative": {"proposer": "boom", "num_speculative_tokens": 3}}})
    outs = faulty_llm.generate(prompts, [good, bad])
    assert outs[1].finish_reason == "error" and "no drafts today" in outs[1].error
    assert outs[0].error is None and outs[0].token_ids == solo
    assert_idle(faulty_llm)


def test_a_strategy_choosing_a_token_outside_the_vocabulary_fails_alone_even_with_logprobs(faulty_llm):
    prompts = random_prompts(2, 4, 10, seed=35)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    solo = faulty_llm.generate([prompts[0]], plain)[0].token_ids
    outs = faulty_llm.generate(prompts, [plain, plain.model_copy(update={"strategy": {"out_of_vocabulary": {}}})])
    assert outs[1].finish_reason == "error"
    assert outs[1].error == ("strategy 'out_of_vocabulary' chose token ids outside the vocabulary [0, 384): "
                             "[1000000]")
    assert outs[0].token_ids == solo
    assert_idle(faulty_llm)


def test_parallel_sampling_with_the_largest_seed_runs_and_frees_every_block(faulty_llm):
    out = faulty_llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=3,
                                                          ignore_eos=True))[0]
    assert out.error is None and len(out.outputs) == 2
    assert_idle(faulty_llm)
