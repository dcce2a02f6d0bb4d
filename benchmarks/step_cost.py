"""The cost of one decode step by its number of rows (1..64 sequences, one new token each), on the bundled model.

Every row is one sequence decoding one token after `--context` cached tokens; a step is one packed forward of the
model decodekit runs (fused decoder, native kernels, prepacked or int8 weights as the options say). Rows are timed in
a shuffled order, `--repeats` times each, the median kept; a "cliff" is a row count that costs more than the next
larger one (small verification steps and 2-sequence batches hit those). Prints one line per row count and the
cliffs, or writes JSON with `--json`.

Usage: python benchmarks/step_cost.py [--max-rows 64] [--context 64] [--repeats 7] [--quantization int8|bf16]
       [--threads 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from typing import Any

import torch

from decodekit import LLM
from decodekit.bench.machine import environment, machine_line
from decodekit.execution import ModelExecutor


def step_costs(model: ModelExecutor, max_rows: int, context: int, repeats: int, seed: int = 0,
               row_counts: list[int] | None = None) -> dict[int, float]:
    """Median seconds of a `rows`-row decode step for every rows in 1..max_rows, or in `row_counts` (sequences keyed
    0..max_rows-1, each holding `context` tokens; each timed step is rolled back, so every step sees the same
    context)."""
    rng = random.Random(seed)
    counts = row_counts or list(range(1, max_rows + 1))
    max_rows = max(counts)
    for key in range(max_rows):
        tokens = [rng.randrange(1000, 20000) for _ in range(context)]
        if not model.reserve(key, context + 1):
            raise RuntimeError("the KV pool is too small for the sequences asked for")
        model.forward([(key, tokens)])
    order = [rows for rows in counts for _ in range(repeats)]
    rng.shuffle(order)
    times: dict[int, list[float]] = {rows: [] for rows in counts}
    warm_up = [rows for rows in (1, 8, 32) if rows in times]  # timed, then dropped: the medians take the last
    for rows in [*warm_up, *order]:
        batch = [(key, [rng.randrange(1000, 20000)]) for key in range(rows)]
        start = time.perf_counter()
        model.forward(batch)
        elapsed = time.perf_counter() - start
        for key in range(rows):
            model.truncate(key, context)
        times[rows].append(elapsed)
    for key in range(max_rows):
        model.release(key)
    return {rows: statistics.median(found[-repeats:]) for rows, found in times.items()}


def cliffs(costs: dict[int, float], tolerance: float = 0.05) -> list[tuple[int, float]]:
    """Row counts costing more than `1 + tolerance` times the next larger one, with that ratio."""
    rows = sorted(costs)
    return [(r, costs[r] / costs[n]) for r, n in itertools.pairwise(rows) if costs[r] > (1 + tolerance) * costs[n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quantization", choices=["int8", "bf16"], default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the costs here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m-instruct", dtype="float32", quantization=args.quantization)
    engine = llm.engine
    print(machine_line(environment(), "float32"), f"| {engine.model.forward_name} forward", flush=True)
    costs = step_costs(engine.model, args.max_rows, args.context, args.repeats)
    one = costs[1]
    for rows, cost in costs.items():
        print(f"{rows:3} rows: {cost * 1000:7.1f} ms  ({cost / one:.2f}x one row, {cost / rows * 1000:6.2f} ms/row)")
    found = cliffs(costs)
    print("cliffs (costing more than the next larger step):",
          ", ".join(f"{r} rows {ratio:.2f}x of {r + 1}" for r, ratio in found) or "none", flush=True)
    if args.json:
        record: dict[str, Any] = {"environment": environment(), "forward": engine.model.forward_name,
                                  "context": args.context, "costs_s": costs, "cliffs": found}
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
