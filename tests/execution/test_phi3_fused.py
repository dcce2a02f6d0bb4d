"""Phi-3 through the fused decoder: the Llama block with q/k/v and gate/up already fused into one linear each, and a
sliding window, on the native kernels and on torch ops, with float32, int8 and bf16 weights: token for token what
transformers generates. A partial rotary (Phi-4-mini's) is refused by the fused decoder and served by transformers'
own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.execution.fused.blocks import fused_decoder_refusal
from decodekit.execution.kernels.native import load_kernels
from tests.helpers.reference import assert_batch_and_ngram_steps_match_transformers, hf_greedy, random_prompts
from tests.helpers.unfused_models import as_quantized

kernels = load_kernels()
needs_kernels = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")

PHI3 = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            sliding_window=9, tie_word_embeddings=False)


def phi3(**overrides) -> torch.nn.Module:
    """A 2-layer random Phi-3 with a 9-token window, its head widened (rare greedy ties) and its q/k/v scaled
    (attention far from uniform)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **{**PHI3, **overrides}),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(10.0)
    return model


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "torch ops"])
def test_phi3_through_the_fused_decoder_generates_transformers_tokens(native, tokenizer):
    """Batch 6 with chunked prefill (prompts longer than the window), then n-gram verification steps."""
    if native and isinstance(kernels, str):
        pytest.skip(kernels)
    model = phi3()
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=24,
              fused_decoder=True, native_kernels=native)
    fused = llm.engine.model.runner.fused
    assert fused is not None and (fused.native is not None) == native
    assert [(layer.q_heads, layer.kv_heads, layer.intermediate, layer.window) for layer in fused.layers] == [
        (4, 2, 128, 9)] * 2
    assert_batch_and_ngram_steps_match_transformers(llm, model)


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "bf16"])
def test_a_quantized_phi3_decodekit_loads_frees_its_layer_weights_and_generates_transformers_tokens_on_its_copies(
        quantization, tokenizer, tmp_path):
    model = phi3()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = as_quantized(model, quantization)
    llm = LLM(str(tmp_path), dtype="float32", quantization=quantization, kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=24)
    assert llm.engine.model.forward_name == f"fused ({quantization} weights)"
    layer = llm.engine.loaded.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.is_meta and layer.mlp.gate_up_proj.weight.is_meta
    prompts = random_prompts(5, 3, 40, seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]


def test_a_partial_rotary_is_refused_by_the_fused_decoder_and_served_by_transformers_own_forward(tokenizer, tmp_path):
    """Phi-4-mini rotates 3/4 of each head; the fused decoder's RoPE rotates whole heads."""
    model = phi3(partial_rotary_factor=0.75)
    assert "rotates 12 of each head's 16 dimensions" in (fused_decoder_refusal(model) or "")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", block_size=4)
    assert llm.engine.model.runner.fused is None
    prompts = random_prompts(3, 3, 30, seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 10) for p in prompts]
