"""GGUF quantized blocks for tests: random blocks of each format the native products take (quants drawn at random,
fp16 scales finite and of a weight-like size), gguf-py's own dequantization as the reference, and a tiny Llama whose
weights are such blocks, served by a model loader that keeps them as stored (`TinyGgufLoader`)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch

from decodekit import hookimpl
from decodekit.api.models import ModelLoader, StoredWeight
from decodekit.execution.kernels.quant import GGUF_FORMATS
from decodekit.models.tiny import tiny_model, tiny_tokenizer

# Byte offsets of each format's fp16 fields in a block, with a size for them that gives weights of ~0.01-0.1
# (scales times quants): d (and m / dmin) of Q4_0, Q4_1, Q8_0, Q4_K; Q6_K's d sits at the block's end.
HALF_FIELDS = {
    "Q4_0": ((0, 0.01),),
    "Q4_1": ((0, 0.01), (2, 0.08)),
    "Q8_0": ((0, 0.0005),),
    "Q4_K": ((0, 0.0004), (2, 0.0004)),
    "Q6_K": ((208, 0.00002),),
}


def random_blocks(fmt: str, rows: int, width: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """`rows` rows of `width` weights in `fmt` (`uint8 [rows, bytes per row]`): random quants and sub-block scales,
    fp16 fields normal with `HALF_FIELDS`' size times `scale`."""
    rng = np.random.default_rng(seed)
    _, per_block, size = GGUF_FORMATS[fmt]
    blocks = rng.integers(0, 256, size=(rows, width // per_block, size), dtype=np.uint8)
    for offset, std in HALF_FIELDS[fmt]:
        halves = (rng.standard_normal(blocks.shape[:2]) * std * scale).astype(np.float16)
        blocks[:, :, offset:offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def gguf_dequantize(blocks: np.ndarray, fmt: str, width: int) -> torch.Tensor:
    """gguf-py's float32 weights of `blocks` (what transformers loads a GGUF as), `[rows, width]`."""
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, GGMLQuantizationType[fmt]), dtype=np.float32)
                            ).reshape(blocks.shape[0], width)


TINY_GGUF = "tiny-gguf"
"""The spec `TinyGgufLoader` loads."""

# the format each projection of the tiny model is stored in: every format, and q/k/v stacked from three of them
TINY_FORMATS = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_K", "gate_proj": "Q6_K",
                "up_proj": "Q4_1", "down_proj": "Q4_K", "lm_head": "Q8_0"}


@functools.cache
def tiny_gguf_model() -> tuple[Any, dict[str, StoredWeight]]:
    """A tiny Llama (hidden 256, so every format's blocks fit a row) whose linear weights are random GGUF blocks
    (`TINY_FORMATS`) dequantized by gguf-py, and those blocks by parameter name."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=512)
    stored: dict[str, StoredWeight] = {}
    with torch.no_grad():
        for index, (name, module) in enumerate(model.named_modules()):
            kind = name.rsplit(".", 1)[-1]
            if kind not in TINY_FORMATS:
                continue
            fmt, (rows, width) = TINY_FORMATS[kind], module.weight.shape
            blocks = random_blocks(fmt, rows, width, seed=index, scale=8.0 if kind == "lm_head" else 1.0)
            module.weight.copy_(gguf_dequantize(blocks, fmt, width))
            stored[f"{name}.weight"] = StoredWeight(fmt, torch.from_numpy(blocks), (rows, width))
    return model, stored


class TinyGgufLoader:
    """A plugin registering the `tiny-gguf` loader: `tiny_gguf_model()` (a fresh copy per load), with its blocks as
    the weights the file stores (`ModelLoader.stored`)."""

    @hookimpl
    def decodekit_register_model_loaders(self, register: Any) -> None:
        def load(spec: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
            return copy.deepcopy(tiny_gguf_model()[0]).to(dtype=dtype, device=device), tiny_tokenizer()

        register(ModelLoader(TINY_GGUF, lambda spec: spec == TINY_GGUF, load,
                             stored=lambda spec, model: dict(tiny_gguf_model()[1])))
