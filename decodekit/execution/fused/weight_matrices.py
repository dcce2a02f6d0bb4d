"""The weight products of the fused decoder and of other architectures' re-laid linear layers: one weight, multiplied
the fastest way for the number of rows at hand (`Matrix`: row-major float32 on `dk_gemv`, oneDNN-prepacked copies),
or as compressed copies multiplied in float32 on the native kernels (`Int8Matrix`, `Bf16Matrix`); bf16 copies of
several rows optionally on the CPU's own bf16 dot products (`Bf16Matrix(bf16_gemm=True)`, oneDNN).

Shared by `fused_decoder` (fused q/k/v and gate/up products of the architectures it takes) and `relaid_linears`
(each `nn.Linear` of the others).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable

import torch

from decodekit.api.cpu import cpu_flags
from decodekit.api.huge_pages import on_huge_pages
from decodekit.execution.kernels.native import (
    PANEL,
    NativeKernels,
    pack_bf16_panels,
    pack_int8_panels,
    unpack_int8_panels,
)


class Matrix:
    """One float32 weight of the fused decoder, multiplied the fastest way for the number of rows at hand.

    `weight` is the `[out, in]` weight in its own row-major layout (the module's parameter, or a view of a fused
    buffer). With `native` kernels, 1 to their `gemv_max_rows` rows (batch-1 decode, small batches, speculative
    verification) run `dk_gemv`, which streams each thread's share of the weight front to back (torch's single-row
    product streams it on one core). `packed`, when present, is a oneDNN-blocked copy of the same weight for the
    rows beyond (batched decode, short chunks), where this CPU's BLAS is slow; BLAS takes the rest.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
                 native: NativeKernels | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT) if pack else None
        self.packed_max_rows = packed_max_rows()  # read once: the product below runs on every step
        # `dk_gemv` reads the weight from memory as it lies: a strided one keeps torch's product
        self.native = native if weight.is_contiguous() else None
        self.native_max_rows = 0 if self.native is None else self.native.gemv_max_rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T (+ bias) (+ residual)`; with a residual the add is fused into the product."""
        if self.native is not None and 0 < x.shape[0] <= self.native_max_rows:
            return self.native.gemv(x, self.weight, self.bias, residual)
        if self.packed is not None and 1 < x.shape[0] <= self.packed_max_rows:
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        transposed = self.weight.t()
        if residual is not None:
            out = torch.addmm(residual, x, transposed)
            return out if self.bias is None else out.add_(self.bias)
        return torch.mm(x, transposed) if self.bias is None else torch.addmm(self.bias, x, transposed)


# Rows the oneDNN weight blocking is tuned for: measured here, 64 serves 2-128 rows well (2-8 rows 1.4-1.8x
# faster than BLAS on either layout), while a hint of 1 made 2-row products slower than BLAS.
_PACK_ROWS_HINT = 64
# On an AVX2-only CPU (2-core EPYC), from 256 rows up (prefill) BLAS (measured on a column-major copy of the weights,
# the layout of the time) was as fast or faster, so it keeps those. On an AVX-512 one (2-core Zen 5) oneDNN's blocked
# products were 2.4-3x BLAS's at every row count from 128 to 1024 (a SmolLM2 layer's four products at 256 rows: 3.9 vs
# 10.6 ms; at 1024: 15.9 vs 37.4): torch's BLAS there does not use the wider vectors, oneDNN does.
_PACKED_MAX_ROWS_AVX2 = 128


def packed_max_rows() -> int:
    """The most rows a float32 product runs on the oneDNN-blocked copy (more take BLAS):
    every row count on a CPU with AVX-512, 128 elsewhere."""
    return sys.maxsize if "avx512f" in cpu_flags() else _PACKED_MAX_ROWS_AVX2

def prepacking_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN-blocked weights can serve multi-row products here (CPU, float32, oneDNN built in)."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:  # private ops of torch (the ones inductor's CPU freezing uses); refuse quietly if they ever change
        probe = torch.ones(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, _PACK_ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 8.0)))
    except (RuntimeError, AttributeError):
        return False


def dequantized_mm(x: torch.Tensor, residual: torch.Tensor | None, out_dim: int,
                    blocks: Iterable[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """`x @ W^T (+ residual)` for a compressed weight given as `(first output row, float W^T block [in, rows])`
    blocks: products of many rows (prefill chunks) are bound by arithmetic, where BLAS on float32 beats the native
    kernels, so they run on weights dequantized a block of output rows at a time (a few MB, never the whole
    matrix)."""
    out = x.new_empty(x.shape[0], out_dim) if residual is None else residual.clone()
    for start, block in blocks:
        end = start + block.shape[1]
        if residual is None:
            torch.mm(x, block, out=out[:, start:end])
        else:
            out[:, start:end].addmm_(x, block)
    return out


class Int8Matrix:
    """One weight as int8 with a float32 scale per output row (weight-only quantization), packed in panels of 16
    output rows (`pack_int8_panels`).

    Symmetric and round-to-nearest: a row's largest |w| maps to 127, so each weight is off by at most half a step
    (a relative error of ~0.4% of the row's largest weight). Up to `INT8_NATIVE_MAX_ROWS` rows run the native
    kernel, which streams the int8 bytes and rounds the activations to int16 per row (an error of at most
    sqrt(in) / 65534 of a row's rms: see `dk_linear_i8`); more rows take `dequantized_mm`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: NativeKernels) -> None:
        rows = weight.detach().to(torch.float32)
        self.out_dim, self.in_dim = rows.shape
        scale = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        self.panels = on_huge_pages(
            pack_int8_panels(torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)))
        self.scale = scale.contiguous()
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.native = native

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight `[out, in]` (unpacked: a copy)."""
        return unpack_int8_panels(self.panels, self.out_dim, self.in_dim)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T (+ bias) (+ residual)` with `W = weight * scale`."""
        if x.shape[0] <= INT8_NATIVE_MAX_ROWS:
            return self.native.linear_i8(x, self.panels, self.scale, self.bias, residual)
        step = DEQUANTIZE_BLOCK // PANEL
        blocks = ((first * PANEL, (unpack_int8_panels(self.panels[first:first + step], self.out_dim - first * PANEL,
                                                      self.in_dim).to(x.dtype)
                                   * self.scale[first * PANEL:(first + step) * PANEL, None]).t())
                  for first in range(0, self.panels.shape[0], step))
        out = dequantized_mm(x, residual, self.out_dim, blocks)
        return out if self.bias is None else out.add_(self.bias)


class Bf16Matrix:
    """One weight as bfloat16, packed in panels of 16 output rows (`pack_bf16_panels`), multiplied in float32.

    Round-to-nearest-even to bf16 (8 significant bits: a relative error of at most 2^-9 per weight, none for
    weights bf16 represents). Up to `BF16_NATIVE_MAX_ROWS` rows run `dk_linear_bf16`, which reads the panels front
    to back; more rows take `dequantized_mm`.

    With `bf16_gemm` (`execution.plan`: a bfloat16 model on a CPU with bf16 dot products), products of
    `BF16_GEMM_MIN_ROWS` rows or more run oneDNN's bf16 GEMM on a prepacked copy of the weight instead: the
    activations are rounded to bf16 at the product's input (as vLLM's and transformers' bf16 arithmetic rounds
    them), accumulated in float32 and rounded to bf16 at its output, then widened; bias and residual are added in
    float32. On AVX512-BF16 that is 2-4x float32's rate from 8 rows up (`vdpbf16ps`), where the panel kernel
    (float32 arithmetic) is bound by its multiplies. Single rows keep the panels: float32 activations, and faster
    for one row of the small matrices.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: NativeKernels,
                 bf16_gemm: bool = False) -> None:
        self.out_dim, self.in_dim = weight.shape
        self.panels = on_huge_pages(pack_bf16_panels(weight))
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.native = native
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous(),
                                                               _PACK_ROWS_HINT) if bf16_gemm else None)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T (+ bias) (+ residual)` with `W` the bf16-rounded weight, in float32. `x` is float32, or bfloat16
        already rounded for the bf16 GEMM (`takes_bf16`)."""
        rows = x.shape[0]
        if self.takes_bf16(rows):
            product = self.bf16_product(x)
            if self.bias is None and residual is None:
                return product.to(torch.float32)
            return self.native.widen_add(product, self.bias, residual)
        if x.dtype != torch.float32:  # bf16 rows meant for the GEMM (only `takes_bf16` callers send them)
            x = x.float()
        if rows <= BF16_NATIVE_MAX_ROWS:
            return self.native.linear_bf16(x, self.panels, self.out_dim, self.bias, residual)
        step = DEQUANTIZE_BLOCK // PANEL
        blocks = ((first * PANEL, self.panels[first:first + step].to(x.dtype).permute(1, 0, 2)
                   .reshape(self.in_dim, -1)[:, :self.out_dim - first * PANEL])
                  for first in range(0, self.panels.shape[0], step))
        out = dequantized_mm(x, residual, self.out_dim, blocks)
        return out if self.bias is None else out.add_(self.bias)

    def takes_bf16(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on the bf16 GEMM (its input rounded to bf16, its output bf16): a
        caller that has the input in float32 may round it in the pass that makes it (`NativeKernels.rms_norm`)."""
        return self.packed is not None and rows >= BF16_GEMM_MIN_ROWS

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W^T` on the bf16 GEMM, bfloat16 out (no bias): `x` rounded to bf16 here unless it is bf16 already.
        Only where `takes_bf16(rows)`."""
        assert self.packed is not None, "bf16_product needs the oneDNN copy (bf16_gemm)"
        return torch.ops.mkldnn._linear_pointwise(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16),
                                                  self.packed, None, "none", [], "")


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether torch's oneDNN runs prepacked bf16 products here (the private ops `Bf16Matrix(bf16_gemm=True)` uses;
    refused quietly if they ever change)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8, dtype=torch.bfloat16), _PACK_ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=torch.bfloat16), packed, None, "none", [], "")
        return bool(torch.equal(out.to(torch.float32), torch.full((2, 4), 8.0)))
    except (RuntimeError, AttributeError):
        return False


# Rows up to which the int8 kernel beats dequantizing to float32 BLAS. Measured on SmolLM2 (2-core AVX2, whole
# decode steps, benchmarks/step_cost.py): the kernel costs ~3.1 ms per row from 16 rows on, the dequantizing path
# ~70 ms per step more than float32's ~2.6-2.9 ms per row, so they cross near 140 rows; with the limit at 32, a
# 33-row step cost 1.7x a 32-row one.
INT8_NATIVE_MAX_ROWS = 128
# The same for bf16: per product (SmolLM2's shapes, 2 threads) the kernel takes 1.06-1.2x the time of float32's
# prepacked oneDNN at 64-128 rows, where it is bound by arithmetic (AVX2 has no bf16 multiply), and 2-3.5x less at
# 1-8 rows; BLAS on dequantized blocks (29 ms against float32's 15 at 32 rows) is slower than both up to 128 rows.
BF16_NATIVE_MAX_ROWS = 128
# Rows from which a bf16 weight with a oneDNN copy (`bf16_gemm`) multiplies on the CPU's bf16 dot products. Measured
# on SmolLM2's shapes (2-core Zen 5, AVX512-BF16, 2 threads, benchmarks/bf16_products.py; a layer's four products):
# at 4 rows the two tie (152 vs 151 us), at 8 the GEMM takes 0.68x the panels' time, at 32 0.41x, at 64 0.32x. Below
# 8 rows (batch-1 decode, one sequence's speculative verification) the panels keep float32 activations.
BF16_GEMM_MIN_ROWS = 8
# Output rows dequantized at once on the BLAS path: a few MB of float32, not a vocabulary-sized matrix.
DEQUANTIZE_BLOCK = 2048

QUANTIZATIONS = ("int8", "bf16")
QUANTIZED_MATRICES: dict[str, type[Int8Matrix] | type[Bf16Matrix]] = {"int8": Int8Matrix, "bf16": Bf16Matrix}
AnyMatrix = Matrix | Int8Matrix | Bf16Matrix
MatrixMaker = Callable[[torch.Tensor, "torch.Tensor | None", NativeKernels], "Int8Matrix | Bf16Matrix"]
"""Makes a compressed copy of a weight `[out, in]` (with its bias) that multiplies on the native kernels."""


def quantized_matrix(quantization: str, bf16_gemm: bool = False) -> MatrixMaker:
    """What makes the `quantization`'s copy of each weight; with `bf16_gemm`, bf16 copies that multiply several rows
    on the CPU's bf16 dot products (`Bf16Matrix`)."""
    if quantization == "bf16" and bf16_gemm:
        return functools.partial(Bf16Matrix, bf16_gemm=True)
    return QUANTIZED_MATRICES[quantization]
