"""Faster products for models the fused decoder cannot take (Gemma, Phi-3, GPT-2, ...): their own linear layers,
multiplied the fused decoder's way.

The fused decoder rewrites the whole forward of Llama-family models. Every other architecture runs its own
transformers modules, where a batch-1 float32 step is mostly `nn.Linear` products reading `[out, in]` weights on one
core (a SmolLM2-shaped Gemma 3: 68 ms per step, 0.98x transformers). Here each plain `nn.Linear` of a model decodekit
loaded itself keeps its module but multiplies through the fused decoder's `Matrix`:

- the weight keeps its `[out, in]` layout (made contiguous in place where it is not);
- with the native kernels, 1 to 8 rows run `dk_gemv` on every thread;
- with prepacking, a oneDNN-blocked copy serves 2-128 rows.

The module's `forward` is replaced on the instance, so transformers' own code (and `generate` on the same object)
calls the same products. Only models decodekit loaded are touched, as for the fused decoder.

With a `quantization` ("int8", "bf16", or a GGUF block format "q4_0", "q4_1", "q8_0"), each layer instead multiplies
through the fused decoder's compressed copies (`Int8Matrix`, `Bf16Matrix`, `GgufMatrix`: the native panel and block
kernels, float32 activations), so every architecture gets the
quantized weights the fused decoder gives Llama-family models. A model object passed in keeps its weights (its
forward now runs the compressed products); a model decodekit loaded has each layer's float32 weight freed once its
copy serves it, except the output embeddings (kept for the input embeddings tied to them and for proposers that
reuse the LM head).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from decodekit.execution.fused.block_copies import copy_of
from decodekit.execution.fused.decoder import _own_rows, _trim_heap
from decodekit.execution.fused.weight_matrices import Matrix
from decodekit.execution.kernels.native import NativeKernels


def relay_linears(model: Any, prepack: bool, native: NativeKernels | None, quantization: str | None = None,
                  release: bool = False, bf16_gemm: bool = False) -> int:
    """Route the forward of every plain float32 `nn.Linear` of `model` on the CPU through a `Matrix` (or,
    with a `quantization`, through a compressed copy of its weight; `native` is then required).

    The output embeddings are included; where they are tied to the input embeddings, both keep sharing one
    parameter. With `release` (a model decodekit loaded), quantized layers' own weights are freed, the output
    embeddings' excepted. Returns how many linear layers now run this way.
    """
    embeddings = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    count = 0
    # float32 weights; bf16 ones too for bf16 copies (a bf16 model whose other weights are widened after)
    dtypes = (torch.float32,) if quantization != "bf16" else (torch.float32, torch.bfloat16)
    with torch.no_grad():
        for module in list(model.modules()):
            if type(module) is not nn.Linear or module.weight.dtype not in dtypes:
                continue
            if module.weight.device.type != "cpu" or module.weight.is_meta:
                continue
            if quantization is None:
                _route(module, prepack, native)
                if tied and module is head:  # its rows moved (onto huge pages): the lookups follow them
                    embeddings.weight = head.weight
            else:
                assert native is not None, "quantized products run on the native kernels"
                matrix = copy_of(quantization, module.weight, module.bias, native, bf16_gemm, head=module is head)
                _set_forward(module, matrix)
                if release and module is not head and module.weight is not embeddings.weight:
                    module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype,
                                                             device="meta"), requires_grad=False)
            count += 1
    if quantization is None or release:  # rows moved onto huge pages, or released: their old blocks go back
        _trim_heap()
    return count


def _route(module: nn.Linear, prepack: bool, native: NativeKernels | None) -> None:
    """Make the forward of one linear layer the `Matrix` product of its weight."""
    bias = module.bias.detach() if module.bias is not None else None
    _set_forward(module, Matrix(_own_rows(module), bias, prepack, native))


def _set_forward(module: nn.Linear, matrix: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make `matrix` (a `[rows, in] -> [rows, out]` product, bias included) the forward of `module`."""
    out_features = module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return matrix(rows).view(*x.shape[:-1], out_features)

    module.forward = forward  # type: ignore[method-assign, assignment]
