"""Sampled decoding at batch 1 with native decode runs against step by step, in one process on the bundled model.

    python benchmarks/sampled_runs.py [--dtype auto] [--temperature 0.7] [--top-k 0] [--top-p 1] [--min-p 0]
                                      [--rounds 5] [--threads 2]

Two engines on the same weights, one with `decode_run_steps=1` (every token a step: forward, processing, the
exponential race over the vocabulary, stop, emit), one with the default runs (a lone unseeded request whose only
processors are temperature, top_k, top_p and min_p draws its tokens in C, `decodekit.core.decode_runs`;
`--top-k 40 --top-p 0.95 --min-p 0.05 --temperature 0.8` are llama.cpp's default sampler settings). Each round
decodes four chat prompts one at a time (128 tokens each, EOS ignored) on each engine, alternating, and prints both
engines' tokens per second and the median of the per-round ratios (these machines are noisy: compare ratios, not
rates).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.workloads import CHAT_QUESTIONS


def _rate(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Tokens per second of `prompts` decoded one at a time."""
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(llm.generate([prompt], params, add_special_tokens=False)[0].token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", help="the model's dtype (`auto`: the bundled GGUF as stored)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {"step by step": LLM("smollm2-135m-instruct", dtype=args.dtype, decode_run_steps=1),
               "runs": LLM("smollm2-135m-instruct", dtype=args.dtype)}
    chat = engines["runs"]
    prompts = [chat.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:4]]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            max_tokens=128, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:1], params, add_special_tokens=False)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rates[name].append(_rate(llm, prompts, params))
    ratios = [r / s for r, s in zip(rates["runs"], rates["step by step"])]
    for name, values in rates.items():
        print(f"{name:>12}: {statistics.median(values):6.1f} tok/s (rounds {', '.join(f'{v:.1f}' for v in values)})")
    print(f"runs / step by step: {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
          f"tokens from runs: {engines['runs'].engine.decode_run_tokens}")


if __name__ == "__main__":
    main()
