"""`dtype="bfloat16"` on a CPU against float32 and against torch's own bf16 forward, side by side in one process.

decodekit runs a bfloat16 model on a CPU as bf16 weights multiplied in float32 (the fused decoder's copies for
Llama-family models, the model's own linear layers for other architectures it loads); `native_kernels=False` keeps
torch's bf16 forward, where every activation is rounded to bf16. Batch 1: the chat questions one at a time,
interleaved repeats, medians and the median of per-repeat ratios to float32.

Usage: python benchmarks/bf16_dtype.py [--model smollm2-135m-instruct] [--repeats 3] [--threads 2] [--prompts 4]
       [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.machine import environment, machine_line
from decodekit.bench.workloads import CHAT_QUESTIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the model (bundled name or folder)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="chat questions per repeat")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {
        "float32": LLM(args.model, dtype="float32"),
        "bfloat16": LLM(args.model, dtype="bfloat16", device="cpu"),
        "bfloat16, native_kernels=False": LLM(args.model, dtype="bfloat16", device="cpu", native_kernels=False),
    }
    print(machine_line(environment(), "float32 / bfloat16"), flush=True)
    for name, llm in llms.items():
        print(f"{name}: {llm.engine.model.forward_name}", flush=True)
    template = llms["float32"]
    prompts = [template.apply_chat_template([{"role": "user", "content": q}])
               for q in CHAT_QUESTIONS[:args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs = [llm.generate([p], params, add_special_tokens=False)[0] for p in prompts]
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    for name, values in rates.items():
        ratios = [v / f for v, f in zip(values, rates["float32"])]
        print(f"{name}: {statistics.median(values):.1f} tok/s, {statistics.median(ratios):.2f}x float32 "
              f"({min(ratios):.2f}-{max(ratios):.2f}, {args.repeats} repeats)", flush=True)


if __name__ == "__main__":
    main()
