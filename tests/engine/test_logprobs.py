"""Logprobs of generated tokens (`SamplingParams.logprobs`, `logprobs_mode`), exact against transformers in
float32 on a tiny model, in mixed batches, under greedy, sampling, `n` and speculative decoding."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as hf
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams, Strategy, hookimpl
from tests.helpers.reference import random_prompts

TOL = 1e-5


@pytest.fixture(scope="module")
def llm(llama, tokenizer):
    return LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)


def _hf_rows(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The model's logits at each generated position (one plain forward over prompt + generated)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def _hf_processed(rows: torch.Tensor, prompt: list[int], generated: list[int],
                  processors: hf.LogitsProcessorList) -> torch.Tensor:
    """transformers' processors applied position by position, log-softmaxed (`compute_transition_scores` with
    `normalize_logits=True`)."""
    out = []
    for j in range(len(generated)):
        scores = processors(torch.tensor([prompt + generated[:j]]), rows[j : j + 1].clone())
        out.append(torch.log_softmax(scores, dim=-1)[0])
    return torch.stack(out)


def _chosen(entries, tokens):
    return [entry[token].logprob for entry, token in zip(entries, tokens)]


def test_raw_logprobs_equal_transformers_generate_output_logits_in_a_mixed_batch(llm, llama):
    prompts = random_prompts(4, 3, 14, seed=21)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    asking = plain.model_copy(update={"logprobs": 3})
    outs = llm.generate(prompts, [asking, plain, asking, plain])
    assert outs[1].outputs[0].logprobs is None and outs[1].outputs[0].cumulative_logprob is None
    for i in (0, 2):
        out = outs[i].outputs[0]
        hf_out = llama.generate(torch.tensor([prompts[i]]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
        expected = torch.log_softmax(torch.cat(hf_out.logits).float(), dim=-1)
        assert out.token_ids == hf_out.sequences[0, len(prompts[i]):].tolist()
        assert len(out.logprobs) == 6
        chosen = torch.tensor(_chosen(out.logprobs, out.token_ids))
        assert torch.allclose(chosen, expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=TOL)
        for j, entry in enumerate(out.logprobs):
            top = expected[j].topk(3)
            assert all(t in entry for t in top.indices.tolist())
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                assert math.isclose(entry[token].logprob, value, abs_tol=TOL)
        assert math.isclose(out.cumulative_logprob, float(chosen.sum()), abs_tol=1e-4)


def test_processed_logprobs_equal_transformers_transition_scores_for_seeded_sampling(llm, llama):
    prompts = random_prompts(3, 3, 14, seed=22)
    params = SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=6, ignore_eos=True, logprobs=2,
                            logprobs_mode="processed")
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        tokens = out.token_ids
        warpers = hf.LogitsProcessorList([hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(20)])
        expected = _hf_processed(_hf_rows(llama, prompt, tokens), prompt, tokens, warpers)
        chosen = torch.tensor(_chosen(out.outputs[0].logprobs, tokens))
        assert torch.allclose(chosen, expected.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=TOL)
        assert all(math.isfinite(v) for v in chosen.tolist())  # a sampled token was never a masked one


def test_processed_logprobs_with_a_repetition_penalty_equal_transformers(llm, llama):
    prompt = random_prompts(1, 5, 12, seed=23)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, logprobs_mode="processed",
                            processors=[{"repetition_penalty": {"penalty": 1.3}}])
    out = llm.generate([prompt], params)[0].outputs[0]
    processors = hf.LogitsProcessorList([hf.RepetitionPenaltyLogitsProcessor(1.3)])
    expected = _hf_processed(_hf_rows(llama, prompt, out.token_ids), prompt, out.token_ids, processors)
    chosen = torch.tensor(_chosen(out.logprobs, out.token_ids))
    assert torch.allclose(chosen, expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=TOL)
    assert all(len(entry) == 1 for entry in out.logprobs)  # logprobs=0: the chosen token only


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_speculative_decoding_returns_the_logprobs_of_plain_decoding(llm, proposer, mode):
    prompts = [(p * 4)[:30] for p in random_prompts(4, 4, 9, seed=24)]  # repeated phrases: n-gram matches
    base = dict(temperature=0, max_tokens=16, ignore_eos=True, logprobs=4, logprobs_mode=mode,
                processors=[{"repetition_penalty": {"penalty": 1.1}}])
    plain = llm.generate(prompts, SamplingParams(**base))
    spec = llm.generate(prompts, SamplingParams(**base, strategy={"speculative": {
        "proposer": proposer, "num_speculative_tokens": 3}}))
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    if proposer == "draft":  # the target as its own draft: every draft accepted, several tokens per step
        assert sum(o.metrics.num_accepted_tokens for o in spec) == sum(o.metrics.num_draft_tokens for o in spec)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ea.keys() == eb.keys()
            assert all(math.isclose(ea[t].logprob, eb[t].logprob, abs_tol=TOL) and ea[t].rank == eb[t].rank
                       for t in ea)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_parallel_greedy_sequences_under_speculation_return_plain_decodings_logprobs(llm, mode):
    """n > 1 under speculation: each fork's tokens come from its own verified rows (several a step, the target as
    its own draft), and its logprobs are plain decoding's, the first token's (from the parent's row) included."""
    prompt = (random_prompts(1, 4, 9, seed=27)[0] * 4)[:30]
    base = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, logprobs_mode=mode,
                processors=[{"repetition_penalty": {"penalty": 1.1}}])
    plain = llm.generate([prompt], SamplingParams(**base))[0].outputs[0]
    spec = llm.generate([prompt], SamplingParams(**base, n=3, strategy={"speculative": {
        "proposer": "draft", "num_speculative_tokens": 3}}))[0]
    assert spec.metrics.num_accepted_tokens == spec.metrics.num_draft_tokens > 0
    assert len(spec.outputs) == 3
    for out in spec.outputs:
        assert out.token_ids == plain.token_ids and len(out.logprobs) == len(plain.logprobs)
        for ea, eb in zip(plain.logprobs, out.logprobs):
            assert ea.keys() == eb.keys()
            assert all(math.isclose(ea[t].logprob, eb[t].logprob, abs_tol=TOL) and ea[t].rank == eb[t].rank
                       for t in ea)


def test_parallel_sampling_gives_each_sequence_its_own_logprobs_equal_to_its_solo_draws(llm):
    prompt = random_prompts(1, 4, 10, seed=25)[0]
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=5, ignore_eos=True, logprobs=1)
    alone = llm.generate([prompt], params)[0]
    batched = llm.generate([prompt, *random_prompts(3, 4, 10, seed=26)],
                           [params] + [SamplingParams(temperature=0, max_tokens=7)] * 3)[0]
    assert len(alone.outputs) == 3
    for a, b in zip(alone.outputs, batched.outputs):
        assert a.token_ids == b.token_ids and len(a.logprobs) == 5
        assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=TOL)
                   for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        assert math.isclose(a.cumulative_logprob, sum(_chosen(a.logprobs, a.token_ids)), abs_tol=1e-4)


@pytest.mark.parametrize(("length_penalty", "repetition_penalty"), [(1.0, 1.0), (0.5, 1.3)])
def test_beam_search_logprobs_equal_transformers_transition_scores_and_add_up_to_each_beams_score(
        llama, tokenizer, length_penalty, repetition_penalty):
    llama.generation_config.eos_token_id = 5  # a frequent token, so hypotheses finish at different lengths
    try:
        llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
        prompts = random_prompts(3, 3, 14, seed=5)
        beam = {"beam_search": {"num_beams": 3, "length_penalty": length_penalty, "num_return_sequences": 3}}
        penalty = [{"repetition_penalty": {"penalty": repetition_penalty}}] if repetition_penalty != 1.0 else []
        processed = SamplingParams(temperature=0, max_tokens=8, logprobs=2, logprobs_mode="processed",
                                   processors=penalty, strategy=beam)
        raw = processed.model_copy(update={"logprobs_mode": "raw"})
        outs = llm.generate(prompts + prompts, [processed] * 3 + [raw] * 3)
        for prompt, out, raw_out in zip(prompts, outs[:3], outs[3:]):
            hf_out = llama.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, num_beams=3,
                                    num_return_sequences=3, length_penalty=length_penalty,
                                    repetition_penalty=repetition_penalty, output_scores=True,
                                    return_dict_in_generate=True, pad_token_id=0, eos_token_id=[5, 2])
            transition = llama.compute_transition_scores(hf_out.sequences, hf_out.scores, hf_out.beam_indices,
                                                         normalize_logits=False)
            for i, o in enumerate(out.outputs):
                n = len(o.token_ids)
                assert o.token_ids == hf_out.sequences[i, len(prompt) : len(prompt) + n].tolist()
                assert len(o.logprobs) == n
                assert _chosen(o.logprobs, o.token_ids) == pytest.approx(transition[i, :n].tolist(), abs=1e-4)
                assert o.cumulative_logprob / n ** length_penalty == pytest.approx(o.score, abs=1e-4)
                assert o.score == pytest.approx(float(hf_out.sequences_scores[i]), abs=1e-4)
            for o in raw_out.outputs:  # raw: the model's own log-softmax along each hypothesis
                want = torch.log_softmax(_hf_rows(llama, prompt, o.token_ids), dim=-1)
                assert _chosen(o.logprobs, o.token_ids) == pytest.approx(
                    [want[j, t].item() for j, t in enumerate(o.token_ids)], abs=TOL)
    finally:
        llama.generation_config.eos_token_id = 2
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


@settings(max_examples=25, deadline=None)
@given(prompt=st.lists(st.integers(3, 383), min_size=1, max_size=12), top=st.integers(0, 20),
       temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]), mode=st.sampled_from(["raw", "processed"]),
       top_p=st.sampled_from([1.0, 0.8]))
def test_logprobs_are_at_most_zero_sorted_and_ranked_consistently(llm, prompt, top, temperature, mode, top_p):
    out = llm.generate([prompt], SamplingParams(temperature=temperature, top_p=top_p, seed=1, max_tokens=4,
                                                ignore_eos=True, logprobs=top, logprobs_mode=mode))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 4
    for entry, token in zip(out.logprobs, out.token_ids):
        chosen = entry[token]
        assert chosen.logprob <= 0.0 and chosen.rank >= 1
        alternatives = [lp for t, lp in entry.items() if t != token or lp.rank <= top]
        ranked = sorted((lp for lp in entry.values()), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in ranked] == sorted((lp.logprob for lp in ranked), reverse=True)
        assert len(alternatives) >= min(top, 1) if top else len(entry) == 1
        if chosen.rank <= top:  # the chosen token is among the listed top ones, at its own rank
            assert chosen.rank == 1 + sum(lp.logprob > chosen.logprob for t, lp in entry.items() if t != token)
        if mode == "processed" and temperature > 0:
            assert math.isfinite(chosen.logprob)  # sampled tokens come from the processed distribution


def _plain_forward_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_a_plain_forward_even_when_the_prefix_is_cached_or_chunked(llama, tokenizer, chunk):
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, **options)
    prompts = random_prompts(3, 17, 40, seed=27)  # longer than a 16-token chunk
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # its prefix is now cached
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, [params, SamplingParams(temperature=0, max_tokens=3), params])
    assert outs[1].prompt_logprobs is None
    for i in (0, 2):
        prompt, got = prompts[i], outs[i].prompt_logprobs
        expected = _plain_forward_logprobs(llama, prompt)
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for q in range(1, len(prompt)):
            entry, token = got[q], prompt[q]
            assert abs(entry[token].logprob - float(expected[q - 1, token])) < TOL
            assert set(expected[q - 1].topk(2).indices.tolist()) <= set(entry)
        # generation itself is unchanged by asking for prompt logprobs
        assert outs[i].token_ids == llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                                          ignore_eos=True))[0].token_ids
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_logprobs_survive_preemption_and_recomputation(llama, tokenizer):
    """A KV pool too small for the batch preempts requests and recomputes them: their logprobs (and prompt
    logprobs, recorded once) equal those of an unconstrained run."""
    prompts = random_prompts(6, 10, 16, seed=28)
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    roomy = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4).generate(prompts, params)
    tight_llm = LLM(llama, tokenizer, kv_cache_memory="48KiB", block_size=4)
    tight = tight_llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) and b.prompt_logprobs[0] is None
        pairs = list(zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs))
        assert all(x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < TOL for t in x) for x, y in pairs)


def test_constrained_processed_logprobs_give_chosen_tokens_finite_values_and_masked_ones_minus_inf(llm):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=6, logprobs=5, logprobs_mode="processed",
                            processors=[{"choice": {"choices": ["yes", "no"]}}])
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    for entry, token in zip(out.logprobs, out.token_ids):
        assert math.isfinite(entry[token].logprob)
        # the constraint leaves few tokens: the top 5 list masked ones at -inf, never above an allowed one
        values = [lp.logprob for t, lp in sorted(entry.items(), key=lambda item: item[1].rank) if t != token]
        assert values == sorted(values, reverse=True)
        assert all(v == -math.inf or math.isfinite(v) for v in values)


def test_a_stop_inside_accepted_drafts_drops_the_logprobs_of_the_tokens_after_it(llm):
    prompt = random_prompts(1, 6, 10, seed=29)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop = next(t for t in free[3:] if t not in free[:3])  # a token first generated at position >= 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop], logprobs=1)
    plain = llm.generate([prompt], params)[0].outputs[0]
    spec = llm.generate([prompt], params.model_copy(update={"strategy": {"speculative": {
        "proposer": "draft", "num_speculative_tokens": 5}}}))[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.token_ids[-1] == stop
    assert len(spec.logprobs) == len(spec.token_ids) == len(plain.logprobs)
    assert math.isclose(spec.cumulative_logprob, plain.cumulative_logprob, abs_tol=1e-4)


class _RawArgmax(Strategy):
    """Greedy on the raw logits: it never runs the request's processors (`scores = "raw"`)."""

    name = "raw_argmax"
    scores = "raw"

    def select(self, ctx, seqs, logits):
        for seq, token in zip(seqs, logits.argmax(dim=-1).tolist()):
            ctx.append_token(seq, token)


def test_processed_logprobs_without_processed_rows_stay_one_per_token_as_nan(llama, tokenizer, plugin_manager):
    class Plugin:
        @hookimpl
        def decodekit_register_strategies(self, register):
            register(_RawArgmax.name, _RawArgmax)

    plugin_manager.register(Plugin(), "raw_argmax_plugin")
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                   logprobs_mode="processed", strategy={"raw_argmax": {}}))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 4
    assert all(math.isnan(entry[token].logprob) for entry, token in zip(completion.logprobs, completion.token_ids))
