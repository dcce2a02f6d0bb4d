"""Where one round of the mixed workload goes: each engine step timed, split into the steps that carry prompt chunks
and the decode-only ones, the latter by batch size.

Usage: python benchmarks/round_steps.py [--dtype bfloat16] [--requests 32] [--threads 2] [--set KEY=VALUE ...]

Runs `make_workload("mixed")` (the workload of `decodekit bench mixed`) through the engine's step loop on the bundled
model, one untimed warm-up round then one timed round, and prints where the wall time went. `--set` passes engine
options (`--set max_num_batched_tokens=2048`).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="an engine option, KEY=VALUE")
    args = parser.parse_args()
    options: dict[str, object] = {}
    for item in args.set:
        key, value = item.split("=", 1)
        options[key] = int(value) if value.isdigit() else value
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, device="cpu", **options)
    engine = llm.engine
    work = make_workload("mixed", llm.tokenizer, num_requests=args.requests,
                         vocab_size=engine.loaded.model.config.vocab_size)
    last = {}
    schedule = engine.scheduler.schedule

    def recorded():  # type: ignore[no-untyped-def]
        last["out"] = out = schedule()
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]

    def one_round(index: int) -> tuple[float, list[tuple[float, int, int, int]]]:
        for request in work.requests(index):
            engine.add_request(request.prompt_ids, SamplingParams(temperature=0, max_tokens=request.output_len,
                                                                  ignore_eos=True))
        steps = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            engine.step()
            scheduled = last["out"].scheduled
            steps.append((time.perf_counter() - began, len(scheduled), sum(s.num_tokens for s in scheduled),
                          sum(s.num_tokens for s in scheduled if s.num_tokens > 1)))
        return time.perf_counter() - start, steps

    one_round(0)
    total, steps = one_round(1)
    print(f"{args.dtype}, {args.requests} requests {options or ''}: {total:.2f} s, {len(steps)} steps, "
          f"{work.total_output_tokens / total:.1f} tok/s")
    chunked = [s for s in steps if s[3] > 0]
    decode = [s for s in steps if s[3] == 0]
    print(f"  steps with prompt chunks: {len(chunked)}, {sum(s[0] for s in chunked):.2f} s, "
          f"{sum(s[3] for s in chunked)} prompt tokens")
    print(f"  decode-only steps: {len(decode)}, {sum(s[0] for s in decode):.2f} s")
    by_batch: dict[int, list[float]] = collections.defaultdict(list)
    for seconds, rows, _, _ in decode:
        by_batch[min(64, 1 << (rows - 1).bit_length())].append(seconds)
    for batch in sorted(by_batch):
        times = by_batch[batch]
        print(f"    up to {batch:3} rows: {len(times):4} steps, {sum(times):6.2f} s, "
              f"{1000 * sum(times) / len(times):6.1f} ms a step")


if __name__ == "__main__":
    main()
