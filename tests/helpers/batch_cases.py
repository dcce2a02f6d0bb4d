"""Rows and recipes shared by the batch job's tests (tests/serve/test_batch.py, tests/serve/test_scale_out.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from decodekit.models.tiny import tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def write_tiny_recipe(folder: Path, extra: str = "", max_tokens: int = 10) -> Path:
    """A recipe over a tiny random Llama saved with its tokenizer (with a chat template): greedy, `max_tokens`
    tokens."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tiny_model("llama").save_pretrained(folder / "tiny")
    tokenizer.save_pretrained(folder / "tiny")
    recipe = folder / "tiny.yaml"
    recipe.write_text(f"model: {folder / 'tiny'}\ndtype: float32\ndevice: cpu\nengine: {{kv_cache_memory: 16MiB}}\n"
                      f"sampling: {{temperature: 0, max_tokens: {max_tokens}}}\n{extra}")
    return recipe


def write_tiny_tools_recipe(folder: Path, max_tokens: int = 96, extra: str = "") -> Path:
    """A recipe over a tiny random Llama with room for tools' descriptions (a 4096-token context: its tokenizer spends
    about a token per character) and a chat template: greedy, `max_tokens` tokens, then `extra` (YAML). The model is
    `folder / "tiny"`."""
    from tests.helpers.tiny_folders import save_tiny_llama

    save_tiny_llama(folder / "tiny", chat_template=TEMPLATE, max_position_embeddings=4096)
    recipe = folder / "tiny.yaml"
    recipe.write_text(f"model: {folder / 'tiny'}\ndtype: float32\ndevice: cpu\nengine: {{kv_cache_memory: 64MiB}}\n"
                      f"sampling: {{temperature: 0, max_tokens: {max_tokens}}}\n{extra}")
    return recipe


def mixed_rows(count: int) -> list[Any]:
    """Rows of every kind: plain prompts, chat messages, seeded sampling, beam search, per-row max_tokens, own ids,
    and rows that cannot run (bad JSON, an unknown processor, neither prompt nor messages, a prompt too long)."""
    rows: list[Any] = []
    for i in range(count):
        if i % 17 == 5:
            rows.append("{not json")
        elif i % 23 == 9:
            rows.append({"prompt": "x", "processors": [{"no_such_processor": {}}]})
        elif i % 29 == 11:
            rows.append({"id": f"empty-{i}"})
        elif i % 31 == 13:
            rows.append({"prompt": "long " * 600})  # past the tiny model's 512-token context
        elif i % 3 == 0:
            rows.append({"messages": [{"role": "user", "content": f"question {i}?"}]})
        elif i % 7 == 1:
            rows.append({"id": f"s{i}", "prompt": f"tell me {i}", "sampling": {"temperature": 0.9, "seed": i}})
        elif i % 11 == 2:
            beams = {"num_beams": 3, "num_return_sequences": 2}
            rows.append({"prompt": f"beams {i}", "strategy": {"beam_search": beams}})
        else:
            rows.append({"prompt": f"count {i} " * (i % 5 + 1), "sampling": {"max_tokens": 4 + i % 9}})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def same(a: Any, b: Any) -> bool:
    """Equal rows: every token, text and field exactly, but float scores to 1e-5 (beam scores are sums of float32
    logprobs, whose last bits follow the batch's shape)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)
