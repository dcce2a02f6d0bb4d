"""The fused decoder's small ops as single Triton kernels, for the GPU path.

A SmolLM2 decode step on an H100 was ~27 kernel launches per layer, most of them elementwise: transformers'
RMSNorm alone is seven (upcast, square, mean, rsqrt, scale, downcast, weight), RoPE four, and the KV write two.
Each costs 1-3 µs of device time even inside a CUDA graph, against ~3 µs for a layer's matrix product. These
kernels make each op one launch:

- `rms_norm`: transformers' LlamaRMSNorm, rounding as it does (float32 statistics, the normalized row rounded to
  the model dtype before the weight multiply), optionally after the residual add of the product before it (so the
  products need no `addmm` with the residual, which costs a copy of it per product on CUDA);
- `rope_write`: RoPE on the queries and keys of the fused q/k/v product, the rotated queries out, the rotated keys
  and the values written straight to their pool slots;
- `silu_mul`: `silu(gate) * up` from the fused gate/up product.

Products in low precision are rounded to the model dtype at each step torch would round them, so bf16 results
follow the torch ops they replace (the reductions may add in another order).

Each function is only called where `gpu_attention.kernel_available` is true (CUDA with Triton); the CPU path keeps
its torch ops and native kernels. Under Triton's interpreter (`TRITON_INTERPRET=1`) they also run on CPU tensors,
which is how tests/execution/test_gpu_ops.py checks them without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from decodekit.execution.attention.gpu import next_power_of_2 as _next_power_of_2


@functools.cache
def _kernels() -> Any:
    """The three kernels, compiled on first use (None without Triton)."""
    try:
        import triton
        import triton.language as tl

        from decodekit.execution.kernels.triton_layer import round_to  # bf16 rounding as torch rounds
    except ImportError:
        return None

    @triton.jit
    def rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, n, eps,
                        BLOCK: tl.constexpr, ROUND: tl.constexpr, ADD: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if ADD:  # the residual add first, rounded to the model dtype as torch's add rounds, written back in place
            x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
                 ).to(x.dtype)
            tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        normed = x * rstd
        if ROUND:  # transformers rounds to the model dtype before the weight multiply
            normed = round_to(normed, out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_ptr, v_ptr, slots_ptr, stride_qkv, stride_cs,
                          stride_qo, stride_ks, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
                          ROUND: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)  # 0..Q_HEADS-1 queries, then KV_HEADS keys, then KV_HEADS values
        d = tl.arange(0, DIM)
        row = qkv_ptr + token * stride_qkv
        x = tl.load(row + head * DIM + d)
        slot = tl.load(slots_ptr + token)
        if head >= Q_HEADS + KV_HEADS:
            tl.store(v_ptr + slot * stride_ks + (head - Q_HEADS - KV_HEADS) * DIM + d, x)
        else:
            rolled = tl.load(row + head * DIM + (d + DIM // 2) % DIM).to(tl.float32)
            cos = tl.load(cos_ptr + token * stride_cs + d).to(tl.float32)
            sin = tl.load(sin_ptr + token * stride_cs + d).to(tl.float32)
            a = x.to(tl.float32) * cos
            b = rolled * sin
            if ROUND:  # torch rounds each product to the model dtype before the add
                a = round_to(a, x.dtype)
                b = round_to(b, x.dtype)
            out = (a + b).to(x.dtype)
            if head < Q_HEADS:
                tl.store(q_out_ptr + token * stride_qo + head * DIM + d, out)
            else:
                tl.store(k_ptr + slot * stride_ks + (head - Q_HEADS) * DIM + d, out)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n, BLOCK: tl.constexpr, ROUND: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=ok, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        silu = g / (1.0 + tl.exp(-g))
        if ROUND:
            silu = round_to(silu, gate.dtype)
        tl.store(out_ptr + row * stride_o + cols, (silu * up).to(gate.dtype), mask=ok)

    return rms_norm_kernel, rope_write_kernel, silu_mul_kernel


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """LlamaRMSNorm of `[T, hidden]` rows, one launch. With `residual`, first `hidden += residual` in place (the
    residual add of the product before it, which then needs no copy of its own)."""
    out = torch.empty_like(hidden)
    n = hidden.shape[-1]
    delta = hidden if residual is None else residual
    _kernels()[0][(hidden.shape[0],)](hidden, delta, weight, out, hidden.stride(0), delta.stride(0), out.stride(0),
                                      n, eps, BLOCK=_next_power_of_2(n), ROUND=hidden.dtype != torch.float32,
                                      ADD=residual is not None)
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, q_heads: int, kv_heads: int,
               key_slots: torch.Tensor, value_slots: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE on the fused `[T, (q + 2 kv) * D]` product (`cos`/`signed_sin` `[T, D]`, as `fused_decoder._rotate`
    takes them); writes the rotated keys and the values to `slot_mapping`'s pool slots and returns the rotated
    queries `[T, q_heads, D]`, one launch."""
    tokens = qkv.shape[0]
    dim = key_slots.shape[-1]
    query = qkv.new_empty(tokens, q_heads, dim)
    _kernels()[1][(tokens, q_heads + 2 * kv_heads)](
        qkv, cos, signed_sin, query, key_slots, value_slots, slot_mapping, qkv.stride(0), cos.stride(0),
        query.stride(0), key_slots.stride(0), Q_HEADS=q_heads, KV_HEADS=kv_heads, DIM=dim,
        ROUND=qkv.dtype != torch.float32)
    return query


_SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`silu(gate) * up` from the fused `[T, 2 * intermediate]` product, one launch."""
    out = gate_up.new_empty(gate_up.shape[0], intermediate)
    grid = (gate_up.shape[0], -(-intermediate // _SILU_BLOCK))
    _kernels()[2][grid](gate_up, out, gate_up.stride(0), out.stride(0), intermediate, BLOCK=_SILU_BLOCK,
                        ROUND=gate_up.dtype != torch.float32)
    return out
