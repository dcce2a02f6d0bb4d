"""GGUF block-quantized copies of a float model's weights, made at load (`quantization: q4_0 | q4_1 | q8_0`): what
`llama-quantize` would write, multiplied by the native block products that run a GGUF file's weights as stored.

Each weight is quantized with gguf-py's reference quantizer (`gguf.quants.quantize`, ggml's `quantize_row_*_ref`):
blocks of 32 weights, a fp16 scale (and for Q4_1 a fp16 minimum) each. A 4-bit copy keeps the LM head in Q8_0, as
llama.cpp's quantizer does for the output weights of a model whose width is not a multiple of 256 (its Q6_K falls
back to Q8_0); the bundled model's GGUF is laid out exactly so (Q4_1 layers, a Q8_0 head), so `q4_1` of its
dequantized float32 weights gives back the file's own blocks. A weight whose input width is not a multiple of 32
keeps a float32 product.

Why: a 4-bit copy reads ~0.56 bytes a weight against float32's 4 and int8's ~1.0, so a self-draft made this way
(`draft_quantization: q4_1`) costs a fraction of a float32 target's step, and a float model a user brings gets
llama.cpp's formats without a conversion step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from decodekit.api.huge_pages import on_huge_pages
from decodekit.api.models import StoredWeight
from decodekit.execution.fused.stored_matrices import BLOCK_FORMATS, GgufMatrix, LayerMatrix, StackMaker
from decodekit.execution.fused.weight_matrices import QUANTIZATIONS, Matrix, quantized_matrix
from decodekit.execution.kernels.native import NativeKernels

HEAD_FORMATS = {"q4_0": "Q8_0", "q4_1": "Q8_0", "q8_0": "Q8_0"}
"""The LM head's format under each (llama.cpp keeps the output weights at 6-8 bits)."""
BLOCK_WIDTH = 32
"""Weights per block in every `BLOCK_FORMATS` format: a quantized weight's input width must divide by it."""
COPY_QUANTIZATIONS = (*QUANTIZATIONS, *BLOCK_FORMATS)
"""Every quantization that copies a float model's weights (int8 and bf16 panels, GGUF blocks)."""


def quantize_blocks(weight: torch.Tensor, fmt: str) -> StoredWeight:
    """`weight` `[out, in]` (any float dtype, `in` a multiple of 32) as GGUF `fmt` blocks ("Q4_0", "Q4_1",
    "Q8_0"), quantized as ggml's reference quantizer does, on huge pages where available.

    Raises:
        ValueError: the width does not divide into blocks, or gguf-py cannot quantize `fmt`.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out_dim, in_dim = weight.shape
    if in_dim % BLOCK_WIDTH:
        raise ValueError(f"a {fmt} weight's input width must be a multiple of {BLOCK_WIDTH}, not {in_dim}")
    values = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    blocks = np.ascontiguousarray(quantize(values, GGMLQuantizationType[fmt]))
    return StoredWeight(fmt, on_huge_pages(torch.from_numpy(blocks)), (out_dim, in_dim))


def copy_of(quantization: str, weight: torch.Tensor, bias: torch.Tensor | None, native: NativeKernels,
            bf16_gemm: bool = False, head: bool = False) -> LayerMatrix:
    """The `quantization`'s copy of `weight` `[out, in]` (with its bias) on the native kernels: int8 or bf16 panels
    (`weight_matrices.quantized_matrix`), or GGUF blocks ("q4_0", "q4_1", "q8_0"; the LM head's format with `head`;
    a float32 product where the width does not divide into blocks)."""
    if quantization not in BLOCK_FORMATS:
        return quantized_matrix(quantization, bf16_gemm)(weight, bias, native)
    if weight.shape[1] % BLOCK_WIDTH:
        return Matrix(weight.detach().to(torch.float32).contiguous(), bias, False, native)
    fmt = HEAD_FORMATS[quantization] if head else BLOCK_FORMATS[quantization]
    return GgufMatrix([quantize_blocks(weight, fmt)], bias, native)


def copies_maker(quantization: str, bf16_gemm: bool, native: NativeKernels, lm_head: nn.Module) -> StackMaker:
    """Makes the `quantization`'s copy (`copy_of`) of linear layers' weights stacked by output rows (the fused
    decoder's q/k/v and gate/up), `lm_head` in the head's format."""

    def make(modules: Sequence[nn.Linear], bias: torch.Tensor | None) -> LayerMatrix:
        weights = [module.weight for module in modules]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return copy_of(quantization, weight, bias, native, bf16_gemm, head=len(modules) == 1 and modules[0] is lm_head)

    return make
