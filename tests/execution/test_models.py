"""Model loading: local folders, GGUF errors, unknown names, dtype choice, unsupported architectures."""

from __future__ import annotations

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ModelLoadError, UnsupportedModelError
from decodekit.models import load_model, resolve_dtype
from tests.helpers.reference import hf_greedy, random_prompts


def test_local_hf_folder_loads_and_matches_the_in_memory_model(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    prompt = random_prompts(1, 10, 11, seed=21)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == hf_greedy(llama, prompt, 12)


def test_missing_gguf_and_unknown_names_give_clear_errors():
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model("/nonexistent/model.gguf", device="cpu")
    with pytest.raises(ModelLoadError, match=r"no model loader accepts 'not-a-model'.*smollm2-135m-instruct"):
        load_model("not-a-model", device="cpu")


def test_explicit_dtypes_and_bad_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16 and resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    with pytest.raises(ModelLoadError, match="`dtype` must be one of"):
        resolve_dtype("float8", cpu)


def test_a_model_without_the_attention_interface_is_refused_by_name():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="BloomForCausalLM does not route attention"):
        load_model(model, device="cpu")


def test_gpt2_style_absolute_positions_are_exact_too(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                       eos_token_id=2, bos_token_id=1)).eval()
    llm = LLM(model, tokenizer, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=32)
    prompts = random_prompts(6, 3, 60, seed=22)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 16)


def test_a_bf16_engine_on_torchs_path_keeps_its_kv_pool_in_the_model_dtype(llama, tokenizer):
    import copy

    model = copy.deepcopy(llama)
    llm = LLM(model, tokenizer, dtype="bfloat16", device="cpu", native_kernels=False)
    assert llm.engine.kv_cache.pool.dtype is torch.bfloat16 and llm.engine.model.forward_name == "transformers"
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


def test_auto_dtype_is_bfloat16_only_on_a_cpu_with_bf16_dot_products_and_says_why(monkeypatch, caplog):
    """`dtype: auto` on a CPU: bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: faster there on
    every workload measured, vLLM's CPU default), float32 elsewhere (exact, and faster without them); the choice and
    its reason are logged."""
    import logging

    from decodekit.models import loader

    kernels_possible = loader._native_kernels_possible
    monkeypatch.setattr(loader, "_native_kernels_possible", lambda: True)  # a compiler is on PATH
    for native in (False, True):
        monkeypatch.setattr(loader, "cpu_has_bf16_dot_products", lambda native=native: native)
        with caplog.at_level(logging.INFO, logger=loader.log.name):
            caplog.clear()
            chosen = loader.resolve_dtype("auto", torch.device("cpu"))
        assert chosen == (torch.bfloat16 if native else torch.float32)
        assert f"dtype auto -> {'bfloat16' if native else 'float32'} on cpu" in caplog.text
        assert ("this CPU has bf16 dot products" in caplog.text) is native
        assert ("dtype='float32' gives transformers' float32 tokens exactly" in caplog.text) is native
        assert ("dtype='bfloat16'" in caplog.text) is not native
    monkeypatch.setattr(loader, "cpu_has_bf16_dot_products", lambda: True)
    assert loader.resolve_dtype("float32", torch.device("cpu")) == torch.float32  # asked for, it is given
    # without the native kernels a bf16 model would keep transformers' slower bf16 forward: auto stays float32
    monkeypatch.setattr(loader, "_native_kernels_possible", kernels_possible)
    monkeypatch.setenv("DECODEKIT_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger=loader.log.name):
        caplog.clear()
        assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "no C compiler is on PATH (or DECODEKIT_NATIVE_KERNELS=0)" in caplog.text
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # asked for, it is given
