"""Parallel sampling (n > 1): one prefill, n forked sequences sharing the prompt's KV blocks, seeded per sample."""

from __future__ import annotations

from decodekit import LLM, SamplingParams
from tests.helpers.reference import random_prompts


def test_n_samples_are_returned_and_reproducible_alone_or_batched(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(4, 5, 40, seed=1)
    params = SamplingParams(n=3, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0]
    batched = llm.generate(prompts, [params, SamplingParams(max_tokens=9, temperature=0),
                                     SamplingParams(n=2, seed=1, max_tokens=5), SamplingParams(max_tokens=7, seed=3)])
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in batched[0].outputs]
    assert len(alone.outputs) == 3 and all(len(o.token_ids) == 12 for o in alone.outputs)
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1  # different samples
    assert [o.index for o in alone.outputs] == [0, 1, 2]
    assert len(batched[2].outputs) == 2
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_sample_i_equals_a_single_request_seeded_seed_plus_i(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    prompt = random_prompts(1, 10, 11, seed=2)[0]
    many = llm.generate([prompt], SamplingParams(n=3, seed=20, max_tokens=8, ignore_eos=True))[0]
    singles = [llm.generate([prompt], SamplingParams(seed=20 + i, max_tokens=8, ignore_eos=True))[0].token_ids
               for i in range(3)]
    assert [o.token_ids for o in many.outputs] == singles


def test_forked_samples_share_the_prompt_blocks(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    engine = llm.engine
    prompt = random_prompts(1, 40, 41, seed=3)[0]  # 10 full blocks
    engine.add_request(prompt, SamplingParams(n=4, seed=0, max_tokens=3, ignore_eos=True), request_id="r")
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.allocator.num_blocks - engine.allocator.num_free_blocks)
    # 10 shared prompt blocks + one private block per sample for the new tokens, not 4 copies of the prompt
    assert max(used) <= 10 + 4
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
