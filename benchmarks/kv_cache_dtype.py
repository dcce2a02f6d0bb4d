"""A float32 and a bfloat16 KV cache side by side: the cost of one decode step by rows and context, on the bundled
model, both engines in one process, their timings interleaved round by round.

Each engine holds its own copy of the bundled model in float32 with the same weight format (`--quantization`); they
differ only in `kv_cache_dtype`. A cell is `rows` sequences of `context` cached tokens decoding one token each
(`step_cost.step_costs`); each round times every cell on both engines, in alternating order, and the medians over
the rounds are printed with the ratio float32 / bf16 (above 1: the bf16 cache is faster).

Usage: python benchmarks/kv_cache_dtype.py [--rows 1 8 32] [--contexts 256 1024] [--repeats 5] [--rounds 2]
       [--quantization bf16|int8] [--threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from decodekit import LLM
from decodekit.bench.machine import environment, machine_line
from decodekit.execution.attention.kv_cache import PagedKVCache
from decodekit.execution.fused.blocks import fused_decoder_refusal
from decodekit.execution.geometry import model_geometry
from decodekit.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from step_cost import step_costs

KV_DTYPES = ("float32", "bfloat16")
MODEL = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per cell and round (median kept)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", choices=["int8", "bf16"], default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # room for every sequence in float32, from the model's geometry
    model = load_model(MODEL, dtype="float32").model
    geometry = model_geometry(model, fused_decoder_refusal(model))
    per_token = PagedKVCache.bytes_per_token(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                                             torch.float32)
    memory = max(args.rows) * (max(args.contexts) + 2) * per_token + (64 << 20)
    engines = {dtype: LLM(MODEL, dtype="float32", quantization=args.quantization,
                          kv_cache_dtype=dtype, kv_cache_memory=memory).engine for dtype in KV_DTYPES}
    print(machine_line(environment(), "float32"), f"| {engines['float32'].model.forward_name} forward", flush=True)
    times: dict[tuple[str, int, int], list[float]] = {}
    for round_ in range(args.rounds):
        for context in args.contexts:
            order = KV_DTYPES if round_ % 2 == 0 else KV_DTYPES[::-1]
            for dtype in order:
                costs = step_costs(engines[dtype].model, max(args.rows), context, args.repeats, seed=round_,
                                   row_counts=args.rows)
                for rows, cost in costs.items():
                    times.setdefault((dtype, context, rows), []).append(cost)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'context':>7} {'rows':>4} {'float32 KV ms':>14} {'bf16 KV ms':>11} {'float32 / bf16':>15}")
    for context in args.contexts:
        for rows in args.rows:
            full = statistics.median(times[("float32", context, rows)])
            half = statistics.median(times[("bfloat16", context, rows)])
            print(f"{context:7} {rows:4} {full * 1000:14.1f} {half * 1000:11.1f} {full / half:14.2f}x")


if __name__ == "__main__":
    main()
