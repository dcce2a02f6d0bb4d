"""KV blocks held, and decode speed, when the blocks behind a sliding window are released or kept.

A random model with SmolLM2-135M's shapes and Mistral's every-layer window (nothing is downloaded): `--requests`
prompts of `--prompt-len` tokens each decode `--output-len` tokens greedily, once with the blocks behind the window
released (the engine's default for such models) and once with them kept (`Scheduler.window = None`), alternating
`--repeats` times. Prints the peak blocks held and tokens/s of each run, and checks both give the same tokens.

    python benchmarks/window_blocks.py --window 256 --output-len 960
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.models.tiny import tiny_tokenizer


def _model(window: int) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "mistral", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        sliding_window=window, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _run(model: torch.nn.Module, release: bool, args: argparse.Namespace) -> tuple[int, int, float, list[list[int]]]:
    llm = LLM(model, tiny_tokenizer(), kv_cache_memory=args.kv_cache_memory, block_size=args.block_size)
    if not release:
        llm.engine.scheduler.window = None
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    requests = [llm.engine.add_request(p, params) for p in prompts]
    allocator = llm.engine.allocator
    peak, start = 0, time.perf_counter()
    while any(not r.finished for r in requests):
        llm.engine.step()
        peak = max(peak, allocator.num_blocks - allocator.num_free_blocks)
    seconds = time.perf_counter() - start
    tokens = [r.sequences[0].token_ids[args.prompt_len:] for r in requests]
    return peak, allocator.num_blocks, seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=960)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} torch threads, float32, "
          f"torch {torch.__version__}; window {args.window}, {args.requests} requests of {args.prompt_len} + "
          f"{args.output_len} tokens, blocks of {args.block_size}")
    model = _model(args.window)
    seen: dict[bool, list[list[int]]] = {}
    for _ in range(args.repeats):
        for release in (True, False):
            peak, total, seconds, tokens = _run(model, release, args)
            seen.setdefault(release, tokens)
            tok_s = args.requests * args.output_len / seconds
            print(f"{'released' if release else 'kept':>8}: peak {peak} of {total} blocks held, {tok_s:.1f} tok/s "
                  f"({seconds:.1f} s)")
    print("same tokens:", seen[True] == seen[False])


if __name__ == "__main__":
    main()
