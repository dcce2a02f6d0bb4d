"""The cost of a step that mixes a prefill chunk with running decodes, and of the decode steps around it.

Usage: python benchmarks/mixed_step.py [--decoding 32] [--context 128] [--prompt 256] [--rounds 4] [--threads 1]

Run it twice, with and without `DECODEKIT_NATIVE_KERNELS=0`, to compare the native kernels with torch ops on the
same steps (bundled SmolLM2, float32). Prints each timed step in ms.
"""

from __future__ import annotations

import argparse
import time

import torch

from decodekit import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoding", type=int, default=32, help="requests decoding throughout")
    parser.add_argument("--context", type=int, default=128, help="their prompt length")
    parser.add_argument("--prompt", type=int, default=256, help="length of each arriving prompt")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLM("smollm2-135m-instruct", dtype="float32", device="cpu").engine
    forever = SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True)
    for i in range(args.decoding):
        engine.add_request([(1000 + 7 * i + j) % 40000 + 100 for j in range(args.context)], forever)
    for _ in range(12):  # prefill them all and settle into decoding
        engine.step()
    mixed, decode = [], []
    for r in range(args.rounds):
        prompt = [(5000 + 11 * r + j) % 40000 + 100 for j in range(args.prompt)]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        engine.step()  # the arriving prompt's chunk (whole, within the token budget) plus every decode
        mixed.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        engine.step()
        decode.append((time.perf_counter() - start) * 1e3)
    print(f"{args.decoding} decoding at context ~{args.context} + one {args.prompt}-token prompt per round:")
    print("  mixed steps ms: " + ", ".join(f"{t:.0f}" for t in mixed))
    print("  decode steps ms: " + ", ".join(f"{t:.0f}" for t in decode))


if __name__ == "__main__":
    main()
