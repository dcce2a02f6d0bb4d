"""Models the fused decoder cannot take (Gemma 2, OPT, ...) have their own linear layers re-laid and multiplied on
the native kernels when decodekit loads them: same values, same tokens as transformers, any step size; a model
object passed in is left alone unless `native_kernels: true` asks."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.core.fused_decoder import fused_decoder_refusal
from decodekit.errors import ConfigError
from decodekit.models.tiny import tiny_tokenizer
from tests.conftest import hf_greedy, random_prompts

SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = {
    # tied embeddings, sliding-window and global layers, soft-capped scores and logits, no biases
    "gemma2": dict(head_dim=16, num_key_value_heads=2, sliding_window=8, query_pre_attn_scalar=16,
                   tie_word_embeddings=True),
    # biases on every projection, an MLP of plain linears
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, tie_word_embeddings=False),
}


def _model(arch: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **SMALL, **ARCHS[arch]), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # fewer greedy near-ties, as tiny_model does
    return model.eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def saved(request, tmp_path_factory):
    """(folder, the model as saved): a model decodekit loads from a folder is its own to re-lay."""
    folder = tmp_path_factory.mktemp(request.param)
    model = _model(request.param)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert fused_decoder_refusal(model) is not None
    return folder, model


def test_a_loaded_model_runs_re_laid_linears_and_generates_transformers_tokens(saved):
    """Batch 6 with chunked prefill (steps of 0, 1, 2-8 and many rows reach the products)."""
    folder, reference = saved
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=32)
    assert "linear layers re-laid" in llm.engine.model.forward_name
    prompts = random_prompts(6, 3, 60, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]


def test_speculative_verification_on_re_laid_linears_is_lossless(saved):
    folder, reference = saved
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", block_size=4)
    prompts = [p * 3 for p in random_prompts(4, 4, 9, seed=3)]
    spec = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, strategy={
        "speculative": {"proposer": "ngram", "num_speculative_tokens": 5}}))
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    assert [o.token_ids for o in spec] == [hf_greedy(reference, p, 20) for p in prompts]


def test_re_laying_keeps_every_weight_value_and_a_tied_head_tied(saved):
    folder, reference = saved
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB")
    model = llm.engine.runner.model
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    assert (head.weight is embeddings.weight) == bool(model.config.tie_word_embeddings)
    prompt = random_prompts(1, 5, 20, seed=1)[0]
    assert hf_greedy(model, prompt, 8) == hf_greedy(reference, prompt, 8), "transformers must still run it"


def test_a_model_object_is_left_alone_unless_native_kernels_is_true(tokenizer):
    model = _model("opt")
    weight = model.get_output_embeddings().weight
    llm = LLM(model, tokenizer, kv_cache_memory="4MiB")
    assert llm.engine.model.forward_name == "transformers" and model.get_output_embeddings().weight is weight
    reference = copy.deepcopy(model)
    asked = LLM(model, tokenizer, kv_cache_memory="4MiB", native_kernels=True)
    assert "linear layers re-laid" in asked.engine.model.forward_name
    prompt = random_prompts(1, 5, 20, seed=2)[0]
    out = asked.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.token_ids == hf_greedy(reference, prompt, 8)


def test_native_kernels_false_keeps_torchs_products_and_true_refuses_what_cannot_run(saved, tokenizer):
    folder, _ = saved
    assert LLM(str(folder), dtype="float32", kv_cache_memory="4MiB",
               native_kernels=False).engine.model.forward_name == "transformers"
    with pytest.raises(ConfigError, match=r"native_kernels: they run float32 on a CPU, not torch\.float16"):
        LLM(_model("opt").half(), tokenizer, kv_cache_memory="4MiB", native_kernels=True)


def test_a_draft_model_decodekit_loads_gets_re_laid_linears_and_speculation_stays_lossless(tmp_path):
    folders = {}
    for arch in ARCHS:
        folders[arch] = tmp_path / arch
        _model(arch).save_pretrained(folders[arch])
        tiny_tokenizer().save_pretrained(folders[arch])
    llm = LLM(str(folders["gemma2"]), draft=str(folders["opt"]), dtype="float32", kv_cache_memory="16MiB",
              block_size=4)
    prompts = random_prompts(3, 5, 30, seed=6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, strategy={
        "speculative": {"proposer": "draft", "num_speculative_tokens": 3}}))
    draft = llm.engine.components.get("proposers", "draft").model  # built at first use
    assert "linear layers re-laid" in draft.forward_name
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    reference = _model("gemma2")
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]
