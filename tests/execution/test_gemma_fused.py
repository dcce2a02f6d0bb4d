"""Gemma 1, 2 and 3 through the fused decoder: (1 + w) RMSNorms, GELU-tanh gating and scaled embeddings (all three);
norms of the attention's and the MLP's outputs before each residual add, local and global layers, soft-capped scores
and logits (Gemma 2 and 3); per-head query/key norms and a RoPE table per layer type (Gemma 3). On the native kernels
and on torch ops, with float32, int8 and bf16 weights: token for token what transformers generates."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.execution.fused.blocks import fused_decoder_refusal
from decodekit.execution.fused.decoder import _rms_norm
from decodekit.execution.kernels.native import load_kernels
from tests.helpers.reference import (
    assert_batch_and_ngram_steps_match_transformers,
    assert_last_logits_and_hidden_match,
    hf_greedy,
    hf_greedy_bf16_cache,
    random_prompts,
)
from tests.helpers.unfused_models import as_quantized

kernels = load_kernels()
needs_kernels = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              head_dim=16, tie_word_embeddings=True)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention"]
VARIANTS = {
    "gemma": ("gemma", {}),
    # windows on the local layers, soft-capped scores and logits
    "gemma2": ("gemma2", dict(sliding_window=5, query_pre_attn_scalar=16, layer_types=LOCAL_GLOBAL,
                              attn_logit_softcapping=5.0, final_logit_softcapping=6.0)),
    # windows, a RoPE table per layer type (the global one scaled), a logit cap
    "gemma3": ("gemma3_text", dict(
        sliding_window=5, query_pre_attn_scalar=16, final_logit_softcapping=6.0, layer_types=LOCAL_GLOBAL,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})),
}


def gemma(variant: str = "gemma3", **overrides) -> torch.nn.Module:
    """A 3-layer random Gemma of `variant` whose norms are away from Gemma's zero init (so (1 + w) is not 1), with a
    widened head (rare greedy ties) and scaled queries (attention far from uniform, scores reaching the cap)."""
    kind, options = VARIANTS[variant]
    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, **{**COMMON, **options, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
        model.get_output_embeddings().weight.mul_(8.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    return model


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "torch ops"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gemma_through_the_fused_decoder_generates_transformers_tokens(variant, native, tokenizer):
    """Batch 6 with chunked prefill (prompts longer than the window), then n-gram verification steps."""
    if native and isinstance(kernels, str):
        pytest.skip(kernels)
    model = gemma(variant)
    assert fused_decoder_refusal(model) is None
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=24,
              fused_decoder=True, native_kernels=native)
    fused = llm.engine.model.runner.fused
    assert fused is not None and (fused.native is not None) == native
    assert [layer.rope for layer in fused.layers] == (LOCAL_GLOBAL if variant == "gemma3" else [None] * 3)
    assert [layer.window for layer in fused.layers] == ([None] * 3 if variant == "gemma" else [5, None, 5])
    assert [layer.softcap for layer in fused.layers] == ([5.0] * 3 if variant == "gemma2" else [None] * 3)
    assert_batch_and_ngram_steps_match_transformers(llm, model)


def test_the_local_and_global_rope_tables_differ_so_each_layer_must_take_its_own():
    model = gemma("gemma3")
    x, positions = torch.zeros(1, 4, 64), torch.arange(40, 44)[None]
    local = model.model.rotary_emb(x, positions, "sliding_attention")
    global_ = model.model.rotary_emb(x, positions, "full_attention")
    assert not torch.allclose(local[0], global_[0], atol=1e-3)


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "torch ops"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_hidden_states_equal_transformers_including_the_logit_cap(variant, native, tokenizer):
    """Stricter than greedy tokens: a score cap or a GELU form left out moves the logits, rarely the argmax."""
    if native and isinstance(kernels, str):
        pytest.skip(kernels)
    model = gemma(variant)
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="4MiB", block_size=4, fused_decoder=True,
              native_kernels=native)
    assert llm.engine.model.runner.fused is not None
    cap = 6.0 if variant != "gemma" else float("inf")
    assert_last_logits_and_hidden_match(llm, model, random_prompts(1, 12, 13, seed=2)[0], cap=cap)


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "bf16"])
@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_quantized_gemma_in_the_fused_decoder_generates_transformers_tokens_on_its_quantized_weights(
        variant, quantization, tokenizer):
    model = gemma(variant)
    reference = as_quantized(model, quantization)
    llm = LLM(model, tokenizer, quantization=quantization, kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=24)
    assert llm.engine.model.forward_name == f"fused ({quantization} weights)"
    prompts = random_prompts(5, 3, 40, seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]


def test_a_gemma3_decodekit_loads_runs_fused_by_default(tokenizer, tmp_path):
    model = gemma("gemma3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", block_size=4)
    assert llm.engine.model.forward_name.startswith("fused")
    prompts = random_prompts(3, 3, 30, seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 10) for p in prompts]


def test_gemma_variants_the_fused_decoder_does_not_implement_are_refused_with_the_reason():
    assert "hidden_activation 'silu'" in (fused_decoder_refusal(gemma("gemma3", hidden_activation="silu")) or "")
    assert "hidden_act 'silu'" in (fused_decoder_refusal(gemma("gemma", hidden_act="silu")) or "")
    bidirectional = gemma("gemma3", use_bidirectional_attention=True)
    assert "bidirectional" in (fused_decoder_refusal(bidirectional) or "")


def test_norms_round_as_gemma_and_llama_do_in_narrower_dtypes():
    """Gemma multiplies by its float32 (1 + w) before rounding to the activations' dtype, Llama rounds first and
    multiplies by its own-dtype weight: `_rms_norm` tells them by the weight's dtype, bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = (torch.randn(7, 64) * 3).to(torch.bfloat16)
    gemma, llama = Gemma3RMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        gemma.weight.normal_(0.0, 0.3)
        llama.weight.normal_(1.0, 0.3)
    llama = llama.to(torch.bfloat16)
    assert torch.equal(_rms_norm(x, 1.0 + gemma.weight.float(), 1e-6), gemma(x))
    assert torch.equal(_rms_norm(x, llama.weight, 1e-6), llama(x))


@needs_kernels
def test_a_bfloat16_gemma3_on_a_cpu_runs_fused_bf16_copies_in_float32(tokenizer, tmp_path):
    """`dtype="bfloat16"` on a CPU: the fused decoder's bf16 copies, float32 activations, a bf16 KV cache; the
    tokens are transformers' float32 tokens on the same bf16-valued weights with a cache rounding to bf16 (in float32
    arithmetic: `bf16_arithmetic: auto` rounds several rows' activations to bf16 on a CPU with bf16 dot products)."""
    model = gemma("gemma3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cpu", kv_cache_memory="16MiB", block_size=4,
              bf16_arithmetic="float32")
    assert llm.engine.model.forward_name == "fused (bf16 weights)"
    assert llm.engine.kv_cache.pool.dtype == torch.bfloat16
    prompts = random_prompts(4, 3, 40, seed=13)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy_bf16_cache(reference, p, 12) for p in prompts]
