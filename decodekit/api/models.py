"""The model-loader contract: what a loader plugin returns and how it is described.

Loaders are registered through the `decodekit_register_model_loaders` hook; `decodekit.models` holds the built-in
ones and `load_model`, which tries the registered loaders first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: importing the contract (and `decodekit --help`) does not import torch
    import torch


@dataclass
class LoadedModel:
    """A model ready for the engine: the HF module, its tokenizer, and where it came from."""

    model: Any
    tokenizer: Any
    name: str
    dtype: torch.dtype
    device: torch.device
    owned: bool = True  # loaded by decodekit (so its weights may be re-laid), not an object the caller passed


@dataclass(frozen=True)
class ModelLoader:
    """A named way to load a model: `can_load(spec)` says whether it applies, `load(spec, dtype, device)` does it.

    `check(spec)`, optional, says without loading weights whether a spec `can_load` accepted is really there (the
    file exists, the model is in the local cache): it raises `ModelLoadError` saying what is missing, and
    `decodekit recipe check` calls it. Without one, a spec the loader accepts passes the check.
    """

    name: str
    can_load: Callable[[str], bool]
    load: Callable[[str, torch.dtype, torch.device], tuple[Any, Any]]
    check: Callable[[str], None] | None = None
