"""Each model runs once through a recording attention function when it is loaded (`execution/attention/probe.py`): an
attention keyword the paged attention does not implement refuses the model by name instead of serving it wrong
tokens, and the KV pool gets the width the layers' keys really have."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.api.errors import UnsupportedModelError
from decodekit.execution.attention.probe import AttentionProbe, probe_attention
from decodekit.execution.fused.blocks import fused_decoder_refusal
from decodekit.execution.geometry import model_geometry
from tests.helpers.reference import hf_greedy, random_prompts

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
# Architectures the paged attention serves (their greedy tokens equal `generate`'s:
# tests/execution/test_attention_variants.py and the probe of stop 34); none may be refused by the keyword check.
SERVED = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mistral", "olmo2", "granite", "starcoder2",
          "cohere", "cohere2", "phi", "gpt_neox", "gpt2", "opt", "olmo", "gpt_bigcode", "qwen3_moe", "mixtral",
          "gpt_oss", "exaone4", "ministral3", "nemotron", "granitemoe", "olmoe"]


def _model(arch: str, **options: Any) -> Any:
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**BASE, **options})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # greedy ties rare, as `tiny_model`
    return model.eval()


@pytest.mark.parametrize("arch", SERVED)
def test_architectures_the_paged_attention_serves_pass_the_keyword_check(arch):
    probe = probe_attention(_model(arch))
    assert probe is not None and probe.refusal(arch) is None
    assert probe.layer_indices == (0, 1)


def test_a_model_whose_attention_carries_its_own_mask_is_refused_by_name(tokenizer):
    """Doge computes a dynamic attention mask and passes it to the attention function, which the paged attention
    (causal over the context) would drop."""
    with pytest.raises(UnsupportedModelError, match=r"DogeForCausalLM: its attention passes \['attention_mask'\]"):
        LLM(_model("doge"), tokenizer)


def test_an_attention_keyword_the_paged_attention_does_not_implement_refuses_the_model(tokenizer):
    """A layer passing a keyword of a future model family (here an ALiBi bias) to the attention function."""
    model = _model("olmo2")
    attn = model.model.layers[1].self_attn
    attn.forward = functools.partial(attn.forward, alibi_slopes=torch.ones(4))
    with pytest.raises(UnsupportedModelError, match=r"passes \['alibi_slopes'\].*wrong tokens"):
        LLM(model, tokenizer)


def test_a_model_whose_attention_is_bidirectional_is_refused(tokenizer):
    """Gemma 3 with `use_bidirectional_attention` (EmbeddingGemma's setting) marks its attention non-causal, which
    SDPA reads from the module; the paged attention would serve it causally."""
    model = _model("gemma3_text", head_dim=16, query_pre_attn_scalar=16, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match=r"bidirectional \(is_causal false\)"):
        LLM(model, tokenizer)


def test_the_kv_pool_takes_the_width_the_layers_write_when_the_config_misstates_it(tokenizer):
    """GPT-NeoX has no grouped-query attention; a config carrying `num_key_value_heads` anyway used to get a pool half
    as wide as its keys, and every request failed."""
    model = _model("gpt_neox", num_key_value_heads=None)
    model.config.num_key_value_heads = 2
    assert model_geometry(model, fused_decoder_refusal(model)).num_kv_heads == 4
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=24)
    prompts = random_prompts(4, 3, 30, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]


def test_the_probe_runs_once_and_leaves_the_model_as_it_found_it():
    model = _model("olmo2")  # not a fused-decoder architecture: those skip the probe
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    implementation = model.config._attn_implementation
    first = model_geometry(model, fused_decoder_refusal(model))
    assert model_geometry(model, fused_decoder_refusal(model)) == first and calls == [1]
    assert model.config._attn_implementation == implementation
    assert (first.num_kv_heads, first.head_dim) == (2, 16)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)  # still plain transformers
    assert out.shape == (1, 6)


def test_refusals_name_what_the_pool_cannot_hold():
    assert "layer_idx" in (AttentionProbe((None,), ((2, 16),), frozenset()).refusal("M") or "")
    assert "different shapes" in (AttentionProbe((0, 1), ((2, 16), (1, 16)), frozenset()).refusal("M") or "")
    assert AttentionProbe((0, 1), ((2, 16), (2, 16)), frozenset({"sliding_window", "scaling"})).refusal("M") is None
