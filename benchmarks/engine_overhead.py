"""The engine's own cost per step, on a tiny model whose forward is cheap, so the step loop's Python dominates.

    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py [--requests 32] [--tokens 64] [--repeats 5]
        [--max-num-seqs 128]

Runs greedy, EOS-ignoring requests through `LLM.generate` (continuous batching, every request decoding together)
and prints the median milliseconds per engine step and per generated token. Compare two checkouts by running the
script from each (the figure to compare is the median; these machines are noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodekit import LLM, SamplingParams
from decodekit.models.tiny import tiny_model, tiny_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="Sequences decoded together (raise it with "
                        "--requests to measure the host's time a step at hundreds of running requests).")
    parser.add_argument("--strategy", choices=["sample", "speculative", "beam_search"], default="sample")
    args = parser.parse_args()
    torch.manual_seed(0)
    many = args.max_num_seqs > 128  # the defaults' pool and token budget up to 128 (figures stay comparable)
    llm = LLM(tiny_model("llama"), tiny_tokenizer(), kv_cache_memory="256MiB" if many else "64MiB", block_size=16,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8 * args.max_num_seqs if many else 1024)
    prompts = [[int(t) for t in torch.randint(3, 300, (16,))] for _ in range(args.requests)]
    strategy = {"sample": None, "speculative": {"speculative": {"proposer": "ngram"}},
                "beam_search": {"beam_search": {"num_beams": 4}}}[args.strategy]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=args.strategy != "beam_search",
                            strategy=strategy)
    llm.generate(prompts[:4], params)  # warm-up
    per_step, per_token = [], []
    for _ in range(args.repeats):
        steps = llm.engine.step_count
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
        per_step.append(elapsed / (llm.engine.step_count - steps) * 1e3)
        per_token.append(elapsed / tokens * 1e3)
    print(f"{args.strategy}, {args.requests} requests x {args.tokens} tokens, {torch.get_num_threads()} thread(s): "
          f"median {statistics.median(per_step):.2f} ms/step, {statistics.median(per_token):.3f} ms/token "
          f"(steps: {', '.join(f'{x:.2f}' for x in per_step)})")


if __name__ == "__main__":
    main()
