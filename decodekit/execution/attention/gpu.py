"""Paged attention by token table: each packed query token reads its own sequence's keys through the block table.

This is the GPU path's attention (issue 19). The CPU path pads each group of sequences and attends with SDPA over
gathered blocks (`attention.kv_cache`). The GPU path uses a Triton kernel instead. Each program takes one query
token and one KV head: it walks the token's block-table row, reads the keys and values in place from the pool, and
runs an online softmax. Nothing is gathered or padded, and no mask is built. Every input is a tensor of fixed shape
(`TokenTable`), so the same launch can be captured once in a CUDA graph and replayed for any contexts
(`decodekit.execution.cuda_graphs`).

A token with `key_limits[t] == 0` is padding: it attends to nothing and its output is zeros. The graphs' padded rows
rely on this. Long prefill chunks still go through SDPA (`attend_chunks`), which tiles queries; this kernel runs
one query per program, which suits decode, speculative verification and short chunks.

Where Triton is missing, or the tensors are on the CPU, `attend_tokens` falls back to a torch reference. The
reference gathers the keys, so it is slow, but it computes the same function. It is what the kernel is tested
against, and it lets the graph runner's static-buffer logic run on a CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TokenTable:
    """What each packed query token attends to: its sequence's row of `block_tables` and how many keys it sees."""

    token_rows: torch.Tensor  # [T] long: the row of `block_tables` holding this token's sequence
    key_limits: torch.Tensor  # [T] long: keys 0..limit-1 of that sequence (its context and itself); 0 = padding
    block_tables: torch.Tensor  # [B, W] long: block ids, one row per sequence (entries past a sequence's end unused)
    # Every sequence brings one token (a decode step): `gpu_layer.rope_attend` may then write a token's key and read
    # it back in one launch, as no other token of the step attends to it.
    single_query: bool = False
    # Programs sharing each token's keys in `gpu_layer.rope_attend` (`attention_parts`, below)
    parts: int = 1


@functools.cache
def triton_kernel() -> Any:
    """The compiled-on-first-use Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _paged_attention(q_ptr, k_ptr, v_ptr, o_ptr, rows_ptr, limits_ptr, tables_ptr,
                         table_stride, scale, stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                         BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, QROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, ROUND: tl.constexpr):
        # the group's queries padded to QROWS (>= 16) rows, so that the scores and the value sum are `tl.dot`s on
        # the tensor cores (a broadcast sum over [group, keys, dim] cost ~0.12 µs a key on an H200); a narrow
        # dtype's probabilities are rounded to it before the value product, as SDPA and flash attention do
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        limit = tl.load(limits_ptr + token)
        row = tl.load(rows_ptr + token)
        g = tl.arange(0, QROWS)
        d = tl.arange(0, HEAD_PAD)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        dtype = q.dtype
        m = tl.full([QROWS], float("-inf"), tl.float32)
        total = tl.zeros([QROWS], tl.float32)
        acc = tl.zeros([QROWS, HEAD_PAD], tl.float32)
        for start in range(0, limit, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < limit
            block = tl.load(tables_ptr + row * table_stride + n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block * BLOCK_SIZE + n % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=kv_ok, other=0.0)
            if ROUND:
                scores = tl.dot(q, tl.trans(k.to(dtype)))
            else:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            scores = tl.where(n_ok[None, :], scores * scale, float("-inf"))  # [QROWS, BLOCK_N]
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            if ROUND:
                acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            total = total * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / tl.maximum(total, 1e-30)[:, None]  # padding (limit 0): acc is 0, so is the output
        tl.store(o_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])

    return _paged_attention


def kernel_available(device: torch.device) -> bool:
    """Whether `attend_tokens` runs the Triton kernel for tensors on `device` (CUDA with Triton installed)."""
    return device.type == "cuda" and triton_kernel() is not None


# Keys per loop iteration of the kernel (a `tl.dot`'s side: at least 16).
_BLOCK_N = 64


def attend_tokens(table: TokenTable, query: torch.Tensor, key_slots: torch.Tensor, value_slots: torch.Tensor,
                  block_size: int, scaling: float | None, out: torch.Tensor) -> None:
    """Attend packed queries `[T, heads, D]` to the pool slots `[slots, kv_heads, D]` by `table`, into `out`.

    `out` is `[T, heads, D]` and may be a view with a token stride. Rows whose `key_limits` are 0 become zeros.
    On CUDA with Triton this is one kernel launch; elsewhere the torch reference (`attend_tokens_reference`).
    """
    tokens, heads, dim = query.shape
    kv_heads = key_slots.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    kernel = triton_kernel() if query.device.type == "cuda" or _interpreting() else None
    if kernel is None:
        out.copy_(attend_tokens_reference(table, query, key_slots, value_slots, block_size, scale))
        return
    if tokens == 0:
        return
    group = heads // kv_heads
    kernel[(tokens, kv_heads)](
        query, key_slots, value_slots, out, table.token_rows, table.key_limits, table.block_tables,
        table.block_tables.stride(0), scale, query.stride(0), query.stride(1), key_slots.stride(0),
        key_slots.stride(1), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=dim, HEAD_PAD=max(16, next_power_of_2(dim)),
        QROWS=max(16, next_power_of_2(group)), BLOCK_N=_BLOCK_N, ROUND=query.dtype != torch.float32,
    )


def attend_tokens_reference(table: TokenTable, query: torch.Tensor, key_slots: torch.Tensor,
                            value_slots: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """What the kernel computes, with torch ops: gather each token's keys, mask past its limit, SDPA.

    Returns `[T, heads, D]` (zeros for padding tokens).
    """
    tokens, heads, dim = query.shape
    if tokens == 0:
        return query.new_zeros(0, heads, dim)
    limits = table.key_limits.to(torch.long)
    longest = max(int(limits.max()), 1)
    positions = torch.arange(longest, device=query.device)
    tables = table.block_tables[table.token_rows.to(torch.long)]  # [T, W]
    blocks = tables.gather(1, (positions // block_size).clamp_max(tables.shape[1] - 1)[None].expand(tokens, -1))
    slots = blocks * block_size + positions % block_size  # [T, L]
    keys = key_slots[slots].transpose(1, 2)  # [T, KVH, L, D]
    values = value_slots[slots].transpose(1, 2)
    visible = (positions[None] < limits[:, None])[:, None, None, :]  # [T, 1, 1, L]
    attended = F.scaled_dot_product_attention(query[:, :, None, :], keys.to(query.dtype), values.to(query.dtype),
                                              attn_mask=visible, scale=scale, enable_gqa=True)  # [T, H, 1, D]
    # a row that sees no key is NaN under SDPA: padding is defined as zeros
    return torch.where((limits > 0)[:, None, None], attended[:, :, 0], 0.0).to(query.dtype)


# A decode token's keys are split over programs (`attention_parts`) down to one loop iteration of `rope_attend`
# (`gpu_layer._ATTEND_BLOCK_N` keys) each, up to 16 programs: each iteration waits on its block-table and key
# loads, so a lone token's attention is latency-bound. On an H200 (benchmarks/gpu_linear.py, one token alone, the
# merge launch included) 256 keys took 7.9 µs in one part and 6.2 in four; 1,024 keys 21.2 in one, 9.7 in four and
# 7.6 in sixteen; 4,096 keys 10.7 in sixteen.
_KEYS_PER_PART = 64
_MAX_PARTS = 16


def attention_parts(rows: int, kv_heads: int, longest: int, device: torch.device) -> int:
    """How many programs share each token's keys in a decode step's attention (a power of two; flash-decoding's
    split): one while the step's tokens and KV heads alone fill the GPU's multiprocessors or the longest context
    (`longest` keys) fits two loop iterations, else enough parts of `_KEYS_PER_PART` keys or more, up to
    `_MAX_PARTS` and as many programs as multiprocessors."""
    programs = multiprocessors(device)
    base = max(1, rows * kv_heads)
    parts = 1
    while (parts < _MAX_PARTS and base * parts < programs and longest > parts * _KEYS_PER_PART
           and longest > 2 * _KEYS_PER_PART):
        parts *= 2
    return parts


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The CUDA device's multiprocessor count (132 on an H100 or H200); 8 elsewhere (the interpreter's tests)."""
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def next_power_of_2(value: int) -> int:
    """The smallest power of two >= `value` (Triton's block shapes must be powers of two)."""
    return 1 << max(0, value - 1).bit_length()


def _interpreting() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors: used to test it without a GPU."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
