"""What a model split over N ranks costs per step: all-reduce bytes (counted) and time, against 1 rank.

Usage: python benchmarks/tensor_parallel.py [--model smollm2-135m-instruct] [--ranks 1 3] [--batch 1 8]
       [--tokens 32] [--threads 1] [--dtype float32] [--device cpu]

For each rank count and batch size: one untimed warm-up round, then `--batch` requests of a 16-token prompt each
decoding `--tokens` tokens (`ignore_eos`) through the engine's step loop; prints per decode step the median wall
time, the all-reduce bytes per token and per step, the all-reduces per step, rank 0's seconds inside them (as a
fraction of the round's step time: with gloo that includes waiting for the slowest rank; NCCL's all-reduce is
asynchronous, so on CUDA this column reads ~0 and the step time is the figure), and the bytes of the step inputs
rank 0 broadcasts.

The bundled SmolLM2-135M has 9 heads and 3 KV heads: it splits by 3 only. A 1B-shaped random model
(`benchmarks/random_model.py --shape llama-1b`, 32 heads, 8 KV heads) splits by 2, 4 and 8. Rank counts the model
cannot take are reported and skipped. Timings need a quiet machine with a core per rank and thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError


def _round(llm: LLM, batch: int, tokens: int) -> tuple[list[float], float]:
    """One round of `batch` requests: the wall time of each step that ran only decodes, and of all its steps."""
    engine = llm.engine
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(16)]
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    times = []
    total = 0.0
    while engine.has_unfinished_requests():
        decoding = all(seq.num_computed_tokens >= seq.num_prompt_tokens
                       for request in engine.scheduler.running for seq in request.sequences
                       ) and not engine.scheduler.waiting
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        total += took
        if decoding and engine.scheduler.running:
            times.append(took)
    return times, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'ranks':>5} {'batch':>5} {'ms/step':>8} {'AR B/token':>10} {'AR B/step':>10} {'ARs/step':>8} "
          f"{'AR share':>8} {'bcast B/step':>12}")
    for ranks in args.ranks:
        try:
            llm = LLM(args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=ranks)
        except ConfigError as exc:
            print(f"{ranks:>5} skipped: {exc}")
            continue
        try:
            runner = llm.engine.model.runner
            comm = getattr(runner, "comm", None)
            for batch in args.batch:
                _round(llm, batch, 4)  # warm-up
                if comm is not None:
                    comm.reset()
                times, total = _round(llm, batch, args.tokens)
                step_ms = statistics.median(times) * 1e3 if times else float("nan")
                if comm is None or not comm.steps:
                    print(f"{ranks:>5} {batch:>5} {step_ms:>8.2f} {0:>10} {0:>10} {0:>8} {'-':>8} {0:>12}")
                    continue
                share = comm.all_reduce_s / max(total, 1e-9)  # of every step of the round, prefill included
                print(f"{ranks:>5} {batch:>5} {step_ms:>8.2f} {comm.all_reduce_bytes / comm.tokens:>10.0f} "
                      f"{comm.all_reduce_bytes / comm.steps:>10.0f} {comm.all_reduces / comm.steps:>8.1f} "
                      f"{share:>8.1%} {comm.broadcast_bytes / comm.steps:>12.0f}")
        finally:
            llm.close()


if __name__ == "__main__":
    main()
