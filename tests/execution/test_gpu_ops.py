"""The GPU path's Triton kernels against the torch ops they replace.

They run on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`); skipped where Triton is not
installed (the CPU CI). bfloat16 is checked on a GPU only. In float32 they must match to rounding; in bfloat16 they
round where torch rounds, so at most 1% of the elements may differ, by one bf16 step (the reductions add in
another order).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from decodekit.execution.fused.decoder import _rms_norm, _rotate, _silu_gate
from decodekit.execution.kernels import gpu_ops
from tests.helpers.gpu_kernels import DEVICE, DTYPES
from tests.helpers.gpu_kernels import assert_rounds_like as _close

# marked `cuda`: run with `pytest -m cuda` on a GPU, or `TRITON_INTERPRET=1 pytest -m cuda` on a CPU with Triton
pytestmark = pytest.mark.cuda

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_rounds_like_transformers(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = (torch.randn(7, 576, generator=gen, device=DEVICE) * 3).to(dtype)
    weight = torch.randn(576, generator=gen, device=DEVICE).to(dtype)
    _close(gpu_ops.rms_norm(hidden, weight, 1e-5), _rms_norm(hidden, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_adds_the_residual_in_place_first(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    hidden = torch.randn(4, 2048, generator=gen, device=DEVICE).to(dtype)
    delta = torch.randn(4, 2048, generator=gen, device=DEVICE).to(dtype)
    weight = torch.randn(2048, generator=gen, device=DEVICE).to(dtype)
    summed = hidden + delta
    normed = gpu_ops.rms_norm(hidden, weight, 1e-6, residual=delta)
    assert torch.equal(hidden, summed)
    _close(normed, _rms_norm(summed, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_rotates_queries_and_keys_and_writes_keys_and_values_to_their_slots(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    tokens, q_heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen, device=DEVICE).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen, device=DEVICE) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)  # signed, as `_rotate` takes it
    keys = torch.zeros(40, kv_heads, dim, dtype=dtype, device=DEVICE)
    values = torch.zeros_like(keys)
    slots = torch.tensor([3, 17, 0, 39, 8], device=DEVICE)
    query = gpu_ops.rope_write(qkv, cos, sin, q_heads, kv_heads, keys, values, slots)
    qk, value = qkv.view(tokens, -1, dim).split([q_heads + kv_heads, kv_heads], dim=1)
    want_q, want_k = _rotate(qk, cos[:, None], sin[:, None]).split([q_heads, kv_heads], dim=1)
    _close(query, want_q)
    _close(keys[slots], want_k)
    assert torch.equal(values[slots], value)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not keys[untouched].any() and not values[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel_equals_the_gate_of_the_fused_product(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    gate_up = (torch.randn(3, 2 * 1536, generator=gen, device=DEVICE) * 4).to(dtype)
    _close(gpu_ops.silu_mul(gate_up, 1536), _silu_gate(gate_up, 1536))
