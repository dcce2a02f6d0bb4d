"""What a realistic processor recipe costs per decode step, against plain sampling, at batch 32.

Usage: OMP_NUM_THREADS=1 python benchmarks/processor_cost.py [--batch 32] [--tokens 32] [--repeats 3] [--tiny] [--chat]
       [--logprobs] [--trace]

A is plain sampling (temperature 0.8). B adds top-p 0.9, a repetition penalty, a logit bias on ten tokens and a
stop string (one that does not occur, so every request keeps decoding); B without top-p is timed too, to separate
the built-in top-p (a sort of the whole vocabulary per row) from the rest. Each repeat fills the engine with
`batch` requests of `--context` prompt tokens, prefills them, then times `tokens` decode steps; the variants
alternate so that drift (other load, thermal) hits all alike. Prints the median step time of each and the ratios
to A (the catalogue's target for B is at most 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodekit import LLM, SamplingParams
from decodekit.core.engine import Engine


def decode_steps(engine: Engine, params: SamplingParams, prompts: list[list[int]], steps: int) -> list[float]:
    """Per-step seconds of `steps` decode steps with every prompt's request running."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for r in engine.scheduler.running
                                          for s in r.sequences):
        engine.step()  # prefill (and the first token)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if len(engine.scheduler.running) != len(prompts):
        print(f"  warning: {len(prompts) - len(engine.scheduler.running)} requests finished early")
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--tiny", action="store_true", help="the tiny random test model instead of SmolLM2")
    parser.add_argument("--logprobs", action="store_true",
                        help="also time A with logprobs=5 (raw) and logprobs=5 (processed) on every request")
    parser.add_argument("--trace", action="store_true", help="also time A with trace=5 on every request")
    parser.add_argument("--chat", action="store_true",
                        help="chat-templated questions as prompts (peaked next-token distributions, as in real use) "
                             "instead of arbitrary token ids (flat distributions: top-p's worst case)")
    args = parser.parse_args()
    if args.tiny:
        from decodekit.models.tiny import tiny_model, tiny_tokenizer

        llm = LLM(tiny_model("llama"), tiny_tokenizer(), dtype="float32", device="cpu")
    else:
        llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    engine = llm.engine
    vocab = engine.vocab_size
    prompts = [[(1000 + 7 * i + j) % (vocab - 100) + 100 for j in range(args.context)] for i in range(args.batch)]
    if args.chat:
        topics = ["the ocean", "a violin", "Mount Everest", "bread", "the Moon", "a bicycle", "tea", "Paris"]
        asks = ["Tell me about {}.", "Write a short story about {}.", "What is special about {}?", "Describe {}."]
        prompts = [llm.tokenizer(llm.apply_chat_template([{"role": "user", "content": asks[i % 4].format(
            topics[(i // 4) % 8])}]), add_special_tokens=False).input_ids for i in range(args.batch)]
    common = {"temperature": 0.8, "max_tokens": 100_000, "ignore_eos": True}
    plain = SamplingParams(**common)
    no_top_p = SamplingParams(**common, stop=["\n\nTHE END"], processors=[
        {"repetition_penalty": {"penalty": 1.1}},
        {"logit_bias": {"bias": {str(t): -5.0 for t in range(200, 210)}}},
    ])
    variants = {
        "A: plain sampling": plain,
        "B: top-p + repetition penalty + logit bias + stop": no_top_p.model_copy(update={"top_p": 0.9}),
        "B without top-p": no_top_p,
    }
    if args.trace:
        variants["A + trace=5"] = plain.model_copy(update={"trace": 5})
    if args.logprobs:
        variants["A + logprobs=5 (raw)"] = plain.model_copy(update={"logprobs": 5})
        variants["A + logprobs=5 (processed)"] = plain.model_copy(update={"logprobs": 5,
                                                                          "logprobs_mode": "processed"})
    decode_steps(engine, plain, prompts, 4)  # warm-up
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, params in variants.items():
            step = statistics.median(decode_steps(engine, params, prompts, args.tokens))
            medians[name].append(step)
            print(f"repeat {repeat}: {name:50s} {step * 1000:8.2f} ms/step")
    threads = torch.get_num_threads()
    print(f"\nbatch {args.batch}, {args.tokens} steps x {args.repeats} repeats, torch threads {threads}")
    base = statistics.median(medians["A: plain sampling"])
    for name, steps in medians.items():
        step = statistics.median(steps)
        print(f"{name:50s} {step * 1000:8.2f} ms/step (median)   ratio to A {step / base:.3f}")
    print("target: B / A <= 1.10")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
