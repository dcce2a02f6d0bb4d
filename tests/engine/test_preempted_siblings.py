"""Requests that outgrow the KV cache lose nothing.

A preempted request with several sequences (`n` > 1, beams) comes back for recompute sharing its common prefix
again: the first sequence is allocated, the others take the prefix from the prefix cache once it is computed. Before,
each sequence was allocated its whole context, so a request whose sequences fit together (sharing their prompt)
failed with "needs N KV blocks" once preempted, its output lost. And one sequence cannot outgrow the pool: the
context is capped to what the KV cache holds (except where a sliding window lets blocks go)."""

from __future__ import annotations

import pytest
import torch

from decodekit import LLM, SamplingParams
from tests.execution.test_attention_variants import variant_model
from tests.helpers.reference import random_prompts

# pool bytes of one token of the tiny 2-layer models: 2 layers x (K, V) x 2 KV heads x head size 16 x 4 bytes
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def _run(model, tokenizer, num_blocks: int, params: SamplingParams, with_rival: bool):
    """Run a 40-token prompt with `params`, after (optionally) an older 60-token greedy request that takes the
    pool's blocks, so the newer one is preempted and recomputed."""
    llm = LLM(model, tokenizer, kv_cache_memory=num_blocks * 4 * TOKEN_BYTES, block_size=4, max_num_batched_tokens=64)
    rival, prompt = random_prompts(2, 40, 41, seed=1)
    prompts = [rival, prompt] if with_rival else [prompt]
    rival_params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, [rival_params, params] if with_rival else [params])
    return outs[-1], llm


@pytest.mark.parametrize(("params", "num_blocks"), [
    (SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True), 40),
    (SamplingParams(max_tokens=24, temperature=0, strategy={"beam_search": {"num_beams": 4,
                                                                            "num_return_sequences": 4}}), 32),
], ids=["n=4 seeded samples", "4 beams"])
def test_a_preempted_request_of_several_sequences_recomputes_sharing_its_prompt_and_loses_nothing(
        llama, tokenizer, params, num_blocks):
    out, llm = _run(llama, tokenizer, num_blocks, params, with_rival=True)
    assert llm.engine.scheduler.num_preemptions > 0
    assert out.error is None
    alone, _ = _run(llama, tokenizer, 400, params, with_rival=False)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_a_request_whose_sequences_cannot_fit_even_sharing_their_prompt_still_fails_by_name(llama, tokenizer):
    """Sharing is counted once, not assumed away: 4 samples of a 40-token prompt that each grow past the pool's
    share are refused with the blocks they need."""
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=120, ignore_eos=True)
    out, _ = _run(llama, tokenizer, 40, params, with_rival=True)
    assert out.error is not None and "KV blocks" in out.error



def test_a_context_longer_than_the_kv_cache_is_capped_so_a_long_generation_ends_with_length_not_an_error(
        llama, tokenizer):
    """A 20-block pool holds 80 tokens: a 30-token prompt asking for 100 more ends at 80 with `length` (the tokens
    transformers generates), where it used to fail mid-generation and lose them; a longer prompt is refused up
    front, saying why."""
    llm = LLM(llama, tokenizer, kv_cache_memory=20 * 4 * TOKEN_BYTES, block_size=4)
    assert llm.engine.max_model_len == 80
    prompt = random_prompts(1, 30, 31, seed=2)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    reference = llama.generate(torch.tensor([prompt]), max_new_tokens=50, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, 30:].tolist()
    assert out.token_ids == reference
    refused = llm.generate([7] * 90, SamplingParams(max_tokens=4))[0]
    assert refused.error is not None and "what the KV cache holds" in refused.error


def test_a_model_windowed_on_every_layer_keeps_its_context_beyond_the_pool(tokenizer):
    """Its blocks behind the window are released as it grows, so the pool does not bound its context."""
    llm = LLM(variant_model("mistral, window 6"), tokenizer, kv_cache_memory=20 * 4 * TOKEN_BYTES,
              block_size=4)
    assert llm.engine.max_model_len == 512
    out = llm.generate(random_prompts(1, 30, 31, seed=2)[0], SamplingParams(max_tokens=100, temperature=0,
                                                                            ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 100
