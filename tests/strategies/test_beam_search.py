"""Beam search inside the engine: same sequences and scores as transformers `generate(num_beams=...)`."""

from __future__ import annotations

import pytest
import torch

from decodekit import LLM, SamplingParams
from tests.helpers.reference import random_prompts


def _hf_beams(model, prompt, max_new_tokens, num_beams, length_penalty, early_stopping, num_return, eos):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, num_beams=num_beams,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         num_return_sequences=num_return, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=list(eos))
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        seqs.append(row[: ends[0] + 1] if ends else row)
    return seqs, out.sequences_scores.tolist()


def _beam(num_beams=4, length_penalty=1.0, early_stopping=False, num_return=1, max_tokens=12):
    return SamplingParams(max_tokens=max_tokens, temperature=0, strategy={"beam_search": {
        "num_beams": num_beams, "length_penalty": length_penalty, "early_stopping": early_stopping,
        "num_return_sequences": num_return}})


@pytest.mark.parametrize(("num_beams", "length_penalty", "early_stopping", "num_return"), [
    (4, 1.0, False, 1), (3, 0.5, True, 3), (4, 2.0, "never", 2), (2, -1.0, False, 2),
])
def test_beam_search_matches_hf_sequences_and_scores(llama, tokenizer, num_beams, length_penalty, early_stopping,
                                                      num_return):
    llama.generation_config.eos_token_id = 5  # a frequent token, so hypotheses finish at different lengths
    try:
        llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
        prompts = random_prompts(4, 3, 20, seed=7)
        outs = llm.generate(prompts, _beam(num_beams, length_penalty, early_stopping, num_return))
        for prompt, out in zip(prompts, outs):
            want, scores = _hf_beams(llama, prompt, 12, num_beams, length_penalty, early_stopping, num_return,
                                     llm.engine.eos_token_ids)
            assert [o.token_ids for o in out.outputs] == want
            assert [o.score for o in out.outputs] == pytest.approx(scores, abs=1e-4)
    finally:
        llama.generation_config.eos_token_id = 2
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_beam_requests_share_the_batch_with_greedy_and_sampled_requests(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(6, 3, 30, seed=3)
    alone = [llm.generate([p], _beam(num_return=2))[0] for p in prompts[:3]]
    mixed = llm.generate(prompts, [_beam(num_return=2)] * 3 + [
        SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=9, seed=1),
        SamplingParams(max_tokens=5, temperature=0, n=2)])
    for a, m in zip(alone, mixed[:3]):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in m.outputs]
        assert [o.score for o in a.outputs] == pytest.approx([o.score for o in m.outputs], abs=1e-5)
    assert len(mixed[3].token_ids) == 12 and len(mixed[5].outputs) == 2


def test_one_beam_equals_greedy(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    prompts = random_prompts(5, 3, 25, seed=11)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    beams = llm.generate(prompts, _beam(num_beams=1, max_tokens=10))
    assert [g.token_ids for g in greedy] == [b.token_ids for b in beams]


def test_beam_search_refuses_sampling_warpers_and_stop_strings(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    bad = [SamplingParams(max_tokens=4, temperature=0.7, strategy="beam_search"),
           SamplingParams(max_tokens=4, temperature=0, stop=["x"], strategy="beam_search"),
           SamplingParams(max_tokens=4, temperature=0, strategy={"beam_search": {"num_beams": 2,
                                                                                 "num_return_sequences": 3}})]
    outs = llm.generate([[5, 6, 7]] * 3, bad)
    assert all(o.finish_reason == "error" for o in outs)
    assert "warpers (temperature)" in outs[0].error
    assert "stop strings" in outs[1].error
    assert "num_return_sequences (3) must be <= num_beams (2)" in outs[2].error


def test_beam_search_with_repetition_penalty_matches_hf(llama, tokenizer):
    """Processors apply to every beam's log-probabilities, as in transformers."""
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(3, 3, 20, seed=12)
    params = SamplingParams(max_tokens=10, temperature=0, processors=[{"repetition_penalty": {"penalty": 1.5}}],
                            strategy={"beam_search": {"num_beams": 3, "num_return_sequences": 2}})
    eos = list(llm.engine.eos_token_ids)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ref = llama.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, num_beams=3,
                             num_return_sequences=2, repetition_penalty=1.5, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)
        want = []
        for row in ref.sequences[:, len(prompt):].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            want.append(row[: ends[0] + 1] if ends else row)
        assert [o.token_ids for o in out.outputs] == want
        assert [o.score for o in out.outputs] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [None, 24])  # 24 tokens a step: recomputed beams finish in different steps
def test_beam_search_survives_preemption_with_the_same_results(llama, tokenizer, budget):
    prompts = random_prompts(6, 20, 40, seed=21)
    params = _beam(num_beams=3, num_return=2, max_tokens=16)
    roomy = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4).generate(prompts, params)
    options = {"max_num_batched_tokens": budget} if budget else {}
    tight = LLM(llama, tokenizer, kv_cache_memory=48 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, **options)  # 48 blocks
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in outs] == [[o.token_ids for o in r.outputs] for r in roomy]
    assert tight.engine.allocator.num_free_blocks == tight.engine.allocator.num_blocks
