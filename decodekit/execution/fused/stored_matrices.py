"""Weights multiplied as their file stores them: a GGUF's quantized blocks (`GgufMatrix`), for the fused decoder's
`quantization: gguf` (which `execution.plan` chooses for a model loaded with its stored weights).

Up to `GGUF_NATIVE_MAX_ROWS` rows (decode, batches, speculative verification, prefill chunks) run the native
product, which dequantizes each block in registers, or for 16 activation rows and more once into a panel in cache
(`kernels.quant`); more rows dequantize a block of output rows at a time to float32 for BLAS (`dequantized_mm`), as
the int8 and bf16 copies do. Both multiply exactly the float32 weights transformers dequantizes from the file: the
output is the dequantized model's up to summation order (on the AVX2 path Q4_0, Q4_1 and Q8_0, on the AVX-512 path
Q4_0 and Q4_1, times activations rounded to 16-bit fixed point per block of 32, `native/quant.c`), and the native
product sums each output in one order whatever the rows, so a row's result does not depend on its batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from decodekit.api.huge_pages import on_huge_pages
from decodekit.api.models import StoredWeight
from decodekit.execution.fused.weight_matrices import DEQUANTIZE_BLOCK, AnyMatrix, Matrix, dequantized_mm
from decodekit.execution.kernels.native import NativeKernels
from decodekit.execution.kernels.quant import (
    GROUPED,
    INTERLEAVED_Q4_1,
    INTERLEAVED_ROWS,
    file_format,
    float_activations_asked,
    group_blocks,
    interleave_q4_1,
    rounds_activations,
)

STORED_QUANTIZATION = "gguf"
"""The `ExecutionPlan.quantization` of weights multiplied as stored."""
BLOCK_FORMATS = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}
"""The quantizations that copy a float model's weights into GGUF blocks at load (`fused.block_copies`), and the
format each writes: multiplied here as a file's stored blocks are."""

# Rows up to which the native product runs; more dequantize blocks of rows for BLAS. Measured with
# benchmarks/quant_products.py (2-core Zen 5, AVX-512, SmolLM2's shapes, 4 layers): the native product (panels from 16
# rows) was 1.3-2.5x faster than dequantize-then-BLAS at every row count from 8 to 512, in every format (Q4_1 at 64
# rows 1.19 against 0.45 GB/s of stored weights, at 512 rows 0.15 against 0.11); at 16 rows, the limit before, a
# bundled-model step of 32 rows cost 2-4x the float32 model's.
GGUF_NATIVE_MAX_ROWS = 512


INTERLEAVE_VARIABLE = "DECODEKIT_GGUF_INTERLEAVE"
"""Set to `on` to interleave Q4_1 weights by 8 rows on the AVX2 path (`laid_out_for`); read per matrix built."""


def laid_out_for(weight: StoredWeight, isa: str) -> tuple[str, torch.Tensor]:
    """The `(format, blocks)` the product on path `isa` multiplies for `weight`: its own; on the AVX2 and AVX-512
    paths with fixed-point activations (`kernels.quant.rounds_activations`) a Q4_0 or Q4_1 weight's blocks grouped
    (`Q4_0g`, `Q4_1g`, `kernels.quant.group_blocks`: each 8 blocks' scales and mins first, the same bytes regrouped,
    a copy; the same output bits, fewer instructions a block); or under `DECODEKIT_GGUF_INTERLEAVE=on` a Q4_1
    weight's blocks interleaved by 8 rows for the AVX2 path's interleaved product (format `Q4_1x8`,
    `kernels.quant.interleave_q4_1`), which every path multiplies as the same weights. Only on the AVX2 path and for
    whole groups of 8 rows.

    Grouping measured on a 2-core Zen 3 (`benchmarks/kernel_ab.py`, random Q4_1 blocks, 8192 rows, one activation
    row, 2 threads): 1.17x (576 wide) and 1.24x (1536 wide) the speed of blocks paired with their own scales (this
    layout's predecessor, itself 1.09-1.13x the stored layout's).

    Opt-in, because it pays for one or two activation rows only. Measured on a 2-core Zen 3 (SmolLM2's 120 layer
    products, the two layouts alternating in one process, 2 threads): 1 row 1.11-1.20x, 2 rows 1.01-1.11x, but 4
    rows 0.79-0.82x and 8 rows 0.80-0.84x (its tiles broadcast each activation into 8 rows' lanes, and more than two
    activation rows a tile do not fit the registers); a batch-1 token 1.12x, batch 4 0.84x, and speculative
    decoding, whose verification multiplies several rows, no faster."""
    if weight.data.device.type != "cpu":
        return weight.format, weight.data.contiguous()
    if (isa == "avx2" and weight.format == "Q4_1" and not weight.shape[0] % INTERLEAVED_ROWS
            and os.environ.get(INTERLEAVE_VARIABLE, "off") == "on"):
        return INTERLEAVED_Q4_1, on_huge_pages(interleave_q4_1(weight.data))
    if weight.format in GROUPED and rounds_activations(isa):
        return GROUPED[weight.format], on_huge_pages(group_blocks(weight.data.contiguous(), weight.format))
    return weight.format, weight.data.contiguous()


class GgufMatrix:
    """One weight, or several stacked by output rows (q/k/v, gate/up), as GGUF quantized blocks (`StoredWeight`s of
    one input width, each part in its own format), multiplied in float32.

    Args:
        parts: the weights, in output-row order.
        bias: float bias of all the rows (or None).
        native: the kernels (their `quant` products).
        isa: the code path (`QuantKernels.isa`: default the best this CPU has, or `$DECODEKIT_QUANT_ISA`).

    `$DECODEKIT_GGUF_ACTIVATIONS=float32` (read when it is built) keeps float32 activations where the AVX2 and
    AVX-512 paths would round them to 16-bit fixed point (`kernels.quant.ACTIVATIONS_VARIABLE`).

    Raises:
        ValueError: the parts differ in width, a format is not one the kernels take, the path is not available, or
            `$DECODEKIT_GGUF_ACTIVATIONS` is neither `fixed16` nor `float32`.
    """

    def __init__(self, parts: Sequence[StoredWeight], bias: torch.Tensor | None, native: NativeKernels,
                 isa: str | None = None) -> None:
        widths = {part.shape[1] for part in parts}
        if len(widths) != 1:
            raise ValueError(f"stacked GGUF weights must share their input width, not {sorted(widths)}")
        self.in_dim = widths.pop()
        self.quant = native.quant
        self.isa = native.quant.isa(isa)
        self.float_activations = float_activations_asked()
        self.parts: list[tuple[int, str, torch.Tensor]] = []
        start = 0
        for part in parts:
            self.parts.append((start, *laid_out_for(part, self.isa)))
            start += part.shape[0]
        self.out_dim = start
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()

    @property
    def formats(self) -> tuple[str, ...]:
        """Each part's format as laid out for the product (`laid_out_for`)."""
        return tuple(fmt for _, fmt, _ in self.parts)

    @property
    def file_formats(self) -> tuple[str, ...]:
        """Each part's format as the file stores it (`kernels.quant.file_format`)."""
        return tuple(file_format(fmt) for fmt in self.formats)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight `[out, in]` multiplied (a copy)."""
        return torch.cat([self.quant.dequantize(blocks, fmt, self.in_dim, self.isa) for _, fmt, blocks in self.parts])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T (+ bias) (+ residual)` for float32 rows `x` `[rows, in]`."""
        x = x.contiguous()
        if x.shape[0] <= GGUF_NATIVE_MAX_ROWS:
            out = x.new_empty(x.shape[0], self.out_dim)
            residual = None if residual is None else residual.contiguous()
            for start, fmt, blocks in self.parts:
                self.quant.linear(x, blocks, fmt, out, start, self.bias, residual, self.isa, self.float_activations)
            return out
        out = dequantized_mm(x, residual, self.out_dim, self.dequantized_blocks())
        return out if self.bias is None else out.add_(self.bias)

    def dequantized_blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """`(first output row, W^T block [in, rows])` of at most `DEQUANTIZE_BLOCK` rows, dequantized on demand."""
        for start, fmt, blocks in self.parts:
            for first in range(0, blocks.shape[0], DEQUANTIZE_BLOCK):
                rows = blocks[first:first + DEQUANTIZE_BLOCK]
                yield start + first, self.quant.dequantize(rows, fmt, self.in_dim, self.isa).t()


LayerMatrix = AnyMatrix | GgufMatrix
"""Any product the fused decoder's layers hold."""
StackMaker = Callable[[Sequence[nn.Linear], "torch.Tensor | None"], LayerMatrix]
"""Makes the product of some linear layers' weights stacked by output rows (with their bias)."""


def stored_matrix_maker(model: Any, stored: dict[str, StoredWeight], native: NativeKernels) -> StackMaker:
    """What makes the fused decoder's products of `model`'s layers from their `stored` weights (`GgufMatrix`); a
    stack with a layer whose weight is not stored multiplies a float32 copy of the modules' weights instead.

    A weight the product lays out anew (`laid_out_for`: Q4_0 and Q4_1 grouped on AVX2) is replaced in `stored` by
    that copy, under its layout's format, so the file's blocks are not held twice (66 MB for the bundled model); a
    product built from it later multiplies it as it is (`laid_out_for` leaves a laid-out format alone)."""
    names = {module: name for name, module in model.named_modules()}

    def make(modules: Sequence[nn.Linear], bias: torch.Tensor | None) -> LayerMatrix:
        parts = [stored.get(f"{names[module]}.weight") for module in modules]
        if all(part is not None for part in parts):
            matrix = GgufMatrix([part for part in parts if part is not None], bias, native)
            for part, (_, fmt, blocks) in zip(parts, matrix.parts, strict=True):
                if part is not None and blocks.data_ptr() != part.data.data_ptr():
                    laid_out = StoredWeight(fmt, blocks, part.shape)
                    for key in [key for key, weight in stored.items() if weight is part]:  # tied names too
                        stored[key] = laid_out
            return matrix
        dense = torch.cat([module.weight.detach().to(torch.float32) for module in modules])
        return Matrix(dense.contiguous(), bias, False, native)

    return make
