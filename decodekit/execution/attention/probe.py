"""What a model's attention layers ask of the attention function, learned once by running the model on two tokens.

The paged attention (`kv_cache.paged_attention_forward`) computes causal attention over each sequence's context,
with the per-layer keywords it knows (`sliding_window`, `softcap`, `s_aux`). transformers passes each architecture's
own extras to the attention function as keywords, and an unknown one would otherwise be ignored without a word: a
model family that adds a bias, sparse indices, data-dependent sinks or a bidirectional flag would be served wrong
tokens (gpt-oss's `s_aux` was, until it was implemented). So the model runs once through a recording attention
function when it is loaded, and a keyword the paged attention does not implement refuses the model by name.

The same run reads each layer's KV head count and head size from the keys themselves, which a config can misstate
(`num_key_value_heads` set on an architecture that ignores it), so the KV pool gets the width the layers write.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

log = logging.getLogger("decodekit.runner")

PROBE_NAME = "decodekit_probe"
# keywords the paged attention implements
HANDLED_KEYWORDS = frozenset({"sliding_window", "softcap", "s_aux"})
# keywords that do not change causal attention over a sequence's context at inference: bookkeeping the paged
# attention reads from its own layout (positions, the cache), and dropout (0 in eval mode)
INERT_KEYWORDS = frozenset({
    "scaling", "dropout", "position_ids", "cache_position", "output_attentions", "use_cache", "past_key_values",
    "past_key_value", "paged_kv_cache", "position_embeddings", "return_dict", "layer_idx", "output_router_logits",
})
_PROBE_ATTRIBUTE = "_decodekit_attention_probe"


@dataclass(frozen=True)
class AttentionProbe:
    """What the attention function saw in one forward pass of a model."""

    layer_indices: tuple[int | None, ...]  # each call's `module.layer_idx`, in call order (None where missing)
    kv_shapes: tuple[tuple[int, int], ...]  # each call's (KV heads, head size), read from its keys
    keywords: frozenset[str]  # keywords passed with a value other than None (and other than `is_causal=True`)

    def refusal(self, arch: str) -> str | None:
        """Why the paged attention cannot serve these layers, or None where it can."""
        if "is_causal" in self.keywords:
            return (f"{arch}: its attention is bidirectional (is_causal false), and decodekit's paged attention is "
                    "causal; it serves decoder-only language models")
        unknown = sorted(self.keywords - HANDLED_KEYWORDS - INERT_KEYWORDS)
        if unknown:
            return (f"{arch}: its attention passes {unknown} to the attention function, which decodekit's paged "
                    f"attention does not implement (it implements {sorted(HANDLED_KEYWORDS)}); serving it would "
                    "give wrong tokens")
        if None in self.layer_indices:
            return f"{arch}: its attention modules carry no layer_idx, which the paged KV cache is indexed by"
        if len(set(self.kv_shapes)) > 1:
            return (f"{arch}: its layers write keys of different shapes {sorted(set(self.kv_shapes))} (KV heads, "
                    "head size), and the paged KV pool holds one shape")
        return None


def _recording_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function that records what it is given (on `_RECORDS`) and returns zeros of the right shape:
    the probe reads the call, not the result."""
    keywords = {name for name, v in kwargs.items() if v is not None and not (name == "is_causal" and v is True)}
    if attention_mask is not None:
        keywords.add("attention_mask")
    causal = kwargs.get("is_causal")
    if causal is None:  # as SDPA decides it: the keyword, else the module's flag
        causal = getattr(module, "is_causal", True)
    if causal is False:
        keywords.add("is_causal")
    _RECORDS.append((getattr(module, "layer_idx", None), (int(key.shape[1]), int(key.shape[3])), keywords))
    batch, heads, tokens, _ = query.shape
    return query.new_zeros(batch, tokens, heads, value.shape[-1]), None


_RECORDS: list[tuple[int | None, tuple[int, int], set[str]]] = []
_PROBING = threading.Lock()  # one probe at a time: `_RECORDS` and the configs' switched attention are shared
AttentionInterface.register(PROBE_NAME, _recording_attention)


def probe_attention(model: Any) -> AttentionProbe | None:
    """Run `model` once on two tokens through the recording attention and return what its layers passed (cached on
    the model: later calls, after its weights were re-laid or freed, return the first answer). None where the
    forward fails or calls no attention function (the caller then trusts the config)."""
    if _PROBE_ATTRIBUTE in model.__dict__:
        cached: AttentionProbe | None = model.__dict__[_PROBE_ATTRIBUTE]
        return cached
    with _PROBING:
        probe = _run_probe(model)
    model.__dict__[_PROBE_ATTRIBUTE] = probe
    return probe


def _run_probe(model: Any) -> AttentionProbe | None:
    config = model.config
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.append(text)
    previous = [c._attn_implementation for c in configs]
    device = next(model.parameters()).device
    _RECORDS.clear()
    try:
        for c in configs:
            c._attn_implementation = PROBE_NAME
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    except Exception as exc:  # any failure leaves the config's word; the engine's forward will tell
        log.warning("%s: the attention probe's forward failed (%r); KV shapes are read from the config and the "
                    "attention keywords are not checked", type(model).__name__, exc)
        return None
    finally:
        for c, impl in zip(configs, previous, strict=True):
            c._attn_implementation = impl
    records = list(_RECORDS)
    _RECORDS.clear()
    if not records:
        return None
    return AttentionProbe(tuple(r[0] for r in records), tuple(r[1] for r in records),
                          frozenset().union(*(r[2] for r in records)))
