"""Tiny reasoning models built in-process: tokenizers with Qwen3's `<think>` markers or gpt-oss's harmony tokens,
chat templates cut down from the published ones, and random Qwen3 / gpt-oss models of the right vocabulary."""

from __future__ import annotations

from typing import Any

import torch

from decodekit.models.tiny import tiny_model, tiny_tokenizer

THINK_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nEffort: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
"""Qwen3's chat template, cut down: the model opens `<think>` itself, unless `enable_thinking` is false (and, for
the tests of `reasoning_effort`, a system line with it when given)."""

HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
"""gpt-oss's chat template, cut down: `reasoning_effort` goes into the system message; the model opens its channel."""

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]


def think_tokenizer() -> Any:
    """The tiny tokenizer with Qwen3's `<think>` / `</think>` (added tokens kept in decoded text, as Qwen3's are) and
    its chat markers."""
    tok = tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = THINK_TEMPLATE
    return tok


def harmony_tokenizer() -> Any:
    """The tiny tokenizer with gpt-oss's harmony special tokens; `<|return|>` ends an output, as in gpt-oss."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_TEMPLATE
    return tok


def tiny_qwen3(tokenizer: Any, seed: int = 0) -> Any:
    """A tiny random Qwen3 over `tokenizer`'s vocabulary."""
    return tiny_model("qwen3", vocab_size=len(tokenizer), seed=seed)


def tiny_gpt_oss(tokenizer: Any, seed: int = 0) -> Any:
    """A tiny random gpt-oss (attention sinks, a sliding window, 4 experts) over `tokenizer`'s vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def save_tiny_qwen3(folder: Any) -> Any:
    """The tiny Qwen3 and its `<think>` tokenizer saved as an HF folder (for recipes and the server)."""
    tok = think_tokenizer()
    tiny_qwen3(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
