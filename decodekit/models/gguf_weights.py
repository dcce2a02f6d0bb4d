"""A GGUF file's quantized weights as stored, matched to the parameters of the model transformers loads from it.

transformers loads a GGUF by dequantizing every tensor to float (gguf-py's `dequantize`), renaming it to the
model's parameter (`get_gguf_hf_weights_map`) and, for some architectures, reordering its rows (Llama's q and k
projections are stored in the interleaved RoPE layout: `LlamaTensorProcessor`). `read_stored_weights` keeps the
tensors in the formats the native products take (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) as their blocks, under the same
names and in the same row order: the reordering is found by running transformers' own processor over the row
indices, so it is whatever transformers does. A tensor whose processing is not a row reordering, or whose sampled
rows do not dequantize to exactly the model's float32 weights, is left out (the module's weight then serves it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decodekit.api.huge_pages import on_huge_pages
from decodekit.api.models import StoredWeight

log = logging.getLogger("decodekit.models")

STORED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
"""The GGUF tensor types kept as stored (the native quantized products take them)."""

# Rows of each tensor dequantized by gguf-py and compared with the model's weights when stored weights are read
# (spread over the rows, so a wrong reordering of heads shows).
_CHECKED_ROWS = 16


def read_stored_weights(path: Path, model: Any) -> dict[str, StoredWeight]:
    """The weights of `model` (loaded from the GGUF at `path` by transformers, in float32; or a meta-device skeleton
    of it, whose weights are then not compared and whose `data` stays on the meta device) that the file stores in
    one of `STORED_FORMATS`, by parameter name; a parameter tied to one (a tied LM head) is listed under its own
    name too."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters(remove_duplicate=False))
    stored: dict[str, StoredWeight] = {}
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        fmt = tensor.tensor_type.name
        if fmt not in STORED_FORMATS or name not in params or len(tensor.data.shape) != 2:
            continue
        param = params[name]
        out_dim, width = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dimensions innermost first
        order = _row_order(processor, tensor.name, out_dim)
        if order is None or tuple(param.shape) != (out_dim, width):
            log.info("%s: %s kept dequantized (its rows are not a reordering of the file's)", path.name, name)
            continue
        data = np.asarray(tensor.data)
        if param.device.type == "meta":
            blocks = torch.empty(data.shape, dtype=torch.uint8, device="meta")
        else:
            # on huge pages: a batch-1 step streams every block (`api.huge_pages`)
            blocks = on_huge_pages(torch.from_numpy(np.ascontiguousarray(data[order])))
            if not _matches(blocks, fmt, param):
                log.warning("%s: %s's %s blocks do not dequantize to the loaded weight; it runs dequantized",
                            path.name, name, fmt)
                continue
        stored[name] = StoredWeight(fmt, blocks, (out_dim, width))
    # a parameter tied to a stored one (the LM head sharing the embeddings) is stored under its own name too
    by_param = {id(params[name]): weight for name, weight in stored.items()}
    for name, param in params.items():
        if name not in stored and id(param) in by_param:
            stored[name] = by_param[id(param)]
    return stored


def stored_formats(stored: dict[str, StoredWeight]) -> dict[str, int]:
    """How many distinct weights of each format `stored` holds (tied names counted once), for the plan's reasons."""
    counts: dict[str, int] = {}
    for weight in {id(w): w for w in stored.values()}.values():
        counts[weight.format] = counts.get(weight.format, 0) + 1
    return dict(sorted(counts.items()))


def _row_order(processor: Any, gguf_name: str, rows: int) -> np.ndarray | None:
    """The file row each of the model's rows comes from: transformers' processor run over the row indices; None
    where it does not just reorder rows."""
    try:
        moved = processor.process(weights=np.arange(rows, dtype=np.int64).reshape(rows, 1), name=gguf_name)
    except Exception as exc:  # a processor that needs what a real tensor brings: not a plain reordering
        log.debug("row order of %s: %r", gguf_name, exc)
        return None
    order = np.asarray(moved.weights).reshape(-1)
    if order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return order


def _matches(blocks: torch.Tensor, fmt: str, param: torch.Tensor) -> bool:
    """Whether sampled rows of `blocks` dequantize (gguf-py) to exactly `param`'s float32 rows."""
    from gguf import GGMLQuantizationType, dequantize

    if param.dtype != torch.float32:
        return False
    rows = np.unique(np.linspace(0, blocks.shape[0] - 1, _CHECKED_ROWS).astype(np.int64))
    want = param.detach()[torch.from_numpy(rows)]
    got = dequantize(blocks.numpy()[rows], GGMLQuantizationType[fmt]).reshape(want.shape)
    return bool(torch.equal(torch.from_numpy(np.ascontiguousarray(got, dtype=np.float32)), want))
