"""Tiny random models of architectures the fused decoder cannot take (StarCoder2, OPT), and the reference a quantized
engine is meant to equal: shared by the re-laid and quantized linear-layer tests."""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit.execution.fused.block_copies import HEAD_FORMATS
from decodekit.execution.fused.stored_matrices import BLOCK_FORMATS
from decodekit.execution.fused.weight_matrices import Int8Matrix
from decodekit.execution.kernels.native import load_kernels
from tests.helpers.gguf_blocks import gguf_dequantize

SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
UNFUSED_ARCHS: dict[str, dict[str, Any]] = {
    # tied embeddings, a sliding window, layer norms, biases, a plain (ungated) MLP
    "starcoder2": dict(num_key_value_heads=2, sliding_window=8, use_bias=True, tie_word_embeddings=True),
    # biases on every projection, an MLP of plain linears
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, tie_word_embeddings=False),
}


def unfused_model(arch: str) -> Any:
    """A 2-layer random model of `arch` (a key of `UNFUSED_ARCHS`), its head widened as `tiny_model` does."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **SMALL, **UNFUSED_ARCHS[arch])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # fewer greedy near-ties
    return model.eval()


def save_unfused(arch: str, folder: Any) -> Any:
    """Save `unfused_model(arch)` and the tiny tokenizer as a local HF folder (a model decodekit loads is its own to
    re-lay and quantize); returns the model as saved."""
    from decodekit.execution.fused.blocks import fused_decoder_refusal
    from decodekit.models.tiny import tiny_tokenizer

    model = unfused_model(arch)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert fused_decoder_refusal(model) is not None
    return model


def block_round_trip(weight: torch.Tensor, quantization: str, head: bool = False) -> torch.Tensor:
    """`weight` as a `quantization` ("q4_0", "q4_1", "q8_0") block copy multiplies it: quantized by gguf-py's
    reference quantizer (the LM head's format with `head`) and dequantized by gguf-py, independently of decodekit's
    kernels."""
    fmt = HEAD_FORMATS[quantization] if head else BLOCK_FORMATS[quantization]
    blocks = quantize(weight.detach().float().numpy(), GGMLQuantizationType[fmt])
    return gguf_dequantize(blocks, fmt, weight.shape[1])


def as_quantized(model: Any, quantization: str) -> Any:
    """A copy of `model` whose every linear weight is what an engine's `quantization` copy multiplies: bf16-rounded,
    int8 with one scale per output row, or GGUF blocks (the LM head in its own format), dequantized."""
    import copy

    kernels = load_kernels()
    reference = copy.deepcopy(model)
    head = reference.get_output_embeddings()
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                if quantization in BLOCK_FORMATS:
                    module.weight.copy_(block_round_trip(module.weight, quantization, head=module is head))
                elif quantization == "bf16":
                    module.weight.copy_(module.weight.to(torch.bfloat16).float())
                else:
                    matrix = Int8Matrix(module.weight, None, kernels)  # type: ignore[arg-type]
                    module.weight.copy_(matrix.weight.float() * matrix.scale[:, None])
    return reference
