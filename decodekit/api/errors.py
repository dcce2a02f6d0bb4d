"""The DecodeKitError hierarchy: every user-facing failure is one of these, with a message that says what to do."""

from __future__ import annotations


class DecodeKitError(Exception):
    """Base class of every error decodekit raises on purpose (the CLI prints these without a traceback)."""


class ModelLoadError(DecodeKitError):
    """A model could not be found, loaded or used (unknown name, missing file, unsupported architecture)."""


class UnsupportedModelError(ModelLoadError):
    """The model's attention does not go through transformers' attention interface, so it cannot be paged."""


class ConfigError(DecodeKitError):
    """A parameter, recipe value or option is invalid."""


class RecipeError(ConfigError):
    """A recipe file (or a `--set` override, or a line of its prompts file) is invalid; the message names the key."""


class RequestError(DecodeKitError):
    """A single request is invalid (e.g. its prompt is longer than the model's context); it fails alone."""


class PluginError(DecodeKitError):
    """A plugin is unknown, failed to load, or raised while running."""


class ProcessorError(PluginError):
    """A logits processor raised, or returned something the engine cannot use (a tensor of the wrong shape, dtype
    or device; a row with no finite logit). The message names the processor; the engine fails the requests whose
    rows it was processing and goes on serving the others."""


class EngineDeadError(DecodeKitError):
    """The engine hit an unrecoverable error and stopped serving."""
