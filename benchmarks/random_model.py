"""Write a Llama-family model folder with seeded random weights, for benchmarks where real weights are not at hand.

The GPU machine has no copy of the bundled weights and can download nothing, so the GPU figures of
`docs/history/benchmarks-2026-11.md` run on random weights in a real model's shape, with the bundled model's
tokenizer. Speed does not depend on the values (every request decodes to its exact length, `ignore_eos`). The shapes:

- `smollm2-135m`: the bundled model's own config (30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152).
- `llama-1b`: Llama 3.2 1B's shape (16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads, head size 64), with the
  tokenizer's vocabulary of 49,152 instead of 128,256, so that every id decodes.

    python benchmarks/random_model.py --shape llama-1b --tokenizer TOKENIZER_FOLDER --output /tmp/llama-1b
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def write_random_model(shape: str, tokenizer: Path, output: Path, seed: int = 0) -> Path:
    """Save a random model of `shape` with the tokenizer files from `tokenizer` (which for `smollm2-135m` also
    holds the config) into `output`; returns `output`."""
    if shape == "smollm2-135m":
        config = LlamaConfig.from_pretrained(tokenizer)
    elif shape == "llama-1b":
        base = LlamaConfig.from_pretrained(tokenizer)
        config = LlamaConfig(vocab_size=base.vocab_size, bos_token_id=base.bos_token_id,
                             eos_token_id=base.eos_token_id, **LLAMA_1B)
    else:
        raise SystemExit(f"unknown shape {shape!r}: smollm2-135m or llama-1b")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, output / name)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=["smollm2-135m", "llama-1b"])
    parser.add_argument("--tokenizer", type=Path, required=True, help="A folder with the bundled model's "
                        "tokenizer files and config.json (e.g. the converted bundled model in the decodekit cache).")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_random_model(args.shape, args.tokenizer, args.output, args.seed))


if __name__ == "__main__":
    main()
