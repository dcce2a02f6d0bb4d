"""GGUF block copies of a float model (`quantization: q4_0 | q4_1 | q8_0`): each weight is within half a quantization
step, weights already on a Q4_1 grid come back as the same blocks (so `q4_1` of a Q4_1 GGUF's dequantized model is the
file), a block-quantized target generates what transformers generates on the model dequantized from those blocks, a
4-bit self-draft speculates losslessly (greedy and sampled), and asking where it cannot run is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.execution.fused.block_copies import BLOCK_WIDTH, HEAD_FORMATS, quantize_blocks
from decodekit.execution.fused.stored_matrices import BLOCK_FORMATS, GgufMatrix
from decodekit.execution.fused.weight_matrices import Matrix
from decodekit.execution.kernels.native import load_kernels
from decodekit.execution.kernels.quant import fixed_point_formats
from decodekit.models.tiny import tiny_model
from tests.helpers.gguf_blocks import gguf_dequantize
from tests.helpers.reference import hf_greedy, random_prompts
from tests.helpers.unfused_models import as_quantized, block_round_trip

kernels = load_kernels()
pytestmark = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")


def scaled_quants(data: np.ndarray, fmt: str, rows: int, blocks: int, weights: torch.Tensor) -> torch.Tensor:
    """Each weight's d q (the quant times its block's scale): Q4_0's w + 8d, Q4_1's w - m, Q8_0's w itself."""
    if fmt == "Q8_0":
        return weights
    raw = np.ascontiguousarray(data.reshape(rows, blocks, -1))
    half = lambda at: torch.from_numpy(np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)  # noqa: E731
                                       .astype(np.float32))
    offset = 8 * half(0) if fmt == "Q4_0" else -half(2)  # [rows, blocks, 1]
    return (weights.view(rows, blocks, BLOCK_WIDTH) + offset).view(rows, blocks * BLOCK_WIDTH)


@settings(max_examples=40, deadline=None)
@example(fmt="Q4_0", rows=7, blocks=1, scale=1.0, seed=660)  # a Q4_0 block whose d q outweighed its w (CI, Zen 5)
@given(fmt=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), rows=st.integers(1, 9), blocks=st.integers(1, 4),
       scale=st.floats(1e-3, 1e2), seed=st.integers(0, 2**16))
def test_each_copied_weight_is_within_half_a_step_of_the_float_weight(fmt, rows, blocks, scale, seed):
    """Per block of 32: Q4_0 and Q8_0 step `max|w| / 8` and `max|w| / 127`, Q4_1 `(max - min) / 15`, fp16-rounded
    (Q4_0's quants run -8..7, so weights of the sign opposite the block's extreme beyond 7 steps are clamped there);
    the native product multiplies the dequantized weights (gguf-py's)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, blocks * BLOCK_WIDTH, generator=g) * scale
    stored = quantize_blocks(weight, fmt)
    got = gguf_dequantize(stored.data.numpy(), fmt, weight.shape[1])
    grouped, back = weight.view(rows, blocks, BLOCK_WIDTH), got.view(rows, blocks, BLOCK_WIDTH)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    step = {"Q4_0": amax / 8, "Q8_0": amax / 127,
            "Q4_1": (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / 15}[fmt]
    # beyond half a step: the fp16 rounding of the step (relative 2^-11, or 2^-25 absolute where it is subnormal)
    # times the largest quant, and of Q4_1's minimum (at most the block's largest magnitude times 2^-11)
    slack = {"Q4_0": 8, "Q4_1": 15, "Q8_0": 127}[fmt] * (step * 2**-11 + 2**-25) + amax * 2**-11
    allowed = step / 2
    if fmt == "Q4_0":  # quants -8..7 times a step of the extreme's sign: the other end clamps at 7 steps
        allowed = torch.maximum(allowed, grouped.abs() - 7 * step)
    assert bool(((back - grouped).abs() <= allowed + slack).all())
    matrix = GgufMatrix([stored], None, kernels)
    x = torch.randn(3, weight.shape[1], generator=g)
    want = x @ got.T
    slack = torch.zeros_like(want)
    if fmt in fixed_point_formats(matrix.isa):
        # AVX2's Q4_0, Q4_1 and Q8_0 products (AVX-512's Q4_0 and Q4_1) round each activation to 16-bit fixed point
        # per block of 32: half a step of its block's largest |value| / 32767 at most, times what multiplies it in
        # integers: the weight (Q8_0), or its scaled quant d q (Q4_0's w + 8d, Q4_1's w - m: the offset's term takes
        # the float sum of the activations themselves, unrounded)
        largest = x.abs().view(3, blocks, BLOCK_WIDTH).amax(dim=-1).repeat_interleave(BLOCK_WIDTH, dim=1)
        slack = (largest / 65534 * 1.001) @ scaled_quants(stored.data.numpy(), fmt, rows, blocks, got).abs().T
    assert bool(((matrix(x) - want).abs() <= 1e-4 * want.abs() + 1e-4 * scale + slack).all())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_weights_already_on_a_q4_1_grid_come_back_as_the_same_blocks(rows, blocks, seed):
    """Dequantized Q4_1 blocks whose quants span 0..15 (as llama.cpp's quantizer writes them: each block's minimum
    and maximum are quants 0 and 15) quantize back to the same bytes: `q4_1` of a Q4_1 file's float32 model is the
    file's own weights."""
    rng = np.random.default_rng(seed)
    quants = rng.integers(0, 16, size=(rows, blocks, BLOCK_WIDTH))
    quants[..., 0], quants[..., 1] = 0, 15
    d = rng.uniform(0.001, 0.05, size=(rows, blocks)).astype(np.float16)
    m = (-d.astype(np.float32) * rng.uniform(0, 15, size=(rows, blocks))).astype(np.float16)
    packed = (quants[..., :16] | (quants[..., 16:] << 4)).astype(np.uint8)
    original = np.concatenate([d[..., None].view(np.uint8).reshape(rows, blocks, 2),
                               m[..., None].view(np.uint8).reshape(rows, blocks, 2), packed], axis=-1)
    original = original.reshape(rows, -1)
    float_weight = gguf_dequantize(original, "Q4_1", blocks * BLOCK_WIDTH)
    assert np.array_equal(quantize_blocks(float_weight, "Q4_1").data.numpy(), original)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", list(BLOCK_FORMATS))
def test_a_block_quantized_target_generates_what_transformers_generates_on_the_dequantized_model(
        arch, quantization, tokenizer):
    """Batch 6, chunked prefill (1-8 rows and more), the LM head in Q8_0 under 4-bit."""
    model = tiny_model(arch)
    reference = as_quantized(model, quantization)
    llm = LLM(model, tokenizer, quantization=quantization, kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=32)
    assert llm.engine.model.forward_name == f"fused ({quantization} weights)"
    fused = llm.engine.model.runner.fused
    assert isinstance(fused.lm_head, GgufMatrix) and fused.lm_head.file_formats == (HEAD_FORMATS[quantization],)
    assert fused.layers[0].down.file_formats == (BLOCK_FORMATS[quantization],)
    prompts = random_prompts(6, 3, 40, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]


def test_a_weight_whose_width_does_not_divide_into_blocks_keeps_a_float32_product(tokenizer):
    """Hidden size 48: every product reads 48-wide rows except the down projection (128 wide), so only it is
    quantized; the tokens are transformers' on that model."""
    model = tiny_model("llama", hidden_size=48)
    llm = LLM(model, tokenizer, quantization="q8_0", kv_cache_memory="16MiB", block_size=4)
    fused = llm.engine.model.runner.fused
    assert isinstance(fused.layers[0].qkv, Matrix) and isinstance(fused.lm_head, Matrix)
    assert isinstance(fused.layers[0].down, GgufMatrix)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % BLOCK_WIDTH == 0:
                module.weight.copy_(block_round_trip(module.weight, "q8_0"))
    prompts = random_prompts(3, 3, 20, seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 10) for p in prompts]


def _spec(k: int, **sampling) -> SamplingParams:
    return SamplingParams(strategy={"speculative": {"proposer": "draft", "num_speculative_tokens": k}}, **sampling)


@pytest.mark.parametrize("batch", [1, 5])
def test_a_q4_1_self_draft_gives_the_float_targets_greedy_output(batch, tokenizer):
    model = tiny_model("llama")
    llm = LLM(model, tokenizer, draft="target", draft_quantization="q4_1", kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(batch, 3, 30, seed=batch)
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _spec(4, max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.token_ids for o in plain] == [hf_greedy(model, p, 20) for p in prompts]
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in spec) > drafted // 3
    proposer = llm.engine.components.get("proposers", "draft")
    assert proposer.model.forward_name == "fused (q4_1 weights)" and "q4_1" not in llm.engine.model.forward_name


def test_block_quantizations_are_refused_where_they_cannot_run_with_the_option_named(tokenizer):
    with pytest.raises(ConfigError, match=r"quantization 'q4_1' multiplies on the native kernels"):
        LLM(tiny_model("llama"), tokenizer, quantization="q4_1", native_kernels=False, kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match=r"(?s)quantization.*'q4_0', 'q4_1' or 'q8_0'"):
        LLM(tiny_model("llama"), tokenizer, quantization="q4_k", kv_cache_memory="16MiB")
