"""int8 and bf16 weights for every architecture: a model the fused decoder cannot take (StarCoder2, OPT; or any model
under `fused_decoder: false`) multiplies compressed copies of its own linear layers (`relaid_linears`), and its
tokens are transformers' on the model whose weights are those copies. Refusals name the option."""

from __future__ import annotations

import copy

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.execution.kernels.native import load_kernels
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import hf_greedy, hf_greedy_bf16_cache, random_prompts
from tests.helpers.unfused_models import UNFUSED_ARCHS, as_quantized, save_unfused, unfused_model

kernels = load_kernels()
pytestmark = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")

@pytest.fixture(scope="module", params=list(UNFUSED_ARCHS))
def saved(request, tmp_path_factory):
    """(folder, the model as saved)."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_unfused(request.param, folder)


@pytest.mark.parametrize("quantization", ["bf16", "int8", "q4_1"])
def test_a_model_the_fused_decoder_cannot_take_generates_transformers_tokens_on_its_quantized_weights(
        saved, quantization):
    """Batch 6 with chunked prefill (steps of 0, 1, 2-8 and many rows), then n-gram verification."""
    folder, model = saved
    reference = as_quantized(model, quantization)
    llm = LLM(str(folder), dtype="float32", quantization=quantization, kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=32)
    assert llm.engine.model.forward_name.endswith(f"linear layers in {quantization})")
    prompts = random_prompts(6, 3, 60, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]
    copies = [p * 3 for p in random_prompts(3, 4, 9, seed=3)]
    spec = llm.generate(copies, SamplingParams(max_tokens=16, temperature=0, strategy={
        "speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}))
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    assert [o.token_ids for o in spec] == [hf_greedy(reference, p, 16) for p in copies]


def test_a_loaded_model_frees_its_layer_weights_and_keeps_its_embeddings_and_head(saved):
    folder, model = saved
    llm = LLM(str(folder), dtype="float32", quantization="int8", kv_cache_memory="4MiB")
    loaded = llm.engine.model.runner.model
    head, embeddings = loaded.get_output_embeddings(), loaded.get_input_embeddings()
    linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    assert linears and all(m.weight.is_meta for m in linears)
    assert not head.weight.is_meta and not embeddings.weight.is_meta
    assert (head.weight is embeddings.weight) == bool(loaded.config.tie_word_embeddings)
    assert torch.equal(embeddings.weight, model.get_input_embeddings().weight)


def test_a_model_object_keeps_its_weights_and_runs_the_quantized_products(tokenizer):
    """A model passed in is quantized (asked by name), never freed: its own forward now multiplies the copies."""
    model = unfused_model("opt")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = as_quantized(model, "bf16")
    prompt = random_prompts(1, 5, 20, seed=4)[0]
    llm = LLM(model, tokenizer, quantization="bf16", kv_cache_memory="16MiB", block_size=4)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    want = hf_greedy(reference, prompt, 10)
    assert llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].token_ids == want
    assert hf_greedy(model, prompt, 10) == want


@pytest.mark.parametrize("quantization", ["bf16", "int8", "q4_0"])
def test_fused_decoder_false_quantizes_a_llama_models_own_linear_layers(quantization, tokenizer):
    model = tiny_model("llama")
    reference = as_quantized(model, quantization)
    llm = LLM(model, tokenizer, quantization=quantization, fused_decoder=False, kv_cache_memory="16MiB",
              block_size=4, max_num_batched_tokens=24)
    assert llm.engine.model.runner.fused is None and f"in {quantization}" in llm.engine.model.forward_name
    prompts = random_prompts(5, 3, 40, seed=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]


def test_a_separately_loaded_draft_the_fused_decoder_cannot_take_drafts_on_quantized_weights(saved):
    """A StarCoder2 / OPT draft with `draft_quantization: int8` beside its float32 self as target: speculation stays
    lossless, and the draft's own weights are freed when it is built."""
    folder, model = saved
    llm = LLM(str(folder), dtype="float32", draft=str(folder), draft_quantization="int8", kv_cache_memory="16MiB",
              block_size=4)
    prompts = random_prompts(4, 3, 30, seed=2)
    spec = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, strategy={
        "speculative": {"proposer": "draft", "num_speculative_tokens": 3}}))
    assert [o.token_ids for o in spec] == [hf_greedy(model, p, 16) for p in prompts]
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in spec) > drafted // 2
    proposer = llm.engine.components.get("proposers", "draft")
    assert proposer.model.forward_name.endswith("linear layers in int8)")
    assert "in int8" not in llm.engine.model.forward_name
    assert llm.engine.draft is not None
    draft, target = llm.engine.draft.model, llm.engine.loaded.model
    linears = [m for m in draft.modules() if isinstance(m, torch.nn.Linear) and m is not draft.get_output_embeddings()]
    assert linears and all(m.weight.is_meta for m in linears)
    assert not any(m.weight.is_meta for m in target.modules() if isinstance(m, torch.nn.Linear))


def test_a_bfloat16_model_decodekit_loads_runs_bf16_copies_in_float32_and_matches_transformers_float32(saved,
                                                                                                      tokenizer):
    """`dtype="bfloat16"` on a CPU for an architecture the fused decoder cannot take: the linear layers multiply bf16
    copies of its own weights, the rest is widened to float32, the KV cache stays bf16. The tokens are transformers'
    float32 greedy tokens on the same (bf16-valued) weights with a cache rounding to bf16. A model object passed in
    keeps its dtype and torch's bf16 forward. (Pinned to float32 arithmetic: `bf16_arithmetic: auto` rounds the
    activations of products of several rows to bf16 on a CPU with bf16 dot products.)"""
    folder, model = saved
    reference = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
    llm = LLM(str(folder), dtype="bfloat16", device="cpu", kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=32, bf16_arithmetic="float32")
    assert llm.engine.config.quantization == "bf16" and llm.engine.model.forward_name.endswith("in bf16)")
    assert llm.engine.kv_cache.pool.dtype == torch.bfloat16
    assert llm.engine.model.runner.model.get_input_embeddings().weight.dtype == torch.float32
    prompts = random_prompts(5, 3, 50, seed=12)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy_bf16_cache(reference, p, 12) for p in prompts]
    given = LLM(copy.deepcopy(model).to(torch.bfloat16), tokenizer, dtype="bfloat16", device="cpu",
                kv_cache_memory="16MiB")
    assert given.engine.config.quantization is None and given.engine.model.forward_name == "transformers"


def test_quantization_where_it_cannot_run_is_refused_with_the_option_named(tokenizer):
    with pytest.raises(ConfigError, match=r"draft_quantization: a quantized self-draft .*fused decoder cannot take"):
        LLM(unfused_model("opt"), tokenizer, draft="target", draft_quantization="int8", kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match=r"draft_quantization: a quantized self-draft .*draft_fused_decoder is false"):
        LLM(tiny_model("llama"), tokenizer, draft="target", draft_quantization="int8", draft_fused_decoder=False,
            kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match=r"quantization 'int8' multiplies on the native kernels"):
        LLM(unfused_model("opt"), tokenizer, quantization="int8", native_kernels=False, kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match=r"quantization 'bf16' multiplies on the native kernels.*float16"):
        LLM(unfused_model("opt").half(), tokenizer, quantization="bf16", kv_cache_memory="16MiB")
    model = unfused_model("opt")
    LLM(model, tokenizer, quantization="int8", kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match=r"already multiply int8 products for another engine"):
        LLM(model, tokenizer, quantization="bf16", kv_cache_memory="16MiB")
