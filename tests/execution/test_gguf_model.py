"""A GGUF model runs its quantized weights as stored: under dtype auto on a CPU the loader keeps the file's blocks
and the plan multiplies them (`quantization: gguf`), giving the dequantized float32 model's logits, hidden states
and greedy tokens up to summation order; dtype float32 keeps the dequantized path; asking for `gguf` where it cannot
run is refused naming the option. The bundled SmolLM2 (Q4_1 with a Q8_0 embedding) is checked the same way (slow)."""

from __future__ import annotations

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.execution.fused.stored_matrices import GgufMatrix
from decodekit.execution.kernels.native import load_kernels
from decodekit.execution.kernels.quant import rounds_activations
from decodekit.execution.runner import ForwardItem
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.helpers.gguf_blocks import TINY_GGUF, TinyGgufLoader
from tests.helpers.reference import random_prompts

kernels = load_kernels()
needs_kernels = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")


def _llm(**options) -> LLM:
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(TinyGgufLoader(), "tiny-gguf")
    return LLM(TINY_GGUF, plugin_manager=pm, **options)


def _last(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last position's logits and hidden state (the final norm's output) of one forward over `prompt`."""
    engine = llm.engine
    engine.allocator.allocate(0, [])
    engine.allocator.ensure_slots(0, 0, len(prompt))
    logits, hidden = engine.model.runner.forward_with_hidden(
        [ForwardItem(prompt, 0, engine.allocator.block_table(0), 1, 1)], [])
    engine.allocator.free(0)
    assert hidden is not None
    return logits[0], hidden[0]


@pytest.fixture(scope="module")
def stored_and_dequantized():
    return _llm(), _llm(dtype="float32")


@needs_kernels
def test_dtype_auto_runs_the_stored_blocks_and_float32_the_dequantized_model(stored_and_dequantized):
    stored, dequantized = stored_and_dequantized
    assert stored.engine.plan.quantization == "gguf"
    assert stored.engine.plan.stored_formats == {"Q4_0": 2, "Q4_1": 4, "Q4_K": 4, "Q6_K": 2, "Q8_0": 3}
    assert "GGUF weights as stored" in stored.engine.plan.describe()
    assert any("multiplied as stored" in reason for reason in stored.engine.plan.reasons)
    assert stored.engine.plan.compute_dtype == torch.float32 == stored.engine.plan.kv_dtype
    layer = stored.engine.model.runner.fused.layers[0]
    # the AVX2 path's fixed-point products take Q4_0 and Q4_1 rows grouped (`laid_out_for`): the same blocks
    grouped = rounds_activations(layer.qkv.isa)
    assert isinstance(layer.qkv, GgufMatrix)
    assert layer.qkv.formats == (("Q4_0g", "Q4_1g", "Q8_0") if grouped else ("Q4_0", "Q4_1", "Q8_0"))
    assert dequantized.engine.plan.quantization is None and not dequantized.engine.plan.stored_formats


@needs_kernels
@pytest.mark.parametrize("length", [1, 5, 40])  # decode-sized rows (native), and a prefill past the native rows
def test_logits_and_hidden_states_are_the_dequantized_models_up_to_summation_order(stored_and_dequantized, length):
    stored, dequantized = stored_and_dequantized
    prompt = random_prompts(1, length, length + 1, seed=length)[0]
    logits, hidden = _last(stored, prompt)
    want_logits, want_hidden = _last(dequantized, prompt)
    # AVX2's Q4_0, Q4_1 and Q8_0 products (AVX-512's Q4_0 and Q4_1) round each activation to 16-bit fixed point per
    # block of 32 (2^-16 of the block's largest value): through 2 layers of random weights that moves a hidden value
    # by ~1e-4
    fixed_point = 5 if rounds_activations(stored.engine.model.runner.fused.layers[0].qkv.isa) else 1
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4 * fixed_point)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-3 * fixed_point)


@needs_kernels
def test_greedy_tokens_equal_the_dequantized_models_batched_and_alone(stored_and_dequantized):
    stored, dequantized = stored_and_dequantized
    prompts = random_prompts(6, 3, 40, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0)
    want = [o.token_ids for o in dequantized.generate(prompts, params)]
    assert [o.token_ids for o in stored.generate(prompts, params)] == want
    assert stored.generate(prompts[2], params)[0].token_ids == want[2]


@needs_kernels
def test_asking_for_gguf_without_stored_weights_or_where_it_cannot_run_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match=r"quantization 'gguf': .* brings no GGUF quantized weights"):
        LLM(tiny_model(), tiny_tokenizer(), quantization="gguf")
    with pytest.raises(ConfigError, match="quantization 'gguf'"):
        _llm(quantization="gguf", fused_decoder=False)


@needs_kernels
@pytest.mark.parametrize("length", [1, 5])
def test_float32_activations_give_the_dequantized_models_hidden_states_within_float_summation_order(
        stored_and_dequantized, monkeypatch, length):
    """DECODEKIT_GGUF_ACTIVATIONS=float32: no product rounds its activations (the AVX2 path's Q4_0, Q4_1, Q8_0 would
    by default), through the native layer stack too, so the tight float32 tolerance holds on every path."""
    monkeypatch.setenv("DECODEKIT_GGUF_ACTIVATIONS", "float32")
    exact = _llm()
    assert exact.engine.model.runner.fused.layers[0].qkv.float_activations
    assert not any("16-bit fixed point" in reason for reason in exact.engine.plan.reasons)
    _, dequantized = stored_and_dequantized
    prompt = random_prompts(1, length, length + 1, seed=length)[0]
    logits, hidden = _last(exact, prompt)
    want_logits, want_hidden = _last(dequantized, prompt)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-3)


@needs_kernels
def test_a_bad_activations_variable_is_refused_when_the_engine_is_built_naming_the_choices(monkeypatch):
    monkeypatch.setenv("DECODEKIT_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ConfigError, match=r"DECODEKIT_GGUF_ACTIVATIONS='int4': the choices are fixed16, float32"):
        _llm()


@needs_kernels
def test_a_bad_code_path_variable_is_refused_when_the_engine_is_built(monkeypatch):
    monkeypatch.setenv("DECODEKIT_QUANT_ISA", "avx1024")
    with pytest.raises(ConfigError, match="DECODEKIT_QUANT_ISA='avx1024'"):
        _llm()


@needs_kernels
@pytest.mark.skipif(isinstance(kernels, str) or "avx2" not in kernels.quant.available, reason="no AVX2 path here")
def test_interleaved_q4_1_weights_give_the_dequantized_models_greedy_tokens_batched_and_alone(
        stored_and_dequantized, monkeypatch):
    """DECODEKIT_GGUF_INTERLEAVE=on on the AVX2 path: the tiny model's Q4_1 weights are multiplied interleaved by 8
    rows (`Q4_1x8`), with the dequantized model's hidden states up to summation order and its greedy tokens, a
    prompt alone as in a batch."""
    monkeypatch.setenv("DECODEKIT_GGUF_INTERLEAVE", "on")
    monkeypatch.setenv("DECODEKIT_QUANT_ISA", "avx2")
    interleaved = _llm()
    _, dequantized = stored_and_dequantized
    layer = interleaved.engine.model.runner.fused.layers[0]
    assert layer.qkv.formats == ("Q4_0g", "Q4_1x8", "Q8_0")
    prompts = random_prompts(6, 3, 40, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0)
    want = [o.token_ids for o in dequantized.generate(prompts, params)]
    assert [o.token_ids for o in interleaved.generate(prompts, params)] == want
    assert interleaved.generate(prompts[2], params)[0].token_ids == want[2]
    prompt = random_prompts(1, 5, 6, seed=5)[0]
    _, hidden = _last(interleaved, prompt)
    # its Q4_0 and Q8_0 parts round the activations to 16-bit fixed point per block (AVX2): up to ~1e-4 here
    torch.testing.assert_close(hidden, _last(dequantized, prompt)[1], rtol=1e-4, atol=5e-4)


@pytest.mark.slow
@needs_kernels
def test_the_bundled_model_runs_its_q4_1_blocks_with_the_dequantized_models_greedy_tokens():
    """The bundled SmolLM2 (210 Q4_1 weights, a Q8_0 embedding tied to the LM head) loads as stored by default.
    Agreement with the float32 dequantized model: every greedy token of 8 prompts x 32 tokens (hidden states within
    1e-3 of each other's with float32 activations, 1.5e-2 where AVX2 rounds them to 16-bit fixed point)."""
    stored, dequantized = LLM(), LLM(dtype="float32")
    assert stored.engine.plan.stored_formats == {"Q4_1": 210, "Q8_0": 1}
    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(6)]
    prompts += ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=32, temperature=0)
    got = [o.token_ids for o in stored.generate(prompts, params)]
    want = [o.token_ids for o in dequantized.generate(prompts, params)]
    assert got == want
    ids = stored.tokenizer("The capital of France is")["input_ids"]
    logits, hidden = _last(stored, ids)
    want_logits, want_hidden = _last(dequantized, ids)
    # AVX2's and AVX-512's products round the activations to 16-bit fixed point per block of 32: SmolLM2's outlier
    # channels (a block's largest value ~100x its others) leave those blocks' other values ~8 bits, so a hidden value
    # moves by up to ~7e-3 here (6.6e-3 measured on a Zen 3), against 1e-3 with float32 activations
    fixed_point = rounds_activations(stored.engine.model.runner.fused.layers[0].qkv.isa)
    tolerance = 1.5e-2 if fixed_point else 1e-3
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-3, atol=tolerance)
    assert int(logits.argmax()) == int(want_logits.argmax())
