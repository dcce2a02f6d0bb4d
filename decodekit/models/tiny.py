"""Tiny random models and a tiny byte-level BPE tokenizer, built in-process for fast tests (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

_CORPUS = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
    "Continuous batching mixes prefill and decode. Paged attention stores keys and values in blocks. "
    "Hello world! 1234567890 {\"json\": [true, false, null]} <tag> END STOP stop.\n"
) * 4


def tiny_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer trained on a fixed snippet, with `<s>`, `</s>` and `<pad>` specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model(arch: str = "llama", vocab_size: int = 384, seed: int = 0, **overrides: Any) -> Any:
    """A 2-layer random causal LM ("llama", "qwen2", "qwen3" or "mistral" style) with grouped-query attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}
    if arch not in configs:
        raise ValueError(f"arch must be one of {sorted(configs)}, got {arch!r}")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["head_dim"] = 16  # Qwen3 sets its head size apart from hidden_size / heads (default 128)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[arch](**kwargs), dtype=torch.float32)
    # Random init gives near-uniform logits; widen them so greedy ties (and float-order flips) are rare.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()
