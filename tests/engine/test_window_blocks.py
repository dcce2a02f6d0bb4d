"""Models whose every layer attends through a sliding window (Mistral v0.1, Phi-3, StarCoder2) release the KV blocks
behind each running sequence's window, as vLLM does: a long conversation holds about a window's worth of blocks, not
its whole context, and the tokens stay transformers'. Models with a full-attention layer keep every block.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.execution.attention.kv_cache import uniform_window
from decodekit.models.tiny import tiny_model
from tests.execution.test_attention_variants import variant_model
from tests.helpers.reference import hf_greedy, random_prompts

MISTRAL = "mistral, window 6"
# the pool bytes of one token of these 2-layer models: 2 layers x (K, V) x 2 KV heads x head size 16 x 4 bytes
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


@functools.cache
def _model(name: str):
    return variant_model(name)


@functools.cache
def _reference(name: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return hf_greedy(_model(name), list(prompt), max_tokens)


def _held_blocks(llm: LLM) -> int:
    allocator = llm.engine.allocator
    return allocator.num_blocks - allocator.num_free_blocks


def test_only_models_windowed_on_every_layer_release_blocks():
    assert uniform_window(_model(MISTRAL)) == 6
    assert uniform_window(_model("phi3, window 9")) == 9
    # a full-attention layer reads every key again: nothing can be released
    assert uniform_window(_model("qwen2, window 11 on its second layer")) is None
    assert uniform_window(_model("gemma2, window 7 and soft-capped scores and logits")) is None
    # Gemma 3's pattern is five local layers to one global one: a 2-layer Gemma 3 has only local layers
    assert uniform_window(_model("gemma3, window 5 on its first layer")) == 5
    assert uniform_window(_model("gpt-oss, attention sinks and window 8 on its first layer")) is None
    assert uniform_window(tiny_model("llama")) is None
    assert uniform_window(tiny_model("mistral")) is None  # sliding_window None: full attention


def test_a_long_generation_holds_about_a_window_of_blocks_and_stays_exact(tokenizer):
    """A 40-token prompt decoding 80 tokens in 4-token blocks: once past its window it holds at most the blocks the
    window spans (plus the one being written), where keeping everything would hold 30."""
    model = _model(MISTRAL)
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=16)
    prompt = random_prompts(1, 40, 41, seed=5)[0]
    request = llm.engine.add_request(prompt, SamplingParams(max_tokens=80, temperature=0))
    held = []
    while not request.finished:
        llm.engine.step()
        held.append(_held_blocks(llm))
    window_blocks = -(-(6 + 1) // 4) + 1  # the window's keys, one key of margin, the block being written
    assert max(held[3:]) <= window_blocks + 1, held
    assert request.sequences[0].token_ids[len(prompt) :] == hf_greedy(model, prompt, 80)
    assert _held_blocks(llm) == 0


def test_released_blocks_let_more_long_requests_run_at_once_without_preemption(tokenizer):
    """Eight requests growing to 100 tokens each on a 64-block pool: with their whole contexts kept they would need
    200 blocks and preempt each other; holding a window each, they all run without one preemption."""
    model = _model(MISTRAL)
    llm = LLM(model, tokenizer, kv_cache_memory=64 * 4 * TOKEN_BYTES, block_size=4, max_num_batched_tokens=64)
    assert llm.engine.allocator.num_blocks == 64
    prompts = random_prompts(8, 20, 21, seed=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions == 0
    reference = [model.generate(torch.tensor([p]), max_new_tokens=80, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    assert [out.token_ids for out in outs] == reference


def test_a_model_with_a_full_attention_layer_keeps_every_block(tokenizer):
    """Qwen2 with one windowed layer of two: the full layer reads every key, so the sequence keeps all its blocks."""
    llm = LLM(_model("qwen2, window 11 on its second layer"), tokenizer, kv_cache_memory="16MiB", block_size=4)
    request = llm.engine.add_request(random_prompts(1, 40, 41, seed=5)[0], SamplingParams(max_tokens=40,
                                                                                          temperature=0))
    most = 0
    while not request.finished:
        llm.engine.step()
        most = max(most, _held_blocks(llm))
    assert most == 20  # 40 + 40 tokens in 4-token blocks


@pytest.mark.parametrize("name", [MISTRAL, "phi3, window 9"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_size=st.sampled_from([1, 2, 4, 16]), budget=st.sampled_from([16, 33, 2048]),
       max_num_seqs=st.integers(1, 6), pool_blocks=st.integers(40, 160),
       lengths=st.lists(st.integers(1, 60), min_size=1, max_size=5), max_tokens=st.integers(1, 40),
       speculate=st.integers(0, 4), seed=st.integers(0, 999))
def test_greedy_equals_transformers_while_blocks_behind_the_window_are_released(
        name, block_size, budget, max_num_seqs, pool_blocks, lengths, max_tokens, speculate, seed, tokenizer):
    """Block size, step budget (chunked prefill), sequence limit, a pool small enough to preempt (recompute after
    release), n-gram speculation (rollback after release) or none: the tokens stay transformers'."""
    prompts = [random_prompts(1, n, n + 1, seed=seed + i)[0] for i, n in enumerate(lengths)]
    if speculate:  # repeats give the n-gram proposer something to propose
        prompts = [(p * 3)[:60] for p in prompts]
    needed = max(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    llm = LLM(_model(name), tokenizer, kv_cache_memory=max(pool_blocks, needed) * block_size * TOKEN_BYTES,
              block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    strategy = {"speculative": {"proposer": "ngram", "num_speculative_tokens": speculate}} if speculate else None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, strategy=strategy))
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.token_ids == _reference(name, tuple(prompt), max_tokens), f"prompt of {len(prompt)} tokens"
    assert _held_blocks(llm) == 0
