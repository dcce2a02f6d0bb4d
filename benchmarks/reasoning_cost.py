"""What phases cost: a decode step at batch 32 with every request plain, and with every request reasoning under a
thinking budget (think_tags markers as text, a wrap-up, per-phase temperatures), on the bundled model; interleaved
rounds, medians, the ratio printed.

A request without reasoning settings gets no phase router, so the plain side is what it costs without phases. To
see that it pays nothing, run the plain side on this branch and on the commit before phases (`--plain-only`, once
in each checkout, side by side on a quiet machine) and compare the two medians.

Usage: python benchmarks/reasoning_cost.py [--batch 32] [--tokens 48] [--rounds 5] [--dtype float32] [--plain-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

from decodekit import LLM, SamplingParams
from decodekit.bench.machine import environment, machine_line

THINKING = {"format": "think_tags", "thinking": {"budget": 24, "wrap_up": "\nOK, time to answer.\n",
                                                 "sampling": {"temperature": 1.0, "top_p": 0.95}},
            "answer": {"sampling": {"temperature": 0.7}}}


def step_ms(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Median wall time of the decode steps (every request past its prompt) of one batch, in milliseconds."""
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(prompt, params, request_id=f"r{time.perf_counter_ns()}-{i}", add_special_tokens=False)
    times: list[float] = []
    while llm.engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = llm.engine.step()
        elapsed = time.perf_counter() - start
        if all(o.outputs and o.outputs[0].token_ids for o in outputs) and len(outputs) == len(prompts):
            times.append(elapsed)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--plain-only", action="store_true")
    args = parser.parse_args()
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, device="cpu")
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
                                       tokenize=False, add_generation_prompt=True) + "<think>\n"
               for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.7, seed=0, ignore_eos=True)
    phased = plain.model_copy(update={"reasoning": THINKING})
    sides = {"plain": plain} if args.plain_only else {"plain": plain, "reasoning": SamplingParams.model_validate(
        dict(phased))}
    step_ms(llm, prompts[:2], plain)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, params in sides.items():  # interleaved: A B A B ...
            times[name].append(step_ms(llm, prompts, params))
    print(machine_line(environment(), args.dtype, device="cpu"))
    for name, values in times.items():
        print(f"{name:10s} decode step at batch {args.batch}: {statistics.median(values):8.2f} ms (median of "
              f"{args.rounds} rounds)")
    if not args.plain_only:
        ratio = statistics.median(times["reasoning"]) / statistics.median(times["plain"])
        print(f"reasoning / plain: {ratio:.3f}")


if __name__ == "__main__":
    main()
