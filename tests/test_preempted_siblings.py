"""A preempted request with several sequences (`n` > 1, beams) comes back for recompute sharing its common prefix
again: the first sequence is allocated, the others take the prefix from the prefix cache once it is computed. Before,
each sequence was allocated its whole context, so a request whose sequences fit together (sharing their prompt)
failed with "needs N KV blocks" once preempted, its output lost."""

from __future__ import annotations

import pytest

from decodekit import LLM, SamplingParams
from tests.conftest import random_prompts

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

