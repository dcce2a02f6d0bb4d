"""The GPU path's decoder layer in five Triton launches, for steps of a few rows (batch-1 to batch-16 decode).

On an H100 the batch-1 graph of SmolLM2 spent 1.85 ms a token against 0.09 ms to read its weights: the kernels
were busy half of it, the rest were the gaps between ~11 dependent launches per layer, and each small launch costs
2-3 µs of its own. At a few rows every product is a matrix-vector product, bound by reading the weight, so the
small ops around it can ride inside it for free. A layer becomes:

1. `linear(normed=...)`: RMSNorm of the input rows computed inside the product (each program re-reads the few
   rows, which sit in L2), then the fused q/k/v product;
2. `rope_attend`: RoPE on the token's queries and key, the key and value written to their pool slot, and paged
   attention over the token's keys, in one launch (decode steps, one new token per sequence), with the keys split
   over several programs for long contexts (`attention.gpu.attention_parts`), merged by a second launch;
3. `linear(residual=...)`: the output product with the residual add in its epilogue, in place;
4. `linear(normed=..., gated=...)`: the post-attention norm, the gate/up product and SiLU-gating: each program
   multiplies the same rows of the gate and the up halves and writes `silu(gate) * up`;
5. `linear(residual=...)`: the down product, adding into the residual stream.

Rounding follows the torch ops these replace (`gpu_ops` does the same): in bf16 the normalized row is rounded
before the weight multiply, each product rounded to the model dtype before its add or gating. The products add
in another order than cuBLAS (as cuBLAS itself does between batch sizes), so bf16 results may differ in the last
bit; float32 products use full-precision dots (no TF32).

Rows above `FUSED_MAX_ROWS` (prefill, large batches) keep cuBLAS and the separate small ops: the tensor cores
then do the arithmetic that matters. Under Triton's interpreter (`TRITON_INTERPRET=1`) these kernels run on CPU
tensors; tests/execution/test_gpu_layer.py checks them against the torch ops that way and on a GPU.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from decodekit.execution.attention.gpu import TokenTable, multiprocessors, next_power_of_2

log = logging.getLogger(__name__)

# The most rows (packed tokens) whose products these kernels take; the `tl.dot` tile pads 2..16 rows to 16.
FUSED_MAX_ROWS = 16
_ATTEND_BLOCK_N = 64  # keys per loop iteration of `rope_attend` (a `tl.dot`'s side: at least 16)
# A one-row program's loads: 64 elements a thread (eight 16-byte loads of bf16), so that a program has its whole
# tile in flight at once and a product of a few MB needs few iterations
_ELEMENTS_PER_THREAD = 64


def one_row_tiles(n_out: int, k_dim: int, device: torch.device, gated: bool = False) -> tuple[int, int, int]:
    """`(block_n, block_k, num_warps)` of a one-row product: a matrix-vector product, bound by the latency of
    reading its weight more than by the bandwidth. On an H200 (benchmarks/gpu_linear.py) 8 x 256 tiles read
    Llama-1B's layers at 1.8 TB/s of its 4.2. So: the fewest output rows a program (down to 2) that still gives at
    least two programs a multiprocessor; up to 2048 of K a tile (1024 gated, which loads two tiles); 4 warps, or 8
    where the tile would give a thread more than `_ELEMENTS_PER_THREAD` (the best of the sweep in each product
    but the smallest, within 10%)."""
    programs = 2 * multiprocessors(device)
    block_n = 8
    while block_n > 2 and -(-n_out // block_n) < programs:
        block_n //= 2
    block_k = max(16, min(next_power_of_2(k_dim), 1024 if gated else 2048))
    warps = 8 if block_n * block_k > 4 * 32 * _ELEMENTS_PER_THREAD else 4
    return block_n, block_k, warps


# Programmatic dependent launches (Hopper and later): each launch of these kernels may start while the one before
# finishes, load its first weight tile, then wait for it (`triton_layer.linear_kernel`). The batch-1 products
# measured back to back on an H200 took 54.6 µs a Llama-1B layer against 39.7 µs for the four alone
# (benchmarks/gpu_linear.py): each launch's first reads waited for the one before to drain. Off with
# DECODEKIT_GPU_PDL=0, and for good once a launch with it fails.
_pdl_failed = False


def programmatic_launches(device: torch.device) -> bool:
    """Whether this layer's kernels are launched as programmatic dependent launches on `device`: a CUDA device of
    compute capability 9.0 or later (not Triton's interpreter), unless DECODEKIT_GPU_PDL=0 or a launch failed."""
    if _pdl_failed or device.type != "cuda" or os.environ.get("DECODEKIT_GPU_PDL", "1") == "0":
        return False
    return _capability(device) >= (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (asked once: every eager launch checks it)."""
    return torch.cuda.get_device_capability(device)


def _launch(kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any, **constants: Any) -> None:
    """`kernel[grid](*args, **constants)`, as a programmatic dependent launch where `programmatic_launches`; a
    failed one (an older driver or Triton) is logged and the kernel launched plainly from then on."""
    global _pdl_failed
    if programmatic_launches(device):
        try:
            kernel[grid](*args, **constants, PDL=True, launch_pdl=True)
            return
        except Exception as exc:  # any compile or launch failure: the plain launch still works
            log.warning("programmatic dependent launches failed (%r); launching the GPU layer's kernels plainly",
                        exc)
            _pdl_failed = True
    kernel[grid](*args, **constants, PDL=False)


@functools.cache
def _kernels() -> Any:
    """`(linear, rope_attend, merge_parts)` kernels (`triton_layer`), compiled on first use; None without Triton."""
    try:
        from decodekit.execution.kernels import triton_layer
    except ImportError:
        return None
    return triton_layer.linear_kernel, triton_layer.rope_attend_kernel, triton_layer.merge_parts_kernel


def available() -> bool:
    """Whether Triton is installed (the kernels compile on first use)."""
    return _kernels() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
           residual: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`x @ weight.T` (+ `bias`) for `[T, K]` rows, T <= `FUSED_MAX_ROWS`, `weight` `[N, K]` row-major, one launch.

    With `norm_weight`, the rows are first LlamaRMSNorm-ed (`eps`) inside the product. With `gated`, `weight` holds
    the gate rows then the up rows (`[2I, K]`) and the result is `silu(gate) * up` `[T, I]`. With `residual`
    (`[T, N]`), returns `residual + product`, written into `residual` itself. `tiles` overrides the
    `(block_n, block_k, num_warps)` chosen (`one_row_tiles` for one row; benchmarks/gpu_linear.py sweeps them).
    """
    tokens, k_dim = x.shape
    if tokens > FUSED_MAX_ROWS:
        raise ValueError(f"gpu_layer.linear takes at most {FUSED_MAX_ROWS} rows, not {tokens}")
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = residual if residual is not None else x.new_empty(tokens, n_out)
    rows = 1 if tokens == 1 else FUSED_MAX_ROWS
    if tiles is not None:
        block_n, block_k, warps = tiles
    elif rows == 1:
        block_n, block_k, warps = one_row_tiles(n_out, k_dim, x.device, gated)
    else:  # `tl.dot` tiles of 16 rows: 16 output columns, 64 of K
        block_n, block_k, warps = 16, min(64, max(16, next_power_of_2(k_dim))), 4
    if tokens == 0:
        return out
    _launch(_kernels()[0], (-(-n_out // block_n),), x.device,
        x, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x,
        residual if residual is not None else out, out, tokens, k_dim, n_out, x.stride(0), weight.stride(0),
        (residual if residual is not None else out).stride(0), out.stride(0), eps,
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None, BIAS=bias is not None,
        GATED=gated, RESIDUAL=residual is not None, IEEE=weight.dtype == torch.float32, num_warps=warps)
    return out


def rope_attend(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, q_heads: int, kv_heads: int,
                key_slots: torch.Tensor, value_slots: torch.Tensor, slot_mapping: torch.Tensor, table: TokenTable,
                block_size: int, scale: float, block_n: int = _ATTEND_BLOCK_N) -> torch.Tensor:
    """RoPE, KV write and paged attention of a decode step (each sequence brings one token) from the fused
    `[T, (q + 2 kv) * D]` product; `cos`/`signed_sin` `[T, D]` as `gpu_ops.rope_write` takes them. Returns the
    attended `[T, q_heads * D]` (zeros for padding tokens, whose key limit is 0). `table.parts` programs share
    each token's keys (`attention.gpu.attention_parts`); more than one adds the merge launch. `block_n`: keys a
    loop iteration (benchmarks/gpu_linear.py sweeps it)."""
    tokens = qkv.shape[0]
    dim = key_slots.shape[-1]
    group = q_heads // kv_heads
    group_pad = max(2, next_power_of_2(group))
    out = qkv.new_empty(tokens, q_heads * dim)
    if tokens == 0:
        return out
    parts = table.parts
    partials = (qkv.new_empty(tokens * kv_heads * parts * group_pad * (dim + 2), dtype=torch.float32)
                if parts > 1 else out)
    kernels = _kernels()
    _launch(kernels[1], (tokens, kv_heads, parts), qkv.device,
        qkv, cos, signed_sin, key_slots, value_slots, slot_mapping, table.token_rows, table.key_limits,
        table.block_tables, out, partials, table.block_tables.stride(0), scale, qkv.stride(0), cos.stride(0),
        key_slots.stride(0), key_slots.stride(1), out.stride(0), dim,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, QROWS=max(16, group_pad), DIM=dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n, PARTS=parts, ROUND=qkv.dtype != torch.float32)
    if parts > 1:
        _launch(kernels[2], (tokens, kv_heads), qkv.device, partials, out, out.stride(0), dim, KV_HEADS=kv_heads,
                GROUP=group, GROUP_PAD=group_pad, DIM=dim, PARTS=parts)
    return out
