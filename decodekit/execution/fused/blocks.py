"""Which models the fused decoder takes, and how each architecture's decoder layer reads as its `_FusedLayer`: the
Llama block (Llama, Mistral, Qwen2, Qwen3 with its query/key norms), Gemma 1/2/3's (1 + w) norms, output norms, GELU
gating, score caps and RoPE tables per layer type, and Phi-3's already-fused projections.

`fused_decoder_refusal` says why a model cannot be fused; `block_fields`, `head_counts`, `qkv_bias_of` and
`layer_window` read a layer's norms, heads, biases and window for `FusedDecoder` (`fused_decoder.py`), which owns the
forward itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from decodekit.execution.attention.kv_cache import sliding_window

# Causal LMs whose decoder layers are exactly the Llama block (checked again module by module below).
LLAMA_BLOCK_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                       "Qwen3ForCausalLM"})
# Causal LMs with Gemma's blocks: the Llama block with (1 + w) RMSNorms, GELU-tanh gating and scaled embeddings
# (Gemma); plus a norm after attention and after the MLP, before each residual add, local and global layers and
# soft-capped scores and logits (Gemma 2); Gemma 2's block with per-head query/key norms instead of the score cap and
# a RoPE table per layer type (Gemma 3).
GEMMA_ARCHITECTURES = frozenset({"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"})
GEMMA3_BLOCK_ARCHITECTURES = frozenset({"Gemma3ForCausalLM"})  # a RoPE table per layer type
# The Llama block with q/k/v and gate/up already fused into one linear each (`qkv_proj`, `gate_up_proj`): Phi-3
PHI3_ARCHITECTURES = frozenset({"Phi3ForCausalLM"})
FUSABLE_ARCHITECTURES = LLAMA_BLOCK_ARCHITECTURES | GEMMA_ARCHITECTURES | PHI3_ARCHITECTURES


def fused_decoder_refusal(model: Any) -> str | None:
    """Why `model` cannot use the fused decoder, or None when it can."""
    arch = type(model).__name__
    if arch not in FUSABLE_ARCHITECTURES:
        return f"{arch} is not one of {sorted(FUSABLE_ARCHITECTURES)}"
    config = model.config
    gemma = arch in GEMMA_ARCHITECTURES
    if gemma:
        reason = gemma_refusal(model)
        if reason is not None:
            return reason
    elif getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "no `model.layers` / `model.rotary_emb`"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return "decoder layers differ from the Llama block"
        query_key_norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None for n in query_key_norms) and not all(is_rms_norm(n) for n in query_key_norms):
            return "decoder layers differ from the Llama block (query/key norms other than Qwen3's RMSNorms)"
        if arch != "GemmaForCausalLM" and gemma and not all(is_rms_norm(getattr(layer, n, None))
                                                            for n in _GEMMA_OUTPUT_NORMS):
            return f"decoder layers differ from {arch}'s block (its output norms)"
        found = [getattr(part, n, None) for part, n in projections(arch, attn, mlp)]
        parts = [p for p in found if type(p) is nn.Linear]
        if len(parts) != len(found):  # quantized or wrapped linears keep their own forward
            return "a projection is not a plain torch.nn.Linear"
        if arch in PHI3_ARCHITECTURES and parts[0].bias is not None:
            return "the fused q/k/v projection has a bias"
        if any(p.bias is not None for p in parts[-3:]):
            return "output or MLP projections have a bias"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not is_rms_norm(norm):
                return "a norm is not RMSNorm"
    head_dim = int(base.layers[0].self_attn.head_dim)
    if rotary_width(model) != head_dim:  # e.g. Phi-4-mini's partial_rotary_factor 0.75
        return f"RoPE rotates {rotary_width(model)} of each head's {head_dim} dimensions (a partial rotary)"
    return None


def projections(arch: str, attn: Any, mlp: Any) -> list[tuple[Any, str]]:
    """A decoder layer's linear layers as (module, attribute): the attention's, then the MLP's (down last)."""
    if arch in PHI3_ARCHITECTURES:
        return [(attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]
    return [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"), (mlp, "gate_proj"),
            (mlp, "up_proj"), (mlp, "down_proj")]


def rotary_width(model: Any) -> int:
    """How many dimensions of each head the model's RoPE rotates (the width of its cos table)."""
    weight = model.get_output_embeddings().weight
    probe = torch.zeros(1, 1, 1, dtype=weight.dtype, device=weight.device)
    position = torch.zeros(1, 1, dtype=torch.long, device=weight.device)
    rotary = model.model.rotary_emb
    if type(model).__name__ in GEMMA3_BLOCK_ARCHITECTURES:
        cos, _ = rotary(probe, position, model.config.layer_types[0])
    else:
        cos, _ = rotary(probe, position)
    return int(cos.shape[-1])


# Gemma 2 and 3's decoder-layer norms beyond the Llama block's two
_GEMMA_OUTPUT_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def gemma_refusal(model: Any) -> str | None:
    """Why a Gemma model cannot use the fused decoder, or None when it can."""
    config = model.config
    # Gemma reads `hidden_act`, Gemma 2 and 3 `hidden_activation`
    key = "hidden_act" if type(model).__name__ == "GemmaForCausalLM" else "hidden_activation"
    if getattr(config, key, None) != "gelu_pytorch_tanh":
        return f"{key} {getattr(config, key, None)!r} is not gelu_pytorch_tanh"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def is_rms_norm(module: Any) -> bool:
    """An RMSNorm as transformers' Llama-family (`variance_epsilon`) and Gemma (`eps`) models define it: a weight,
    an epsilon, no bias."""
    return (module is not None and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
            and isinstance(getattr(module, "weight", None), torch.Tensor) and getattr(module, "bias", None) is None)


def norm_eps(norm: Any) -> float:
    """An RMSNorm's epsilon (Llama's `variance_epsilon`, Gemma's `eps`)."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def norm_weight(norm: Any, gemma: bool, as_float: bool = False) -> torch.Tensor:
    """The weight an RMSNorm multiplies by: its own, or Gemma's `1 + w` (computed in float32, as Gemma does)."""
    weight = norm.weight.detach()
    if gemma:
        return 1.0 + weight.float()
    return weight.float() if as_float else weight


def qk_norms(attn: Any, as_float: bool, gemma: bool = False) -> dict[str, Any]:
    """The `_FusedLayer` fields of a layer's query/key norms (Qwen3, Gemma 3), empty where it has none."""
    if getattr(attn, "q_norm", None) is None:
        return {}
    return {"q_norm": norm_weight(attn.q_norm, gemma, as_float), "k_norm": norm_weight(attn.k_norm, gemma, as_float),
            "qk_eps": norm_eps(attn.q_norm)}


def block_fields(layer: Any, as_float: bool, gemma: bool, rope_by_type: bool) -> dict[str, Any]:
    """A decoder layer's `_FusedLayer` fields besides its products: its norms (weights and epsilons), and for Gemma
    the (1 + w) norms (float32 always) and GELU gating; for Gemma 2 and 3 the pre-MLP norm taking the Llama block's
    `post_norm` place, the output norms of attention and MLP, and the score cap; with `rope_by_type` (Gemma 3) the
    layer's RoPE table. `as_float`: the Llama block's norm weights in float32 (quantized copies meet float32
    activations)."""
    attn = layer.self_attn
    fields: dict[str, Any] = {
        "input_norm": norm_weight(layer.input_layernorm, gemma, as_float),
        "input_eps": norm_eps(layer.input_layernorm), **qk_norms(attn, as_float, gemma), "gelu": gemma,
        "softcap": getattr(attn, "attn_logit_softcapping", None) or None,
        "rope": attn.layer_type if rope_by_type else None,
    }
    if getattr(layer, "pre_feedforward_layernorm", None) is None:
        return {**fields, "post_norm": norm_weight(layer.post_attention_layernorm, gemma, as_float),
                "post_eps": norm_eps(layer.post_attention_layernorm)}
    return {**fields, "post_norm": norm_weight(layer.pre_feedforward_layernorm, True),
            "post_eps": norm_eps(layer.pre_feedforward_layernorm),
            "attn_out_norm": norm_weight(layer.post_attention_layernorm, True),
            "mlp_out_norm": norm_weight(layer.post_feedforward_layernorm, True),
            "out_eps": norm_eps(layer.post_attention_layernorm)}


def head_counts(attn: Any) -> tuple[int, int]:
    """A layer's query and key/value head counts, read from its projections' widths."""
    head_dim = int(attn.head_dim)
    if hasattr(attn, "qkv_proj"):  # Phi-3: (heads + 2 * kv_heads) * head_dim rows, o_proj reads heads * head_dim
        heads = attn.o_proj.weight.shape[1] // head_dim
        return heads, (attn.qkv_proj.weight.shape[0] // head_dim - heads) // 2
    return attn.q_proj.weight.shape[0] // head_dim, attn.k_proj.weight.shape[0] // head_dim


def qkv_bias_of(attn: Any) -> torch.Tensor | None:
    """The q/k/v biases as one vector (Qwen2), or None where the projections have none.

    Raises:
        ValueError: only some of them have a bias.
    """
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("the fused decoder needs all or none of q/k/v to have a bias")
    return torch.cat([b.detach() for b in biases])


def layer_window(attn: Any, config: Any) -> int | None:
    """The sliding window one attention layer passes to its attention function: its own `sliding_window`
    attribute where the model sets one per layer (Qwen2, Gemma), else the config's (Mistral passes it everywhere)."""
    if hasattr(attn, "sliding_window"):
        return int(attn.sliding_window) if attn.sliding_window else None
    return sliding_window(config)
