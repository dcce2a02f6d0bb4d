"""A model's geometry as the KV pool sees it: layers, KV heads, head size, context length, vocabulary."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from decodekit.api.errors import UnsupportedModelError
from decodekit.execution.attention.kv_cache import SUPPORTED_LAYER_TYPES
from decodekit.execution.attention.probe import probe_attention

log = logging.getLogger("decodekit.runner")


@dataclass(frozen=True)
class ModelGeometry:
    """What the KV pool must look like for a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int


def text_config(model: Any) -> Any:
    """The config of the language model (the text part of a multimodal config)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def model_geometry(model: Any, fused_refusal: str | None, probe: bool = True) -> ModelGeometry:
    """Read layer count, KV heads, head size and context length from a HF config (refusing what we can't page).

    Any model the fused decoder cannot take runs once on two tokens through a recording attention function
    (`attention_probe`): an attention keyword the paged attention does not implement refuses the model, and the KV
    heads and head size its layers write override the config's.

    Sliding-window layers and attention-logit soft-capping are served by the paged attention itself (transformers
    passes `sliding_window` and `softcap` to the attention function per layer), so they keep the whole context.

    `fused_refusal` is `fused_decoder_refusal(model)`, which the plan asks once per model; `probe` False keeps the
    config's geometry (a skeleton with no weights to run: `plan.plan_from_config`)."""
    config = text_config(model)
    arch = type(model).__name__
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise UnsupportedModelError(f"{arch}: layer types {unsupported} are not supported by decodekit's paged "
                                    f"attention yet (it serves {list(SUPPORTED_LAYER_TYPES)})")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_len = getattr(config, "max_position_embeddings", None) or 2048
    num_layers = config.num_hidden_layers
    # models the fused decoder can take pass known keywords (tests/execution/test_attention_probe.py holds their
    # architectures to it) and state their KV shapes; skipping their probe saves a forward at start-up (150-500 ms
    # for SmolLM2 on 2 cores). A variant it refuses (a bidirectional Gemma, say) is probed.
    probed = None if fused_refusal is None or not probe else probe_attention(model)
    if probed is not None:
        reason = probed.refusal(arch)
        if reason is not None:
            raise UnsupportedModelError(reason)
        if probed.kv_shapes[0] != (kv_heads, head_dim):
            # the layers' own keys decide the pool's width (a config may set an attribute its architecture ignores)
            log.info("%s: the layers write %d KV heads of size %d (the config says %d of %d)", arch,
                     *probed.kv_shapes[0], kv_heads, head_dim)
            kv_heads, head_dim = probed.kv_shapes[0]
        deepest = max(index for index in probed.layer_indices if index is not None)
        if deepest >= num_layers:
            raise UnsupportedModelError(f"{arch}: an attention layer has index {deepest}, beyond the config's "
                                        f"{num_layers} hidden layers")
    return ModelGeometry(num_layers, kv_heads, head_dim, max_len, config.vocab_size)
