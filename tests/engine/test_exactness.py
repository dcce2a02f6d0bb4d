"""Greedy decoding is token-exact with transformers `generate`, whatever else is in the batch.

Every test runs on three forwards: the model's own transformers modules with the paged attention function, the
fused decoder with its native kernels for small steps, and the fused decoder with torch ops only (on a copy of
the model, since it re-lays weights in place); the reference is always `generate` on the untouched model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import hf_greedy, random_prompts


@pytest.fixture(params=["transformers", "native", "torch-ops"],
                ids=["transformers-forward", "fused-native-kernels", "fused-torch-ops"])
def fused(request) -> str:
    """Which forward the engine runs."""
    return request.param


def _llm(model, tokenizer, fused: str, **options) -> LLM:
    if fused == "transformers":
        llm = LLM(model, tokenizer, dtype="float32", device="cpu", fused_decoder=False, **options)
        assert llm.engine.model.runner.fused is None
        return llm
    llm = LLM(copy.deepcopy(model), tokenizer, dtype="float32", device="cpu", fused_decoder=True,
              native_kernels=fused == "native", **options)
    assert llm.engine.model.runner.fused is not None
    assert (llm.engine.model.runner.fused.native is not None) == (fused == "native")
    return llm


def _check_exact(llm: LLM, model, prompts: list[list[int]], max_tokens: int) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.token_ids == hf_greedy(model, prompt, max_tokens), f"prompt of {len(prompt)} tokens differs"


def test_greedy_batch_of_16_mixed_lengths_matches_hf_generate(model, tokenizer, fused):
    # 16 prompts of 3..120 tokens with a 64-token step budget: prefill chunks and decodes share steps,
    # and requests finish at different steps (EOS or max_tokens).
    llm = _llm(model, tokenizer, fused, max_num_batched_tokens=64, block_size=8)
    _check_exact(llm, model, random_prompts(16, 3, 120, seed=1), max_tokens=48)


def test_greedy_matches_hf_generate_under_preemption(llama, tokenizer, fused):
    # A pool of 40 blocks of 4 tokens cannot hold 12 growing sequences at once: the scheduler must preempt
    # and recompute, and the tokens must not change.
    llm = _llm(llama, tokenizer, fused, kv_cache_memory=40 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4,
               max_num_batched_tokens=32)
    assert llm.engine.allocator.num_blocks == 40
    prompts = random_prompts(12, 5, 40, seed=2)
    _check_exact(llm, llama, prompts, max_tokens=40)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_greedy_matches_hf_generate_with_shared_prefixes_from_the_prefix_cache(llama, tokenizer, fused):
    base = random_prompts(1, 40, 41, seed=3)[0]
    prompts = [base + tail for tail in random_prompts(6, 2, 10, seed=4)]
    llm = _llm(llama, tokenizer, fused, block_size=8)
    _check_exact(llm, llama, prompts[:1], max_tokens=16)
    outs = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=16))
    assert all(o.metrics.num_cached_prompt_tokens >= 32 for o in outs), "prefix blocks were not reused"
    for prompt, out in zip(prompts[1:], outs):
        assert out.token_ids == hf_greedy(llama, prompt, 16)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_single_request_matches_hf_for_any_block_size(llama, tokenizer, block_size, fused):
    llm = _llm(llama, tokenizer, fused, block_size=block_size)
    _check_exact(llm, llama, random_prompts(2, 10, 30, seed=5), max_tokens=20)


@functools.cache
def _reference(arch: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return hf_greedy(_tiny(arch), list(prompt), max_tokens)


@functools.cache
def _tiny(arch: str):
    return tiny_model(arch)


TIE = 1e-5
"""Two logits this close (relative to the logits' scale) are a tie in float32: the engine's summation order (prompt
chunks, block size) may pick either, as transformers' own would under another batch shape."""


def _assert_greedy_equal_or_tied(arch: str, prompt: list[int], got: list[int], want: list[int]) -> None:
    """The engine's greedy tokens are transformers' or, from the first position they differ, the two tokens were tied
    in transformers' own logits there (after which the continuations legitimately differ)."""
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"prompt of {len(prompt)} tokens: {len(got)} tokens against {len(want)}"
    with torch.no_grad():
        logits = _tiny(arch)(torch.tensor([[*prompt, *want[:i]]])).logits[0, -1].float()
    gap = float(logits[want[i]] - logits[got[i]])
    assert gap <= TIE * max(1.0, float(logits.abs().max())), (
        f"prompt of {len(prompt)} tokens differs at token {i}: {got[i]} against {want[i]}, {gap:.3g} below it")


# derandomized, so CI's outcome does not depend on the draw; the case a fresh draw found on 2026-12-03 (qwen3, the
# transformers forward, a 50-token prompt prefilled in 16-token chunks: token 4 is 267 against transformers' 20) is a
# tie (log-probabilities -3.366834 and -3.366835), kept as an example
@example(arch="qwen3", forward="transformers", block_size=1, budget=16, max_num_seqs=1, kv_memory="1MiB", lengths=[50],
         max_tokens=5, speculate=0, seed=404)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["llama", "qwen3"]), forward=st.sampled_from(["transformers", "native", "torch-ops"]),
       block_size=st.sampled_from([1, 3, 4, 16]), budget=st.sampled_from([16, 33, 2048]),
       max_num_seqs=st.integers(1, 8), kv_memory=st.sampled_from(["1MiB", "16MiB"]),
       lengths=st.lists(st.integers(1, 120), min_size=1, max_size=6), max_tokens=st.integers(1, 12),
       speculate=st.integers(0, 4), seed=st.integers(0, 999))
def test_greedy_equals_transformers_under_any_engine_configuration(arch, forward, block_size, budget, max_num_seqs,
                                                                    kv_memory, lengths, max_tokens, speculate,
                                                                    seed, tokenizer):
    """Block size, step budget (prompts prefilled in chunks, steps of mid-prompt chunks alone), sequence limit,
    a pool small enough to preempt, n-gram speculation or none, on each forward: the tokens stay transformers'."""
    prompts = [random_prompts(1, n, n + 1, seed=seed + i)[0] for i, n in enumerate(lengths)]
    llm = _llm(_tiny(arch), tokenizer, forward, block_size=block_size, max_num_batched_tokens=budget,
               max_num_seqs=max_num_seqs, kv_cache_memory=kv_memory)
    strategy = {"speculative": {"proposer": "ngram", "num_speculative_tokens": speculate}} if speculate else None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, strategy=strategy))
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        _assert_greedy_equal_or_tied(arch, prompt, out.token_ids, _reference(arch, tuple(prompt), max_tokens))
