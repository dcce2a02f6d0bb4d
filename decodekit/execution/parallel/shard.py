"""A rank's shard of a model, Megatron-style, and the all-reduce after each row-parallel product.

Per decoder layer, rank r of N keeps:

- column-parallel: the rows of q/k/v for its `heads / N` query heads and `kv_heads / N` key/value heads (with
  their biases), and the rows of gate/up for its `intermediate / N` MLP columns; its activations of those products
  are its own, and attention runs on its heads alone over its share of the KV pool;
- row-parallel: the matching input columns of o and down, whose partial products are summed over the ranks by one
  all-reduce each (the residual is added once, after the sum);
- replicated: the embeddings, the norms and the LM head (logits are only read on rank 0; the others ask for none).

The shard is cut from the module's own `nn.Linear` weights in place (new, contiguous tensors of 1/N the size), so
the fused decoder and transformers' forward both run it unchanged: each reads its head counts from the
projections' widths (`fused.blocks.head_counts`, transformers' `view(..., -1, head_dim)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from decodekit.execution.fused.stored_matrices import LayerMatrix
from decodekit.execution.parallel.group import CommCounter, all_reduce

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


def _layers(model: Any) -> list[Any]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []


def _split_sizes(model: Any) -> tuple[int, int, int]:
    """The query heads, key/value heads and MLP width of the model's first layer, from its projections."""
    layer = _layers(model)[0]
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = int(attn.head_dim)
    if hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v stacked by rows; gate and up stacked by rows
        heads = attn.o_proj.weight.shape[1] // head_dim
        kv_heads = (attn.qkv_proj.weight.shape[0] // head_dim - heads) // 2
        return heads, kv_heads, mlp.gate_up_proj.weight.shape[0] // 2
    return (attn.q_proj.weight.shape[0] // head_dim, attn.k_proj.weight.shape[0] // head_dim,
            mlp.gate_proj.weight.shape[0])


def shard_refusal(model: Any, world_size: int) -> str | None:
    """Why `model` cannot be split over `world_size` ranks (naming the numbers that do not divide), or None."""
    layers = _layers(model)
    if not layers:
        return f"{type(model).__name__} has no `model.layers` of decoder layers to split"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        fused = attn is not None and hasattr(attn, "qkv_proj")
        names = (("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")) if fused else \
            (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"))
        for part, wanted in zip((attn, mlp), names):
            if part is None or any(type(getattr(part, n, None)) is not nn.Linear for n in wanted):
                return (f"{type(model).__name__}'s decoder layers are not the Llama block's plain linear layers "
                        f"({', '.join(wanted)}), which tensor parallelism splits")
    heads, kv_heads, intermediate = _split_sizes(model)
    sizes = {"attention heads": heads, "key/value heads": kv_heads, "MLP width (intermediate_size)": intermediate}
    bad = [f"{value} {name}" for name, value in sizes.items() if value % world_size]
    if bad:
        listed = _listing([f"{value} {name}" for name, value in sizes.items()])
        return (f"tensor_parallel_size {world_size}: the model's {listed} must each divide by {world_size}, "
                f"and {_listing(bad)} {'does' if len(bad) == 1 else 'do'} not")
    return None


def _listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _rows(weight: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([weight[start:end] for start, end in spans]).contiguous()


def _set(module: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    module.weight = nn.Parameter(weight, requires_grad=False)
    # nn.Linear's own way to have no bias (its `bias` is annotated as always a Parameter)
    module.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
    module.out_features, module.in_features = weight.shape


def _column(module: nn.Linear, spans: list[tuple[int, int]]) -> None:
    """Keep the output rows in `spans` (and their bias)."""
    bias = None if module.bias is None else _rows(module.bias.detach(), spans)
    _set(module, _rows(module.weight.detach(), spans), bias)


def _row(module: nn.Linear, start: int, end: int, rank: int) -> None:
    """Keep the input columns `start:end`; the bias stays on rank 0 only (the all-reduce would add it N times)."""
    bias = module.bias.detach().clone() if module.bias is not None and rank == 0 else None
    _set(module, module.weight.detach()[:, start:end].contiguous(), bias)


@torch.no_grad()
def shard_model(model: Any, rank: int, world_size: int) -> None:
    """Cut `model`'s decoder layers down to rank `rank`'s shard of `world_size`, in place (see the module's
    docstring for what each rank keeps).

    Raises:
        ValueError: the model cannot be split that way (`shard_refusal`'s reason).
    """
    refusal = shard_refusal(model, world_size)
    if refusal is not None:
        raise ValueError(refusal)
    heads, kv_heads, intermediate = _split_sizes(model)
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        d = int(attn.head_dim)
        q_part, kv_part, mlp_part = heads // world_size * d, kv_heads // world_size * d, intermediate // world_size
        q = (rank * q_part, (rank + 1) * q_part)
        kv = (rank * kv_part, (rank + 1) * kv_part)
        cols = (rank * mlp_part, (rank + 1) * mlp_part)
        if hasattr(attn, "qkv_proj"):  # Phi-3: q rows, then k rows, then v rows; gate rows then up rows
            k0, v0 = heads * d, heads * d + kv_heads * d
            _column(attn.qkv_proj, [q, (k0 + kv[0], k0 + kv[1]), (v0 + kv[0], v0 + kv[1])])
            _column(mlp.gate_up_proj, [cols, (intermediate + cols[0], intermediate + cols[1])])
        else:
            _column(attn.q_proj, [q])
            _column(attn.k_proj, [kv])
            _column(attn.v_proj, [kv])
            _column(mlp.gate_proj, [cols])
            _column(mlp.up_proj, [cols])
        _row(attn.o_proj, *q, rank)
        _row(mlp.down_proj, *cols, rank)


class RowParallel:
    """A fused-decoder product over a row-parallel shard (o, down): the rank's partial product, summed over the
    ranks by one all-reduce, then the residual added once."""

    def __init__(self, inner: LayerMatrix, counter: CommCounter) -> None:
        self.inner = inner
        self.counter = counter

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T` summed over the ranks (`+ residual`)."""
        out = all_reduce(self.inner(x), self.counter)
        return out if residual is None else out.add_(residual)


def row_parallel_fused(fused: Any, counter: CommCounter) -> None:
    """Make the fused decoder's o and down products of every layer all-reduce their partial sums."""
    for layer in fused.layers:
        # the layer's products are called, never inspected, by the per-layer paths; the native layer stack (which
        # does inspect them) is off under tensor parallelism (`plan.py`)
        layer.o = cast(LayerMatrix, RowParallel(layer.o, counter))
        layer.down = cast(LayerMatrix, RowParallel(layer.down, counter))


def row_parallel_hooks(model: Any, counter: CommCounter) -> list[Any]:
    """For transformers' own forward: a forward hook on every o_proj and down_proj that all-reduces its output
    (their biases are on rank 0 only: `shard_model`). Returns the hooks' handles."""
    def reduce(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return all_reduce(output, counter)

    hook: Callable[..., Any] = reduce
    return [getattr(part, name).register_forward_hook(hook)
            for layer in _layers(model)
            for part, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj"))]
