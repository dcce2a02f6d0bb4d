"""Models whose layers attend through a sliding window (Mistral, Qwen2, Phi-3, Gemma 2/3's local layers) or soft-cap
their attention scores (Gemma 2) are served from the paged cache over their whole context, token for token what
transformers generates, under chunked prefill, continuous batching, speculative verification and the prefix cache.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.api.errors import UnsupportedModelError
from decodekit.execution.attention.kv_cache import has_attention_sinks, needs_capped_attention, sliding_window
from decodekit.execution.fused.blocks import fused_decoder_refusal
from decodekit.execution.geometry import model_geometry
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import assert_last_logits_and_hidden_match, hf_greedy, random_prompts

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
# Windows shorter than the prompts (and across the 4-token blocks used below); a window on some layers only.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral, window 6": ("mistral", dict(sliding_window=6)),
    "qwen2, window 11 on its second layer": ("qwen2", dict(use_sliding_window=True, sliding_window=11,
                                                           max_window_layers=1)),
    "phi3, window 9": ("phi3", dict(sliding_window=9)),
    "gemma2, window 7 and soft-capped scores and logits": (
        "gemma2", dict(head_dim=16, sliding_window=7, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                       final_logit_softcapping=3.0)),
    "gemma3, window 5 on its first layer": ("gemma3_text", dict(head_dim=16, sliding_window=5,
                                                                query_pre_attn_scalar=16)),
    "gpt-oss, attention sinks and window 8 on its first layer": (
        "gpt_oss", dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def variant_model(name: str) -> Any:
    """A 2-layer random model of the variant, its LM head widened so greedy ties are rare (as `tiny_model`) and its
    queries scaled so attention scores reach the soft-cap (random init leaves them near 0, attention near uniform)."""
    kind, options = VARIANTS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **BASE, **options), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for layer in model.model.layers:
            attn = layer.self_attn
            query = attn.q_proj if hasattr(attn, "q_proj") else attn.qkv_proj  # Phi-3 fuses q, k and v
            query.weight.mul_(30.0)
            if hasattr(attn, "sinks"):  # gpt-oss initializes its sink logits to 0; spread them so they matter
                attn.sinks.normal_(0.0, 2.0)
    return model.eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_windowed_and_soft_capped_models_generate_what_transformers_generates(name, tokenizer):
    """Batch 6, prompts of 3-50 tokens prefilled in chunks of a 24-token budget beside decoding sequences."""
    model = variant_model(name)
    assert needs_capped_attention(model.config) or has_attention_sinks(model)
    llm = _assert_greedy_matches(model, tokenizer, random_prompts(6, 3, 50, seed=7), 20, budget=24)
    assert llm.engine.max_model_len == 512  # the whole context, not the window


def _assert_greedy_matches(model, tokenizer, prompts: list[list[int]], max_tokens: int, budget: int) -> LLM:
    """Greedy decoding of `prompts` under a `budget`-token step budget equals transformers'; returns the engine."""
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, max_tokens) for p in prompts]
    return llm


@pytest.mark.parametrize("name", ["mistral, window 6", "gemma3, window 5 on its first layer"])
def test_long_prompts_prefilled_in_many_chunks_skip_the_keys_behind_the_window_and_stay_exact(name, tokenizer):
    """Prompts of 60-130 tokens in 32-token chunks: later chunks gather only the blocks their window reaches."""
    _assert_greedy_matches(variant_model(name), tokenizer, random_prompts(3, 60, 130, seed=9), 10, budget=32)


def test_the_window_the_cap_and_the_sinks_change_the_tokens_so_the_tests_above_can_fail(tokenizer):
    """Without its window, Gemma 2 without its score cap, and gpt-oss with zero sink logits, transformers generates
    other tokens on these prompts: what the tests above compare is not vacuous."""
    prompts = random_prompts(6, 3, 50, seed=7)
    windowed = variant_model("mistral, window 6")
    unwindowed = copy.deepcopy(windowed)
    unwindowed.config.sliding_window = None
    assert [hf_greedy(windowed, p, 20) for p in prompts] != [hf_greedy(unwindowed, p, 20) for p in prompts]
    capped = variant_model("gemma2, window 7 and soft-capped scores and logits")
    uncapped = copy.deepcopy(capped)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert [hf_greedy(capped, p, 20) for p in prompts] != [hf_greedy(uncapped, p, 20) for p in prompts]
    sunk = variant_model("gpt-oss, attention sinks and window 8 on its first layer")
    unsunk = copy.deepcopy(sunk)
    with torch.no_grad():
        for layer in unsunk.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no share of the softmax
    assert [hf_greedy(sunk, p, 20) for p in prompts] != [hf_greedy(unsunk, p, 20) for p in prompts]


@pytest.mark.parametrize("name", ["mistral, window 6", "gemma2, window 7 and soft-capped scores and logits"])
def test_speculative_verification_over_a_window_is_lossless(name, tokenizer):
    """n-gram verification steps score several queries per sequence, each with its own window."""
    model = variant_model(name)
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = [p * 3 for p in random_prompts(4, 4, 9, seed=3)]  # repeats give the n-gram proposer hits
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    spec = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, strategy={
        "speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.token_ids for o in plain] == [hf_greedy(model, p, 24) for p in prompts]


@pytest.mark.parametrize("name", ["mistral, window 6", "gemma2, window 7 and soft-capped scores and logits"])
def test_beam_search_over_a_window_equals_transformers_beams(name, tokenizer):
    """Beams fork the window's blocks copy-on-write; each beam attends its own window."""
    model = variant_model(name)
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=24)
    prompts = random_prompts(3, 10, 40, seed=2)
    beams = SamplingParams(max_tokens=8, temperature=0, strategy={"beam_search": {"num_beams": 3}})
    outs = llm.generate(prompts, beams)
    reference = [model.generate(torch.tensor([p]), max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_a_prefix_cached_prompt_attends_the_same_window(tokenizer):
    """The second request starts from the first one's stored blocks and still attends only its window."""
    model = variant_model("mistral, window 6")
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4)
    shared = random_prompts(1, 30, 31, seed=11)[0]
    prompts = [[*shared, 5, 6, 7], [*shared, 8, 9]]
    first = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0))
    second = llm.generate(prompts[1], SamplingParams(max_tokens=12, temperature=0))
    assert second[0].metrics.num_cached_prompt_tokens >= 28
    assert [first[0].token_ids, second[0].token_ids] == [hf_greedy(model, p, 12) for p in prompts]


def test_hidden_states_steps_keep_the_models_own_logit_soft_cap(tokenizer):
    """A step that also returns hidden states (for a strategy reading them) runs the whole causal-LM forward, so
    Gemma 2's final logit soft-cap still applies; the hidden state is the LM head's input."""
    model = variant_model("gemma2, window 7 and soft-capped scores and logits")
    llm = LLM(model, tokenizer, kv_cache_memory="4MiB", block_size=4)
    # capped at final_logit_softcapping
    assert_last_logits_and_hidden_match(llm, model, random_prompts(1, 20, 21, seed=1)[0], cap=3.0)


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "torch ops"])
@pytest.mark.parametrize("name", ["mistral, window 6", "qwen2, window 11 on its second layer"])
def test_the_fused_decoder_attends_each_layers_window(name, native, tokenizer):
    """Mistral (every layer windowed) and Qwen2 (one layer of two) through the fused decoder, on the native
    attention and on torch ops: batch 6 with chunked prefill, then n-gram verification steps."""
    model = variant_model(name)
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=24,
              fused_decoder=True, native_kernels=native)
    fused = llm.engine.model.runner.fused
    assert fused is not None and (fused.native is not None) == native
    assert any(layer.window for layer in fused.layers)
    prompts = random_prompts(6, 3, 50, seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 20) for p in prompts]
    copies = [p * 3 for p in random_prompts(3, 4, 9, seed=3)]
    spec = llm.generate(copies, SamplingParams(max_tokens=16, temperature=0, strategy={
        "speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}))
    assert [o.token_ids for o in spec] == [hf_greedy(model, p, 16) for p in copies]


def test_a_window_is_read_from_the_config_as_transformers_models_read_it():
    assert sliding_window(tiny_model("mistral").config) is None
    assert sliding_window(variant_model("mistral, window 6").config) == 6
    qwen = AutoConfig.for_model("qwen2", **BASE, use_sliding_window=False, sliding_window=11)
    assert sliding_window(qwen) is None and not needs_capped_attention(qwen)
    mistral = variant_model("mistral, window 6").config
    assert needs_capped_attention(mistral) and needs_capped_attention(mistral, 7)
    assert not needs_capped_attention(mistral, 6)  # no context is longer than the window
    assert sliding_window(variant_model("qwen2, window 11 on its second layer").config) == 11


def test_layer_types_the_paged_attention_cannot_serve_are_refused_by_name():
    model = tiny_model("llama")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match=r"\['chunked_attention'\].*full_attention.*sliding_attention"):
        model_geometry(model, fused_decoder_refusal(model))
