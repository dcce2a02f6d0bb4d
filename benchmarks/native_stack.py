"""Decode steps with the native layer stack (one native call for all layers) against the per-layer native path.

For each weight format (float32, bf16 and int8 copies, the bundled GGUF's blocks as stored) the bundled model's
engine decodes `--rows` sequences of `--context` cached tokens one token each; every step is rolled back, so each sees
the same context. Rounds alternate the two paths in one process (on off, off on, ...: `FusedDecoder.native_stack`
set and cleared), `--steps` timed steps each, and the medians per path give the time saved per step. Both paths give
the same logits bit for bit (tests/execution/test_native_stack.py), so this measures only the glue removed.

Timings are only meaningful on a quiet machine; `--tiny` runs a tiny in-process model instead (a check that the
script runs, not a figure).

Usage: python benchmarks/native_stack.py [--formats float32 bf16 int8 gguf] [--rows 1] [--context 64] [--steps 20]
       [--rounds 6] [--threads 0] [--tiny]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from decodekit import LLM
from decodekit.bench.machine import environment, machine_line
from decodekit.execution import ModelExecutor
from decodekit.models.tiny import tiny_model, tiny_tokenizer

FORMATS = ("float32", "bf16", "int8", "gguf")


def build(fmt: str, tiny: bool) -> LLM:
    """The engine of one weight format: the bundled model (gguf: its blocks as stored, dtype auto), or with `tiny` a
    tiny random Llama (no GGUF)."""
    quantization = None if fmt in ("float32", "gguf") else fmt
    if tiny:
        return LLM(tiny_model("llama"), tiny_tokenizer(), device="cpu", fused_decoder=True, quantization=quantization)
    if fmt == "gguf":
        return LLM("smollm2-135m-instruct")
    return LLM("smollm2-135m-instruct", dtype="float32", quantization=quantization)


def timed_steps(model: ModelExecutor, rows: int, context: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds of `steps` decode steps of `rows` sequences (keys 0..rows-1, each at `context` tokens), rolled back."""
    times = []
    for _ in range(steps):
        batch = [(key, [rng.randrange(3, 300)]) for key in range(rows)]
        start = time.perf_counter()
        model.forward(batch)
        times.append(time.perf_counter() - start)
        for key in range(rows):
            model.truncate(key, context)
    return times


def compare(llm: LLM, rows: int, context: int, steps: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """Median step seconds with the stack on and off, interleaved round by round; None figures where the stack does
    not run this model or these rows."""
    model = llm.engine.model
    fused = model.runner.fused
    stack = None if fused is None else fused.native_stack
    if stack is None or rows > stack.max_rows:
        return {"on": None, "off": None, "max_rows": 0 if stack is None else stack.max_rows}
    rng = random.Random(seed)
    for key in range(rows):
        if not model.reserve(key, context + 1):
            raise RuntimeError("the KV pool is too small for the sequences asked for")
        model.forward([(key, [rng.randrange(3, 300) for _ in range(context)])])
    found: dict[str, list[float]] = {"on": [], "off": []}
    try:
        timed_steps(model, rows, context, steps, rng)  # warm-up, both paths share it
        for index in range(rounds):
            for mode in (("on", "off") if index % 2 == 0 else ("off", "on")):
                fused.native_stack = stack if mode == "on" else None
                found[mode] += timed_steps(model, rows, context, steps, rng)
    finally:
        fused.native_stack = stack
        for key in range(rows):
            model.release(key)
    return {"on": statistics.median(found["on"]), "off": statistics.median(found["off"]), "max_rows": stack.max_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--rows", type=int, default=1, help="sequences per step (one new token each)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per path per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model: checks the script runs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(environment(), "float32"), flush=True)
    for fmt in args.formats:
        if args.tiny and fmt == "gguf":
            print("gguf: skipped with --tiny (the bundled model's blocks only)")
            continue
        llm = build(fmt, args.tiny)
        result = compare(llm, args.rows, args.context, args.steps, args.rounds)
        if result["on"] is None:
            print(f"{fmt:8} the native stack does not run {args.rows}-row steps here (it takes up to "
                  f"{result['max_rows']}; {llm.engine.plan.describe()})")
            continue
        on, off = result["on"], result["off"]
        print(f"{fmt:8} {args.rows} row(s): stack {on * 1000:7.3f} ms, per layer {off * 1000:7.3f} ms per step: "
              f"{(off - on) * 1000:+.3f} ms saved ({off / on:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
