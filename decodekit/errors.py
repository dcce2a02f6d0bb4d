"""Moved to `decodekit.api.errors`; this import path stays for code written against earlier docs."""

from decodekit.api.errors import (
    ConfigError,
    DecodeKitError,
    EngineDeadError,
    ModelLoadError,
    PluginError,
    ProcessorError,
    RecipeError,
    RequestError,
    UnsupportedModelError,
)

__all__ = [
    "ConfigError",
    "DecodeKitError",
    "EngineDeadError",
    "ModelLoadError",
    "PluginError",
    "ProcessorError",
    "RecipeError",
    "RequestError",
    "UnsupportedModelError",
]
