"""What the tests of the GPU path's Triton kernels share (tests/execution/test_gpu_ops.py, test_gpu_layer.py).

They run on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1 pytest -m cuda`).
"""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter does not round float32 to bfloat16 the way torch does, so bf16 is checked on a GPU only.
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="Triton's interpreter rounds to bf16 differently from torch"))]


def assert_rounds_like(got: torch.Tensor, want: torch.Tensor, float32_tolerance: float = 1e-5) -> None:
    """float32: equal to rounding (`float32_tolerance`, relative and absolute); bf16: at most one bf16 step apart,
    in at most 1% of the elements (the kernels round where torch rounds, but add in another order)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=float32_tolerance, atol=float32_tolerance)
        return
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp_min(1e-6) * 2**-7
    assert bool((diff <= ulp * 1.01).all()), float((diff / ulp).max())
    assert float((diff > 0).float().mean()) <= 0.01, f"{float((diff > 0).float().mean()):.2%} of elements differ"
