"""Faster products for models the fused decoder cannot take (Gemma, Phi-3, GPT-2, ...): their own linear layers,
re-laid in place and multiplied the fused decoder's way.

The fused decoder rewrites the whole forward of Llama-family models. Every other architecture runs its own
transformers modules, where a batch-1 float32 step is mostly `nn.Linear` products reading `[out, in]` weights on one
core (a SmolLM2-shaped Gemma 3: 68 ms per step, 0.98x transformers). Here each plain `nn.Linear` of a model decodekit
loaded itself keeps its module but multiplies through the fused decoder's `_Matrix`:

- the weight is re-laid column-major in place (the module's parameter becomes a transposed view of the new buffer,
  values unchanged, nothing stored twice), except where the input is wider than the output (an MLP's down
  projection), which streams faster row-major for one row and keeps its layout;
- with the native kernels, 1 row (and up to 8 of a column-major weight) runs `dk_gemv` on every thread;
- with prepacking, a oneDNN-blocked copy serves 2-128 rows.

The module's `forward` is replaced on the instance, so transformers' own code (and `generate` on the same object)
calls the same products. Only models decodekit loaded are touched, as for the fused decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from decodekit.core.fused_decoder import _column_major, _Matrix, _share
from decodekit.core.native_kernels import NativeKernels


def relay_linears(model: Any, prepack: bool, native: NativeKernels | None) -> int:
    """Re-lay every plain float32 `nn.Linear` of `model` on the CPU and route its forward through a `_Matrix`.

    The output embeddings are included; where they are tied to the input embeddings, both keep sharing one
    parameter. Returns how many linear layers now run this way.
    """
    head = model.get_output_embeddings()
    embeddings = model.get_input_embeddings()
    count = 0
    with torch.no_grad():
        for module in list(model.modules()):
            if type(module) is not nn.Linear or module.weight.dtype != torch.float32:
                continue
            if module.weight.device.type != "cpu" or module.weight.is_meta:
                continue
            tied = module is head and embeddings is not None and module.weight is embeddings.weight
            _route(module, prepack, native, tied_to=embeddings if tied else None)
            count += 1
    return count


def _route(module: nn.Linear, prepack: bool, native: NativeKernels | None, tied_to: Any = None) -> None:
    """Re-lay one linear layer and make its forward the `_Matrix` product."""
    weight = module.weight
    if weight.shape[1] > weight.shape[0]:
        col = weight.detach().t()  # a wide input, a narrow output: row-major streams faster for one row
    else:
        col = _column_major(weight)
        if tied_to is not None:
            # one parameter for both: lookups then read a strided row (cheap), the head a column-major matrix
            relaid = nn.Parameter(col.t(), requires_grad=False)
            tied_to.weight = relaid
            module.weight = relaid
        else:
            _share(module, col.t())
    bias = module.bias.detach() if module.bias is not None else None
    matrix = _Matrix(col, bias, prepack, native)
    out_features = module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return matrix(rows).view(*x.shape[:-1], out_features)

    module.forward = forward  # type: ignore[method-assign, assignment]
