"""How fast speculative decoding could ever be on `strategies.py spec`'s prompt sets: the bound a perfect proposer
reaches, given the target's own greedy answers and this machine's cost of a step by rows.

A lossless speculative step gives the target's next token plus the drafted tokens it accepts, so the answer fixes
the best any proposer can do:

- `lookup oracle`: at each step, the longest suffix of the context (prompt and answer so far) that occurs earlier in
  it drafts what followed that occurrence (prompt lookup / suffix decoding over this request), and the draft's
  length is chosen with hindsight: exactly the tokens the target then accepts (no row wasted), up to `k` (`--k`, the
  adaptive strategy's `max_speculative_tokens`) or unlimited.
- `always right`: every step drafts `k` tokens and the target accepts them all, for free: any proposer at its best
  (a draft model's own forwards would cost more).

For each, the steps it takes, its tokens a step (the speedup if verifying rows were free), and the speedup with rows
priced by the target's measured step cost (`Engine.step_cost`, the curve the adaptive chooser reads: a step of `r`
rows costs `cost(r)`, plain decoding `cost(1)` a token; the prefill is left out, which only lowers every real
ratio). A measured ratio in `strategies.py spec` can approach these figures, never pass them.

Usage: python benchmarks/spec_bound.py [--dtype auto] [--quantization int8] [--k 10] [--threads 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from strategies import spec_prompt_sets

from decodekit import LLM, SamplingParams
from decodekit.bench.machine import environment, machine_line

MAX_MATCH = 32
"""The longest context suffix the lookup oracle tries to match (longer ones change nothing on these prompts)."""


def lookup_draft(context: list[int], limit: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix of `context` found earlier in it (up to
    `MAX_MATCH` tokens), at most `limit` tokens; empty where even its last token never occurred before.

    Example:
        >>> lookup_draft([5, 6, 7, 1, 5, 6], 3)
        [7, 1, 5]
    """
    for length in range(min(MAX_MATCH, len(context) - 1), 0, -1):
        suffix = context[-length:]
        for start in range(len(context) - length - 1, -1, -1):
            if context[start:start + length] == suffix:
                return context[start + length:start + length + limit]
    return []


def replay(prompt: list[int], answer: list[int], draft: Callable[[list[int]], list[int]]) -> list[int]:
    """The rows of each verification step that a proposer drafting from `draft(context)` needs to produce `answer`
    losslessly, its length chosen with hindsight: each step verifies the part of the draft the target agrees with
    (none where the first token disagrees) plus the target's own token."""
    steps, done = [], 0
    while done < len(answer):
        proposal = draft(prompt + answer[:done])
        accepted = 0
        while (accepted < len(proposal) and done + accepted < len(answer)
               and proposal[accepted] == answer[done + accepted]):
            accepted += 1
        steps.append(accepted + 1)
        done += accepted + 1
    return steps


def bounds(prompts: list[list[int]], answers: list[list[int]], k: int, cost: Callable[[int], float]
           ) -> dict[str, tuple[int, float, float]]:
    """Per proposer: (steps, tokens a step, speedup with rows priced by `cost`) over all the answers."""
    tokens = sum(len(a) for a in answers)
    proposers: dict[str, Callable[[list[int], list[int]], list[int]]] = {
        f"lookup oracle, k <= {k}": lambda p, a: replay(p, a, lambda c: lookup_draft(c, k)),
        "lookup oracle, any k": lambda p, a: replay(p, a, lambda c: lookup_draft(c, 10 ** 6)),
        f"always right, k = {k}": lambda p, a: [k + 1] * -(-len(a) // (k + 1)),
    }
    out = {}
    for name, rows_of in proposers.items():
        rows = [r for p, a in zip(prompts, answers) for r in rows_of(p, a)]
        out[name] = (len(rows), tokens / len(rows), tokens * cost(1) / sum(cost(r) for r in rows))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="the target's weights quantized on load (e.g. int8)")
    parser.add_argument("--k", type=int, default=10, help="the most draft tokens a step (max_speculative_tokens)")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    extra: dict[str, Any] = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, **extra)
    target = args.dtype + (f", {args.quantization} weights" if args.quantization else "")
    print(machine_line(environment(), target), f"| {llm.engine.model.forward_name}", flush=True)
    cost = llm.engine.step_cost()
    if cost is None:
        raise SystemExit("the engine could not measure its step cost on this machine")
    print("step cost by rows (ms): " + ", ".join(f"{r}: {cost(r) * 1e3:.1f}" for r in (1, 2, 4, 8, 11, 16, 33)))
    for set_name, (prompts, max_tokens) in spec_prompt_sets(llm).items():
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), add_special_tokens=False)
        prompt_ids = [list(o.prompt_token_ids) for o in outs]
        answers = [list(o.outputs[0].token_ids) for o in outs]
        print(f"{set_name}: {len(answers)} answers, {sum(map(len, answers))} tokens "
              f"({', '.join(str(len(a)) for a in answers)})")
        for name, (steps, per_step, speedup) in bounds(prompt_ids, answers, args.k, cost).items():
            print(f"  {name:24} {steps:4} steps  {per_step:5.2f} tokens a step  bound {speedup:.2f}x plain")


if __name__ == "__main__":
    main()
