"""A tiny random Llama saved as a local HF folder, and the `--set` options that point a recipe at it."""

from __future__ import annotations

from pathlib import Path

from decodekit.models.tiny import tiny_model, tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def save_tiny_llama(folder: Path, chat_template: str = CHAT_TEMPLATE, **overrides) -> Path:
    """Save a tiny random Llama (config `overrides`) and its tokenizer with `chat_template` as an HF folder."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = chat_template
    tiny_model("llama", **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_overrides(tiny_dir: Path, max_tokens: int = 6) -> list[str]:
    """--set options that point a recipe at the tiny model, small and on the CPU."""
    sets = [f"model={tiny_dir}", "dtype=float32", "device=cpu", "engine.kv_cache_memory=16MiB",
            f"sampling.max_tokens={max_tokens}"]
    return [arg for item in sets for arg in ("--set", item)]
