"""Model loading: local Hugging Face folders, hub ids, GGUF files, the bundled default model and tiny test models."""

from decodekit.models.loader import (
    ACCEPTED_MODELS,
    BUNDLED_MODEL_NAME,
    LoadedModel,
    ModelLoader,
    auto_dtype,
    builtin_model_loaders,
    check_paged_attention_support,
    default_dtype,
    find_loader,
    load_model,
    resolve_dtype,
    resolve_model,
)

__all__ = [
    "ACCEPTED_MODELS",
    "BUNDLED_MODEL_NAME",
    "LoadedModel",
    "ModelLoader",
    "auto_dtype",
    "builtin_model_loaders",
    "check_paged_attention_support",
    "default_dtype",
    "find_loader",
    "load_model",
    "resolve_dtype",
    "resolve_model",
]
