"""Models the fused decoder cannot take (StarCoder2, OPT, ...) have their own linear layers re-laid and multiplied on
the native kernels when decodekit loads them: same values, same tokens as transformers, any step size; a model
object passed in is left alone unless `native_kernels: true` asks."""

from __future__ import annotations

import copy

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.models.tiny import tiny_tokenizer
from tests.helpers.reference import hf_greedy, random_prompts
from tests.helpers.unfused_models import UNFUSED_ARCHS, save_unfused, unfused_model


@pytest.fixture(scope="module", params=list(UNFUSED_ARCHS))
def saved(request, tmp_path_factory):
    """(folder, the model as saved): a model decodekit loads from a folder is its own to re-lay."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_unfused(request.param, folder)


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
    model = llm.engine.model.runner.model
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    assert (head.weight is embeddings.weight) == bool(model.config.tie_word_embeddings)
    prompt = random_prompts(1, 5, 20, seed=1)[0]
    assert hf_greedy(model, prompt, 8) == hf_greedy(reference, prompt, 8), "transformers must still run it"


def test_a_model_object_is_left_alone_unless_native_kernels_is_true(tokenizer):
    model = unfused_model("opt")
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
        LLM(unfused_model("opt").half(), tokenizer, kv_cache_memory="4MiB", native_kernels=True)


def test_a_draft_model_decodekit_loads_gets_re_laid_linears_and_speculation_stays_lossless(tmp_path):
    folders = {}
    for arch in UNFUSED_ARCHS:
        folders[arch] = tmp_path / arch
        unfused_model(arch).save_pretrained(folders[arch])
        tiny_tokenizer().save_pretrained(folders[arch])
    llm = LLM(str(folders["starcoder2"]), draft=str(folders["opt"]), dtype="float32", kv_cache_memory="16MiB",
              block_size=4)
    prompts = random_prompts(3, 5, 30, seed=6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, strategy={
        "speculative": {"proposer": "draft", "num_speculative_tokens": 3}}))
    draft = llm.engine.components.get("proposers", "draft").model  # built at first use
    assert "linear layers re-laid" in draft.forward_name
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    reference = unfused_model("starcoder2")
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]
