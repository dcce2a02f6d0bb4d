"""Built-in model loaders: the bundled SmolLM2, GGUF files, local HF folders and hub ids."""

from __future__ import annotations

from collections.abc import Callable

from decodekit import hookimpl
from decodekit.models import builtin_model_loaders


@hookimpl
def decodekit_register_model_loaders(register: Callable[..., None]) -> None:
    """Register the built-in loaders, in the order they are tried."""
    for loader in builtin_model_loaders():
        register(loader)
