"""The Triton kernels of `gpu_layer` (imported only where Triton is installed; see `gpu_layer` for what they do).

They live at module level, not in a function, so that the kernels can call the helper functions: Triton's
interpreter resolves the names a kernel calls in its module's globals.
"""

# mypy: ignore-errors
# (Triton's language functions are untyped and its kernels are not called as Python functions)

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """`x` (float32) rounded to `dtype` and back, as torch rounds a product to the model dtype (`gpu_ops` uses it
    too). For bfloat16 by integer arithmetic (round to nearest even): the compiler dropped a plain
    `.to(bf16).to(f32)` round trip, which then did not round at all."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def load_rows(x_ptr, nw_ptr, rstd, rows, row_ok, k, k_ok, stride_x, NORM: tl.constexpr, DTYPE: tl.constexpr):
    """A `[ROWS, BLOCK_K]` tile of the input rows as float32, normalized as LlamaRMSNorm (rounded where the
    model's dtype is narrower, weight applied and rounded again) where NORM."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    if NORM:
        x = round_to(x * rstd[:, None], DTYPE)
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = round_to(nw[None, :] * x, DTYPE)
    return x


@triton.jit
def load_tile(w_ptr, n, n_ok, k, k_ok, stride_w):
    """The weight tile `W[n, k]` as stored."""
    return tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def tile_product(acc, x, w, ROWS: tl.constexpr, IEEE: tl.constexpr):
    """`acc[ROWS, BLOCK_N] += x[ROWS, BLOCK_K] @ w[BLOCK_N, BLOCK_K].T`: a broadcast sum for one row, else
    `tl.dot`."""
    if ROWS == 1:
        acc += tl.sum(x * w.to(tl.float32), axis=1)[None, :]
    elif IEEE:
        acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
    return acc


@triton.jit
def linear_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, out_ptr, T, K, N, stride_x, stride_w, stride_r,
                  stride_o, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  NORM: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                  IEEE: tl.constexpr, PDL: tl.constexpr):
    """Output columns `[pid * BLOCK_N, +BLOCK_N)` of `T <= ROWS` rows: `x @ W.T` (+ bias), the input optionally
    RMS-normed, the output optionally SiLU-gated with the same columns of W's second half (`GATED`: W has 2N
    rows), or added to the residual rows (`RESIDUAL`, which may be the output itself).

    With `PDL` (launched as a programmatic dependent launch, Hopper on): the first weight tile is loaded before
    waiting for the launch before it to finish, so that the weight's first reads overlap that launch's tail;
    nothing written by an earlier launch is read, and nothing written, before `gdc_wait`."""
    dtype = out_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, ROWS)
    row_ok = rows < T
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    w = load_tile(w_ptr, n, n_ok, k, k_ok, stride_w)  # the weights are never written: safe before the wait
    u = w
    if GATED:
        u = load_tile(w_ptr, n + N, n_ok, k, k_ok, stride_w)
    if PDL:
        gdc_launch_dependents()  # the next launch may start (and load its own weights) once every program got here
        gdc_wait()  # the rows this reads were written by the launch before
    rstd = tl.zeros([ROWS], tl.float32)
    if NORM:  # the rows' statistics first: a pass over a few rows in L2, cheaper than another launch
        squares = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                        mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    x = load_rows(x_ptr, nw_ptr, rstd, rows, row_ok, k, k_ok, stride_x, NORM, dtype)
    acc = tile_product(tl.zeros([ROWS, BLOCK_N], tl.float32), x, w, ROWS, IEEE)
    up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if GATED:
        up = tile_product(up, x, u, ROWS, IEEE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = load_rows(x_ptr, nw_ptr, rstd, rows, row_ok, k, k_ok, stride_x, NORM, dtype)
        acc = tile_product(acc, x, load_tile(w_ptr, n, n_ok, k, k_ok, stride_w), ROWS, IEEE)
        if GATED:
            up = tile_product(up, x, load_tile(w_ptr, n + N, n_ok, k, k_ok, stride_w), ROWS, IEEE)
    if BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    if GATED:  # silu(gate) * up, each rounded where torch rounds (the product, then silu)
        gate = round_to(acc, dtype)
        acc = round_to(gate / (1.0 + tl.exp(-gate)), dtype) * round_to(up, dtype)
    if RESIDUAL:
        residual = tl.load(res_ptr + rows[:, None] * stride_r + n[None, :], mask=out_mask, other=0.0)
        acc = residual.to(tl.float32) + round_to(acc, dtype)
    tl.store(out_ptr + rows[:, None] * stride_o + n[None, :], acc.to(dtype), mask=out_mask)


@triton.jit
def rope_attend_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slots_ptr, rows_ptr, limits_ptr, tables_ptr,
                       o_ptr, part_ptr, table_stride, scale, stride_qkv, stride_cs, stride_ks, stride_kh,
                       stride_ot, stride_oh, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QROWS: tl.constexpr, DIM: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr,
                       ROUND: tl.constexpr, PDL: tl.constexpr):
    """One token (its sequence's only new one), one KV head, one part of its keys: RoPE on the group's queries;
    the part holding the token's own key rotates it and writes it and the value to the pool slot; then an
    online softmax over the part's keys. One part writes the output; several write `(acc, max, sum)` partials
    for `merge_parts_kernel`. With `PDL`, everything waits for the launch before (it reads that launch's q/k/v);
    the next launch may start loading its weights meanwhile.

    The group's queries are padded to `QROWS` (>= 16) rows so that scores and the value sum are `tl.dot`s (the
    tensor cores): a broadcast sum over `[group, keys, dim]` took ~0.12 µs a key on an H200 (31 µs for 256 keys).
    As in SDPA and flash attention, a narrow dtype's probabilities are rounded to it before the value product."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    dtype = qkv_ptr.dtype.element_ty
    limit = tl.load(limits_ptr + token)
    row = tl.load(rows_ptr + token)
    g = tl.arange(0, QROWS)
    d = tl.arange(0, DIM)
    g_ok = g < GROUP
    rolled_d = (d + DIM // 2) % DIM
    cos = tl.load(cos_ptr + token * stride_cs + d).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cs + d).to(tl.float32)
    qkv = qkv_ptr + token * stride_qkv
    heads = kv_head * GROUP + g
    x = tl.load(qkv + heads[:, None] * DIM + d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    rolled = tl.load(qkv + heads[:, None] * DIM + rolled_d[None, :], mask=g_ok[:, None], other=0.0
                     ).to(tl.float32)
    a = x * cos[None, :]
    b = rolled * sin[None, :]
    if ROUND:  # torch rounds each product to the model dtype before the add
        a = round_to(a, dtype)
        b = round_to(b, dtype)
    q = round_to(a + b, dtype)  # the query as rope_write stores it (a plain round trip is dropped in bf16)
    # this part's keys: an equal share of the token's, in whole loop blocks
    share = tl.cdiv(tl.cdiv(limit, PARTS), BLOCK_N) * BLOCK_N
    start = part * share
    end = tl.minimum(limit, start + share)
    if (limit > 0) & (start <= limit - 1) & (limit - 1 < end):  # the token's own key is in this part
        slot = tl.load(slots_ptr + token)
        key_in = qkv + (Q_HEADS + kv_head) * DIM
        k_new = tl.load(key_in + d).to(tl.float32) * cos
        k_rolled = tl.load(key_in + rolled_d).to(tl.float32) * sin
        if ROUND:
            k_new = round_to(k_new, dtype)
            k_rolled = round_to(k_rolled, dtype)
        tl.store(k_ptr + slot * stride_ks + kv_head * stride_kh + d, (k_new + k_rolled).to(dtype))
        tl.store(v_ptr + slot * stride_ks + kv_head * stride_kh + d,
                 tl.load(qkv + (Q_HEADS + KV_HEADS + kv_head) * DIM + d))
        tl.debug_barrier()  # every thread's stores land before the loop reads that slot back
    m = tl.full([QROWS], float("-inf"), tl.float32)
    total = tl.zeros([QROWS], tl.float32)
    acc = tl.zeros([QROWS, DIM], tl.float32)
    q_op = q.to(dtype)  # exact: q holds values of the model dtype
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(tables_ptr + row * table_stride + n // BLOCK_SIZE, mask=n_ok, other=0)
        slots = block * BLOCK_SIZE + n % BLOCK_SIZE
        offsets = slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + offsets, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=n_ok[:, None], other=0.0)
        if ROUND:
            scores = tl.dot(q_op, tl.trans(k.to(dtype)))
        else:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
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
    out_mask = g_ok[:, None]
    if PARTS == 1:  # padding (limit 0) attends nothing: acc is 0, so is the output
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(o_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(dtype), mask=out_mask)
    else:  # partials [T, KV_HEADS, PARTS, GROUP_PAD, DIM + 2]: acc, then max and sum
        base = part_ptr + ((token * KV_HEADS + kv_head) * PARTS + part) * GROUP_PAD * (DIM + 2)
        kept = g < GROUP_PAD
        tl.store(base + g[:, None] * (DIM + 2) + d[None, :], acc, mask=kept[:, None])
        tl.store(base + g * (DIM + 2) + DIM, m, mask=kept)
        tl.store(base + g * (DIM + 2) + DIM + 1, total, mask=kept)


@triton.jit
def merge_parts_kernel(part_ptr, o_ptr, stride_ot, stride_oh, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr):
    """The parts' online-softmax partials of one token and KV head, merged (log-sum-exp) into its output (with
    `PDL`, after the partials' launch has finished)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    p = tl.arange(0, PARTS)
    base = part_ptr + (token * KV_HEADS + kv_head) * PARTS * GROUP_PAD * (DIM + 2)
    at = base + (p[:, None] * GROUP_PAD + g[None, :]) * (DIM + 2)  # [PARTS, GROUP_PAD]
    maxes = tl.load(at + DIM)
    sums = tl.load(at + DIM + 1)
    top = tl.max(maxes, axis=0)  # [GROUP_PAD]
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding token: every part empty
    weight = tl.exp(maxes - top[None, :])  # empty parts (max -inf) weigh 0
    accs = tl.load(at[:, :, None] + d[None, None, :])  # [PARTS, GROUP_PAD, DIM]
    acc = tl.sum(accs * weight[:, :, None], axis=0)
    total = tl.sum(sums * weight, axis=0)
    out = acc / tl.maximum(total, 1e-30)[:, None]
    heads = kv_head * GROUP + g
    tl.store(o_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
