"""The model-loader contract: what a loader plugin returns and how it is described.

Loaders are registered through the `decodekit_register_model_loaders` hook; `decodekit.models` holds the built-in
ones and `load_model`, which tries the registered loaders first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: importing the contract (and `decodekit --help`) does not import torch
    import torch


@dataclass(frozen=True)
class StoredWeight:
    """A weight `[out, in]` as its file stores it, for products that read it that way: a GGUF file's quantized
    blocks (`format` "Q4_0", "Q4_1", "Q8_0", "Q4_K" or "Q6_K"; `data` uint8 `[out, bytes per row]`, row o holding
    output o's blocks in the module's row order). `data` is on the meta device where only the plan is asked
    (`decodekit recipe check`)."""

    format: str
    data: torch.Tensor
    shape: tuple[int, int]


@dataclass
class LoadedModel:
    """A model ready for the engine: the HF module, its tokenizer, and where it came from."""

    model: Any
    tokenizer: Any
    name: str
    dtype: torch.dtype
    device: torch.device
    owned: bool = True  # loaded by decodekit (so its weights may be re-laid), not an object the caller passed
    stored: dict[str, StoredWeight] = field(default_factory=dict)
    """Weights kept as the file stores them, by the module's parameter name (tied parameters under each name); the
    module holds the same weights dequantized. The execution plan decides which of the two the products read."""


@dataclass(frozen=True)
class ModelLoader:
    """A named way to load a model: `can_load(spec)` says whether it applies, `load(spec, dtype, device)` does it.

    `check(spec)`, optional, says without loading weights whether a spec `can_load` accepted is really there (the
    file exists, the model is in the local cache): it raises `ModelLoadError` saying what is missing, and
    `decodekit recipe check` calls it. Without one, a spec the loader accepts passes the check.

    `stored(spec, model)`, optional, returns the weights of `model` (loaded by `load` in float32, or a meta-device
    skeleton of it) that the file holds in a compressed format the engine can multiply as stored
    (`StoredWeight`s by parameter name; their `data` on the meta device for a skeleton). Under `dtype: auto` on a
    CPU, `load_model` loads such a model in float32 and keeps them.
    """

    name: str
    can_load: Callable[[str], bool]
    load: Callable[[str, torch.dtype, torch.device], tuple[Any, Any]]
    check: Callable[[str], None] | None = None
    stored: Callable[[str, Any], dict[str, StoredWeight]] | None = None
