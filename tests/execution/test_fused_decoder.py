"""The fused decoder: same tokens as transformers, weights fused without copies, refusals that say why."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decodekit import LLM, SamplingParams
from decodekit.api import huge_pages
from decodekit.api.errors import ConfigError
from decodekit.execution.fused.blocks import fused_decoder_refusal
from decodekit.execution.fused.decoder import FusedDecoder, _rms_norm
from decodekit.models.tiny import tiny_model
from tests.helpers.memory_maps import vm_flags
from tests.helpers.reference import hf_greedy, random_prompts


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      eos_token_id=2, bos_token_id=1)).eval()


@pytest.mark.parametrize("huge", [False, True], ids=["torch's memory", "huge pages"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fusing_keeps_every_weight_value_and_stores_none_twice(arch, huge, monkeypatch):
    if huge:  # the tiny model's weights moved onto huge pages too (`api.huge_pages`)
        monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    pristine = tiny_model(arch, tie_word_embeddings=True)
    model = copy.deepcopy(pristine)
    before = sum(p.numel() for p in model.parameters())
    FusedDecoder(model)
    for (name, want), got in zip(pristine.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    assert sum(p.numel() for p in model.parameters()) == before  # tied head stays tied, nothing duplicated
    attn = model.model.layers[0].self_attn
    storages = {p.weight.untyped_storage().data_ptr() for p in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(storages) == 1, "q/k/v must be views of one fused buffer"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if huge and huge_pages.huge_pages_available():
        assert "hg" in vm_flags(model.model.layers[0].mlp.down_proj.weight.data_ptr())
    prompt = random_prompts(1, 5, 20, seed=1)[0]
    assert hf_greedy(model, prompt, 12) == hf_greedy(pristine, prompt, 12), "transformers must still run it"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), width=st.sampled_from([8, 64, 576]), scale=st.floats(1e-3, 1e3),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
def test_fused_rms_norm_is_bit_identical_to_transformers_in_float32(rows, width, scale, eps, seed):
    g = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(width, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g))
    x = torch.randn(rows, width, generator=g) * scale
    assert torch.equal(_rms_norm(x, norm.weight, eps), norm(x))
    assert torch.equal(_rms_norm(x.bfloat16(), norm.weight.bfloat16(), eps), norm.bfloat16()(x.bfloat16()))


def test_models_that_cannot_be_fused_say_why_and_still_run_unfused(tokenizer):
    model = _gpt2()
    assert "GPT2LMHeadModel is not one of" in fused_decoder_refusal(model)
    with pytest.raises(ConfigError, match="fused_decoder: GPT2LMHeadModel is not one of"):
        LLM(model, tokenizer, device="cpu", fused_decoder=True)
    llm = LLM(model, tokenizer, device="cpu")
    assert llm.engine.model.runner.fused is None
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
               .token_ids) == 3
    odd_norms = tiny_model("llama")
    odd_norms.model.layers[0].self_attn.q_norm = torch.nn.Identity()
    assert fused_decoder_refusal(odd_norms) == ("decoder layers differ from the Llama block (query/key norms other "
                                                "than Qwen3's RMSNorms)")


def test_model_objects_passed_in_keep_their_weights_unless_asked(llama, tokenizer):
    weight = llama.model.layers[0].self_attn.q_proj.weight
    llm = LLM(llama, tokenizer, device="cpu")
    assert llm.engine.model.runner.fused is None
    assert llama.model.layers[0].self_attn.q_proj.weight is weight and weight.is_contiguous()


def test_speculative_verification_and_draft_model_run_fused_and_match_plain_greedy(llama, tokenizer):
    target, draft = copy.deepcopy(llama), tiny_model("qwen2", seed=3)
    llm = LLM(target, tokenizer, draft=draft, kv_cache_memory="16MiB", block_size=4, fused_decoder=True)
    prompts = [(p * 4)[:30] for p in random_prompts(6, 4, 9, seed=2)]
    outs = {}
    for proposer in ("ngram", "draft"):
        outs[proposer] = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, strategy={
            "speculative": {"proposer": proposer, "num_speculative_tokens": 4}}))
        assert sum(o.metrics.num_draft_tokens for o in outs[proposer]) > 0
    for prompt, a, b in zip(prompts, outs["ngram"], outs["draft"]):
        assert a.token_ids == b.token_ids == hf_greedy(llama, prompt, 20)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_beam_search_forks_run_fused_and_match_hf_beams(llama, tokenizer):
    llm = LLM(copy.deepcopy(llama), tokenizer, kv_cache_memory="16MiB", block_size=4, fused_decoder=True)
    prompts = random_prompts(3, 3, 20, seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, strategy={
        "beam_search": {"num_beams": 3, "num_return_sequences": 2}}))
    for prompt, out in zip(prompts, outs):
        ref = llama.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, num_beams=3,
                             num_return_sequences=2, pad_token_id=0)
        want = [row[: row.index(2) + 1] if 2 in row else row for row in ref[:, len(prompt):].tolist()]
        assert [o.token_ids for o in out.outputs] == want


@pytest.mark.parametrize("prepack", [False, True], ids=["blas-only", "prepacked"])
def test_prepacked_and_blas_weights_give_hf_greedy_tokens_at_every_row_count(model, tokenizer, prepack):
    # 12 prompts with a 40-token budget: steps of 1 to 40 rows, so both weight forms serve some products.
    llm = LLM(copy.deepcopy(model), tokenizer, device="cpu", fused_decoder=True, prepack_weights=prepack,
              max_num_batched_tokens=40, block_size=8)
    assert llm.engine.model.runner.fused.prepacked is prepack
    prompts = random_prompts(12, 3, 50, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 24)


def test_prepacking_is_refused_where_onednn_cannot_serve_it(llama, tokenizer):
    llm = LLM(copy.deepcopy(llama), tokenizer, device="cpu", dtype="bfloat16", fused_decoder=True,
              prepack_weights=True, native_kernels=False)  # torch's bf16 path (not the native bf16 weights)
    assert llm.engine.model.runner.fused.prepacked is False  # bf16 products stay on BLAS
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
               .token_ids) == 4


@pytest.mark.parametrize("quantization", [None, "bf16", "int8"])
def test_steps_of_mid_prompt_chunks_alone_ask_no_logits_and_run_on_the_native_kernels(quantization, tokenizer):
    """A 100-token prompt alone under a 32-token budget: its first steps score nothing (zero rows reach the LM
    head), which the single-row kernels must pass over, not fail the request."""
    model = tiny_model("llama")
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=32,
              fused_decoder=True, quantization=quantization)
    assert llm.engine.model.runner.fused is not None and llm.engine.model.runner.fused.native is not None
    prompt = random_prompts(1, 100, 101, seed=4)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=1))[0]
    assert out.error is None and len(out.token_ids) == 8
    if quantization is None:
        assert out.token_ids == hf_greedy(model, prompt, 8)


@pytest.mark.parametrize("options", [{}, {"native_kernels": False}, {"quantization": "bf16"}],
                         ids=["native kernels", "torch ops", "bf16 weights"])
def test_qwen3_runs_fused_with_its_query_and_key_norms_and_equals_transformers(options, tokenizer):
    """Qwen3 is the Llama block plus an RMSNorm over each query and key head before RoPE; the fused decoder applies
    them on every path. Batch 6 with chunked prefill beside decoding sequences."""
    model = tiny_model("qwen3")
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=32,
              fused_decoder=True, **options)
    fused = llm.engine.model.runner.fused
    assert fused is not None and all(layer.q_norm is not None for layer in fused.layers)
    if options.get("quantization"):  # bf16 weights: the reference is the same model with bf16-rounded weights
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(module.weight.bfloat16().float())
    prompts = random_prompts(6, 3, 60, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 16) for p in prompts]


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
], ids=["default", "llama3", "yarn", "dynamic"])
def test_rope_tables_cached_by_position_give_transformers_tokens_and_dynamic_ropes_are_not_cached(rope, tokenizer):
    """Static RoPE types are served from tables computed once per position (grown as contexts pass 1,024); a
    dynamic one, whose frequencies rescale with the longest position seen, is computed each step as transformers
    does. Prompts past 64 positions cross the llama3/yarn original context; greedy tokens equal transformers'."""
    model = tiny_model("llama", rope_parameters=rope, max_position_embeddings=2048)
    llm = LLM(copy.deepcopy(model), tokenizer, kv_cache_memory="16MiB", block_size=8, fused_decoder=True)
    fused = llm.engine.model.runner.fused
    assert fused._rope_static is (rope["rope_type"] != "dynamic")
    prompts = [*random_prompts(3, 60, 120, seed=9), random_prompts(1, 1030, 1031, seed=3)[0]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    assert fused._rope_positions == (2048 if fused._rope_static else 0)
