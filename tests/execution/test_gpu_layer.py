"""The GPU path's five-launch layer (`gpu_layer`) against the torch ops and kernels it replaces.

Runs on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1 pytest -m cuda`); skipped where Triton is
not installed (the CPU CI). float32 must match to rounding; bf16 (on a GPU only: the interpreter rounds to bf16
otherwise than torch) may differ by one bf16 step in at most 1% of the elements, as the products add in another
order than cuBLAS; bf16 attention is held to the exact attention at least as closely as bf16 SDPA is.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from decodekit import LLM, SamplingParams
from decodekit.execution.attention.gpu import TokenTable, attend_tokens_reference, attention_parts
from decodekit.execution.cuda_graphs import DecodeGraphs
from decodekit.execution.fused.decoder import _rms_norm, _silu_gate
from decodekit.execution.kernels import gpu_layer, gpu_ops
from decodekit.models.tiny import tiny_model
from tests.helpers.gpu_kernels import DEVICE, DTYPES, assert_rounds_like
from tests.helpers.reference import random_prompts

pytestmark = pytest.mark.cuda


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_rounds_like(got, want, float32_tolerance=2e-5)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_normed_product_equals_rms_norm_then_the_product(dtype, rows):
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    hidden = _randn(gen, rows, 96, dtype=dtype, scale=3)
    norm_weight = _randn(gen, 96, dtype=dtype)
    weight = _randn(gen, 40, 96, dtype=dtype, scale=0.2)
    bias = _randn(gen, 40, dtype=dtype)
    normed = _rms_norm(hidden, norm_weight, 1e-5)
    _close(gpu_layer.linear(hidden, weight, norm_weight=norm_weight, eps=1e-5), normed @ weight.T)
    _close(gpu_layer.linear(hidden, weight, bias, norm_weight=norm_weight, eps=1e-5),
           torch.addmm(bias, normed, weight.T))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_gated_product_equals_the_gate_up_product_then_silu_gating(dtype, rows):
    gen = torch.Generator(device=DEVICE).manual_seed(10 + rows)
    hidden = _randn(gen, rows, 64, dtype=dtype, scale=2)
    norm_weight = _randn(gen, 64, dtype=dtype)
    gate_up = _randn(gen, 2 * 72, 64, dtype=dtype, scale=0.3)  # 72 columns: the last program is partly masked
    normed = _rms_norm(hidden, norm_weight, 1e-6)
    want = _silu_gate(normed @ gate_up.T, 72)
    _close(gpu_layer.linear(hidden, gate_up, norm_weight=norm_weight, eps=1e-6, gated=True), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_residual_product_adds_into_the_residual_in_place(dtype, rows):
    gen = torch.Generator(device=DEVICE).manual_seed(20 + rows)
    x = _randn(gen, rows, 200, dtype=dtype)  # 200: not a multiple of the K tile
    weight = _randn(gen, 48, 200, dtype=dtype, scale=0.1)
    residual = _randn(gen, rows, 48, dtype=dtype)
    want = residual + x @ weight.T
    out = gpu_layer.linear(x, weight, residual=residual)
    assert out.data_ptr() == residual.data_ptr()
    _close(residual, want)


def test_more_rows_than_the_fused_product_takes_are_refused():
    x = torch.zeros(gpu_layer.FUSED_MAX_ROWS + 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        gpu_layer.linear(x, torch.zeros(16, 16, device=DEVICE))


def _decode_step(dtype: torch.dtype, contexts: list[int], parts: int, seed: int):
    """A decode step's inputs: one token per sequence (a context of 0 keys is a padding row), a random pool."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_heads, kv_heads, dim, block_size = 6, 2, 16, 4
    blocks = sum(-(-(c + 1) // block_size) for c in contexts) + 2
    key_slots = _randn(gen, blocks * block_size, kv_heads, dim, dtype=dtype)
    value_slots = _randn(gen, blocks * block_size, kv_heads, dim, dtype=dtype)
    order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, slots, limits, start = [], [], [], 0
    width = max(-(-(c + 1) // block_size) for c in contexts)
    for ctx in contexts:
        need = -(-(ctx + 1) // block_size)
        table = order[start:start + need]
        start += need
        tables.append((table + [0] * width)[:width])
        real = ctx > 0
        slots.append(table[ctx // block_size] * block_size + ctx % block_size if real else blocks * block_size - 1)
        limits.append(ctx + 1 if real else 0)
    tokens = len(contexts)
    table = TokenTable(torch.arange(tokens, device=DEVICE), torch.tensor(limits, device=DEVICE),
                       torch.tensor(tables, device=DEVICE), single_query=True, parts=parts)
    qkv = _randn(gen, tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen, device=DEVICE) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    return (qkv, cos, sin, q_heads, kv_heads, key_slots, value_slots, torch.tensor(slots, device=DEVICE), table,
            block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_rope_attend_equals_rope_write_then_the_paged_attention(dtype, parts):
    # contexts from one key to several loop blocks, and a padding row; split over parts (flash-decoding)
    contexts = [0, 5, 40, 170, 0, 3]
    qkv, cos, sin, q_heads, kv_heads, keys, values, slots, table, block_size = _decode_step(dtype, contexts, parts, 7)
    want_keys, want_values = keys.clone(), values.clone()
    query = gpu_ops.rope_write(qkv, cos, sin, q_heads, kv_heads, want_keys, want_values, slots)
    want = attend_tokens_reference(table, query, want_keys, want_values, block_size, 0.25)
    got = gpu_layer.rope_attend(qkv, cos, sin, q_heads, kv_heads, keys, values, slots, table, block_size, 0.25)
    real = torch.tensor([c > 0 for c in contexts], device=DEVICE)
    assert torch.equal(keys[slots[real]], want_keys[slots[real]])  # the new keys and values written, rotated
    assert torch.equal(values[slots[real]], want_values[slots[real]])
    if dtype == torch.float32:
        _close(got.view_as(want), want)
    else:  # bf16 SDPA rounds the probabilities before their product with the values, the kernel does not: both
        # against the exact attention of the same (rounded) query, keys and values, as test_cuda_path checks the
        # paged-attention kernel
        exact = attend_tokens_reference(table, query.double(), want_keys.double(), want_values.double(), block_size,
                                         0.25)
        kernel_error = (got.view_as(want).double() - exact).norm() / exact.norm()
        sdpa_error = (want.double() - exact).norm() / exact.norm()
        assert kernel_error <= max(1.25 * sdpa_error, 4e-3), (kernel_error, sdpa_error)
    assert not got.view_as(want)[~real].any()  # padding attends to nothing


def test_attention_parts_split_only_long_contexts_of_few_programs():
    cpu = torch.device("cpu")  # 8 programs stand for the multiprocessors
    assert attention_parts(1, 1, 100, cpu) == 1  # short: one part
    assert attention_parts(1, 1, 4096, cpu) == 8  # one token and head: split to fill the programs
    assert attention_parts(8, 1, 4096, cpu) == 1  # the tokens fill them already
    assert attention_parts(1, 2, 600, cpu) == 4  # as many as fill the programs
    assert attention_parts(1, 1, 128, cpu) == 1  # two loop iterations: not worth the merge launch
    assert attention_parts(1, 1, 256, cpu) == 4  # a loop iteration (64 keys) a part


def _engines(tokenizer) -> tuple[LLM, LLM]:
    """Two engines on the tiny Llama: the torch forward, and the GPU decode path on the CPU (the five-launch layer
    through the interpreter, the CUDA graphs' static buffers run eagerly)."""
    plain = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4)
    gpu = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4)
    runner = gpu.engine.model.runner
    assert runner.fused is not None
    runner.fused.gpu_ops = True
    runner.fused.gpu_layer_rows = gpu_layer.FUSED_MAX_ROWS
    runner.graphs = DecodeGraphs(runner.fused, gpu.engine.kv_cache, 8, gpu.engine.max_model_len, capture=False)
    return plain, gpu


def test_engine_on_the_five_launch_layer_gives_the_tokens_of_the_eager_path(tokenizer):
    # the whole GPU decode path (graphs' static buffers, token table, the five launches, a long context split over
    # parts) on the CPU through the interpreter, against the torch forward
    plain, gpu = _engines(tokenizer)
    runner = gpu.engine.model.runner
    prompts = [(p * 40)[:n] for p, n in zip(random_prompts(3, 3, 30, seed=5), (12, 300, 40))]
    params = SamplingParams(temperature=0, max_tokens=10)
    for batch in (prompts, prompts[1:2]):  # alone, the long prompt's keys are split
        expected = [out.outputs[0].token_ids for out in plain.generate(batch, params)]
        assert [out.outputs[0].token_ids for out in gpu.generate(batch, params)] == expected
    graphs = runner.graphs
    assert {key[-1] for key in [*graphs._graphs, *graphs._runs]} >= {1, 4}  # attention parts of steps and runs
    assert gpu.engine.decode_run_tokens > 0


def test_a_five_launch_kernel_failing_on_first_use_falls_back_to_one_launch_per_op(tokenizer, monkeypatch, caplog):
    # a kernel this GPU or Triton cannot compile turns the five-launch layer off instead of failing every step
    plain, gpu = _engines(tokenizer)
    runner = gpu.engine.model.runner

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(gpu_layer, "rope_attend", broken)
    prompts = random_prompts(3, 3, 30, seed=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, params)]
    outs = gpu.generate(prompts, params)
    assert [out.outputs[0].token_ids for out in outs] == expected and all(out.error is None for out in outs)
    assert runner.fused.gpu_layer_rows == 0 and "five-launch GPU layer failed" in caplog.text
