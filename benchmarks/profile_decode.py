"""Where a decode step's time goes: torch profiler op breakdown and achieved weight bandwidth.

Usage: python benchmarks/profile_decode.py [--batch 1 64] [--context 256] [--dtype float32]

For each batch size it fills the engine with that many requests of `--context` prompt tokens, runs a few decode
steps, then prints the step time, the top operators, and weight bytes / step time (a decode step must read every
weight once, so that ratio against the machine's memory bandwidth says how far decode is from its bound).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from decodekit import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, device="cpu")
    engine = llm.engine
    model = engine.loaded.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for batch in args.batch:
        for i in range(batch):
            prompt = [(1000 + 7 * i + j) % 40000 + 100 for j in range(args.context)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
        while any(s.num_uncomputed > 1 for r in engine.scheduler.waiting + engine.scheduler.running
                  for s in r.sequences) or engine.scheduler.waiting:
            engine.step()  # prefill
        engine.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - start) / args.steps
        print(f"\n== batch {batch}, context ~{args.context}: {step * 1000:.1f} ms/step, {batch / step:.1f} tok/s, "
              f"weights {weight_bytes / 2**20:.0f} MiB -> {weight_bytes / step / 1e9:.1f} GB/s effective")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        for request_id in list(engine.requests):
            engine.abort(request_id)
        engine.step()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
