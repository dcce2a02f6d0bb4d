"""`kv_cache_dtype: bfloat16`: the KV pool stores keys and values rounded to bf16 and attends them in float32, on
every forward path (native kernels, the fused decoder's torch ops, transformers' own forward), so the tokens are
transformers' on a cache that rounds the same way; it holds twice the tokens in the same memory, composes with
speculative decoding, beam search and the prefix cache, and is refused where it cannot run."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.execution.plan import kv_cache_dtype
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import hf_greedy_bf16_cache, random_prompts

PATHS = {
    "native kernels": {},
    "fused decoder, torch ops": {"native_kernels": False},
    "transformers forward": {"fused_decoder": False},
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_kv_cache_generates_what_transformers_generates_with_a_bf16_rounding_cache(path, arch, tokenizer):
    """Batch 6 with a small step budget, so prompts are prefilled in several chunks next to decoding sequences."""
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    llm = LLM(model, tokenizer, kv_cache_dtype="bfloat16", kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=32, **PATHS[path])
    assert llm.engine.kv_cache.pool.dtype == torch.bfloat16
    prompts = random_prompts(6, 3, 60, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy_bf16_cache(reference, p, 16) for p in prompts]


@pytest.mark.parametrize("path", list(PATHS))
def test_the_bf16_pool_holds_the_float32_pools_keys_and_values_rounded_to_nearest_even(path, tokenizer):
    """Layer 0's keys and values do not depend on attention, so after the same prompt the bf16 pool's layer 0 is
    exactly the float32 pool's, rounded as `.to(torch.bfloat16)` rounds it."""
    model = tiny_model("llama")
    pools = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_dtype=dtype, kv_cache_memory="4MiB", block_size=4,
                  **PATHS[path])
        llm.generate(random_prompts(1, 30, 31, seed=2), SamplingParams(max_tokens=3, temperature=0))
        pools[dtype] = llm.engine.kv_cache.pool[0]
    used = pools["float32"].abs().sum(dim=(0, 2, 3, 4)) > 0  # the blocks the request wrote
    assert int(used.sum()) >= 8
    stored = pools["bfloat16"][:, : len(used)]  # the same block ids: the allocator hands out the lowest first
    assert torch.equal(stored.float().abs().sum(dim=(0, 2, 3, 4)) > 0, used)
    assert torch.equal(stored[:, used], pools["float32"][:, used].to(torch.bfloat16))


def test_the_native_and_torch_paths_compute_the_same_logprobs_over_a_bf16_cache(tokenizer):
    """Both read the same stored bf16 values; only float32 summation order differs."""
    model = tiny_model("llama")
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    prompts = random_prompts(4, 3, 50, seed=9)
    native = LLM(copy.deepcopy(model), tokenizer, kv_cache_dtype="bfloat16", kv_cache_memory="16MiB", block_size=4)
    torch_ops = LLM(copy.deepcopy(model), tokenizer, kv_cache_dtype="bfloat16", kv_cache_memory="16MiB",
                    block_size=4, native_kernels=False)
    for a, b in zip(native.generate(prompts, params), torch_ops.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert [x[t].logprob for t in x] == pytest.approx([y[t].logprob for t in y], abs=1e-5)


def test_a_bf16_kv_cache_holds_twice_the_blocks_of_float32_in_the_same_memory(tokenizer):
    model = tiny_model("llama")
    full = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="8MiB", block_size=4)
    half = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="8MiB", block_size=4, kv_cache_dtype="bfloat16")
    assert full.engine.kv_cache.pool.dtype == torch.float32
    assert half.engine.allocator.num_blocks == 2 * full.engine.allocator.num_blocks
    assert half.engine.kv_cache.pool.nbytes == pytest.approx(full.engine.kv_cache.pool.nbytes, rel=0.01)


@pytest.mark.parametrize("draft", ["int8 self-draft", "n-gram"])
def test_speculative_decoding_over_a_bf16_kv_cache_is_lossless(draft, tokenizer):
    """The draft's pool follows the engine's kv_cache_dtype; greedy speculation gives plain decoding's tokens."""
    model = tiny_model("llama")
    prompts = [p + p[:8] for p in random_prompts(5, 10, 40, seed=3)]  # repeats, so the n-gram proposer drafts
    plain = LLM(copy.deepcopy(model), tokenizer, kv_cache_dtype="bfloat16", kv_cache_memory="16MiB", block_size=4)
    want = [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0))]
    if draft == "n-gram":
        spec = LLM(copy.deepcopy(model), tokenizer, kv_cache_dtype="bfloat16", kv_cache_memory="16MiB", block_size=4)
        strategy = {"speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}
    else:
        spec = LLM(copy.deepcopy(model), tokenizer, draft="target", draft_quantization="int8",
                   kv_cache_dtype="bfloat16", kv_cache_memory="16MiB", block_size=4)
        strategy = {"speculative": {"num_speculative_tokens": 4}}
    outs = spec.generate(prompts, SamplingParams(max_tokens=20, temperature=0, strategy=strategy))
    assert [o.token_ids for o in outs] == want
    assert spec.engine.allocator.num_free_blocks == spec.engine.allocator.num_blocks


def test_beam_search_and_the_prefix_cache_share_bf16_blocks_like_float32_ones(tokenizer):
    """Beams fork by copy-on-write of pool blocks and repeated prompts reuse cached blocks: with a bf16 pool, a
    request's beams are the same alone, beside others, and on a prompt the cache already holds."""
    model = tiny_model("llama")
    llm = LLM(model, tokenizer, kv_cache_dtype="bfloat16", kv_cache_memory="16MiB", block_size=4)
    beam = SamplingParams(max_tokens=10, temperature=0, strategy={"beam_search": {"num_beams": 3,
                                                                                  "num_return_sequences": 2}})
    prompts = random_prompts(3, 9, 30, seed=13)
    alone = [llm.generate([p], beam)[0] for p in prompts]
    together = llm.generate(prompts, beam)  # the prompts' blocks are cached by now
    for a, b in zip(alone, together):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.score for o in a.outputs] == pytest.approx([o.score for o in b.outputs], abs=1e-5)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_auto_keeps_the_activations_dtype_and_other_dtypes_off_the_cpu_are_refused(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, kv_cache_memory="4MiB")
    loaded, config = llm.engine.loaded, llm.engine.config
    assert config.kv_cache_dtype == "auto" and kv_cache_dtype(loaded, config) == torch.float32
    on_gpu = dataclasses.replace(loaded, device=torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype bfloat16: on cuda the KV cache holds the activations' "
                                          r"dtype \(float32\)"):
        kv_cache_dtype(on_gpu, config.model_copy(update={"kv_cache_dtype": "bfloat16"}))
    assert kv_cache_dtype(on_gpu, config.model_copy(update={"kv_cache_dtype": "float32"})) == torch.float32


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices_named(tokenizer):
    with pytest.raises(ConfigError, match="kv_cache_dtype") as error:
        LLM(tiny_model("llama"), tokenizer, kv_cache_dtype="fp8", kv_cache_memory="4MiB")
    assert "bfloat16" in str(error.value)
