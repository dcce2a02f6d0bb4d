"""Model loading: local Hugging Face folders, hub ids, GGUF files, the bundled default model and tiny test models."""

from decodekit.models.loader import (
    BUNDLED_MODEL_NAME,
    LoadedModel,
    ModelLoader,
    builtin_model_loaders,
    check_paged_attention_support,
    default_dtype,
    load_model,
    resolve_dtype,
)

__all__ = [
    "BUNDLED_MODEL_NAME",
    "LoadedModel",
    "ModelLoader",
    "builtin_model_loaders",
    "check_paged_attention_support",
    "default_dtype",
    "load_model",
    "resolve_dtype",
]
