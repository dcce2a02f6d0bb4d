"""Where a batch-1 token goes: the weight products against everything else, per weight format.

    python benchmarks/batch1_overhead.py [--formats float32 bfloat16 int8 gguf] [--tokens 128] [--repeats 5]
                                         [--run-steps 8 1]

One request (a 32-token prompt), greedy, EOS ignored, through `LLM.generate`, as `decodekit bench batch1` runs it.
A token is the generate call's wall time after its first step (the prefill), over the tokens after the first; the
products are the layer stack's weight products timed inside the native library (`dk_stack_product_seconds`: two
clock reads around each product call) plus the LM head's product timed around its call. The rest — norms, RoPE,
KV writes, attention, SiLU-gating, sampling, stop checks, the step's Python — is "outside the products", the share
issue 41 asks under 10% of a token; the second table splits it by the native library's timers of each part (RoPE + KV
write + attention, the RMSNorms, a separate SiLU-gating pass, a decode run's embedding rows and argmaxes), the rest
being the step's Python (the engine's stages; step by step, also the final norm, the argmax and the sampling).
"Of the bound": the weights read once (`step_curve.step_weight_bytes`) at the read bandwidth measured just before
the round (`read_bandwidth`, a 2-thread `torch.sum`), against the round's token: the machine's bandwidth moves by
the minute, so each round is set against its own. Median of `--repeats` rounds per format; the formats' rounds
alternate. Each
format runs once per `--run-steps` value (`decode_run_steps`: 8, the default, runs a lone greedy request's steps
natively 8 at a time; 1 decodes step by step), so the two compare in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from step_curve import step_weight_bytes

from decodekit import LLM, SamplingParams
from decodekit.bench.machine import environment, machine_line, read_bandwidth

FORMATS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "gguf": {"dtype": "auto"},  # the bundled GGUF's Q4_1 blocks as stored
}


class Probe:
    """One format's engine with its product timers wrapped around the LM head and the layer stack."""

    def __init__(self, weights: str, run_steps: int, threads: int) -> None:
        self.name = f"{weights}, runs of {run_steps}" if run_steps > 1 else f"{weights}, step by step"
        self.llm = LLM("smollm2-135m-instruct", device="cpu", decode_run_steps=run_steps, **FORMATS[weights])
        torch.set_num_threads(threads)
        decoder = self.llm.engine.model.runner.fused
        if decoder is None or decoder.native is None or getattr(decoder, "native_stack", None) is None:
            raise SystemExit(f"{weights}: the native layer stack is not running this model; nothing to split")
        self.native = decoder.native
        self.weight_bytes = step_weight_bytes(self.llm)
        self.head_seconds = 0.0
        head = decoder.lm_head

        def timed_head(normed: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = head(normed)
            self.head_seconds += time.perf_counter() - start
            return out

        decoder.lm_head = timed_head
        self.first_step: tuple[float, dict[str, float]] | None = None  # (wall, parts) of the round's first step
        engine = self.llm.engine
        step = engine.step

        def timed_step() -> Any:
            if self.first_step is not None:
                return step()
            start = time.perf_counter()
            out = step()
            self.first_step = (time.perf_counter() - start, self.parts())
            return out

        engine.step = timed_step

    def parts(self) -> dict[str, float]:
        """Seconds of each timed part since the round began (`NativeKernels.stack_seconds`; the products with the LM
        head's)."""
        parts = dict(self.native.stack_seconds() or {})
        parts["products"] = parts.get("products", 0.0) + self.head_seconds
        return parts

    def round(self, prompt: list[int], tokens: int) -> tuple[float, dict[str, float]]:
        """One request: (ms a token, ms of each timed part a token), the prefill step left out; the parts also
        hold "bound": the ms its weights take to read once at the bandwidth measured just before."""
        bound = self.weight_bytes / read_bandwidth() * 1e3
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        self.native.time_stack_products(True)
        self.head_seconds, self.first_step = 0.0, None
        start = time.perf_counter()
        out = self.llm.generate([prompt], params)[0]
        wall = time.perf_counter() - start
        parts = self.parts()
        self.native.time_stack_products(False)
        assert len(out.outputs[0].token_ids) == tokens and self.first_step is not None
        first_wall, first_parts = self.first_step
        per = tokens - 1
        timed = {name: (parts[name] - first_parts.get(name, 0.0)) / per * 1e3 for name in parts}
        return (wall - first_wall) / per * 1e3, {**timed, "bound": bound}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run-steps", type=int, nargs="+", default=[8, 1],
                        help="decode_run_steps values to run each format with")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = [1000 + i for i in range(32)]
    probes = [Probe(name, steps, args.threads) for name in args.formats for steps in args.run_steps]
    for probe in probes:
        probe.round(prompt, 16)  # warm-up: kernels, RoPE tables, allocator
    results: dict[str, list[tuple[float, dict[str, float]]]] = {probe.name: [] for probe in probes}
    for _ in range(args.repeats):
        for probe in probes:
            results[probe.name].append(probe.round(prompt, args.tokens))
    print(f"batch 1, 32-token prompt, {args.tokens} greedy tokens, median of {args.repeats} rounds")
    print("| weights | ms a token | of the bound | products ms | outside the products ms | outside, share of a token |")
    print("|---|---|---|---|---|---|")
    for name, rounds in results.items():
        token = statistics.median(t for t, _ in rounds)
        products = statistics.median(p["products"] for _, p in rounds)
        shares = [(t - p["products"]) / t for t, p in rounds]
        bounds = [p["bound"] / t for t, p in rounds]
        bound = f"{statistics.median(bounds):.0%} (rounds {min(bounds):.0%}-{max(bounds):.0%})"
        print(f"| {name} | {token:.2f} | {bound} | {products:.2f} | {token - products:.2f} | "
              f"{statistics.median(shares):.1%} (rounds {min(shares):.1%}-{max(shares):.1%}) |")
    print()
    print("outside the products, ms a token (medians of the rounds):")
    print("| weights | attention (RoPE, KV write) | norms | separate gating | run's embedding and argmax | "
          "the rest (the step's Python) |")
    print("|---|---|---|---|---|---|")
    for name, rounds in results.items():
        medians = {part: statistics.median(p[part] for _, p in rounds)
                   for part in ("attention", "norms", "gating", "run")}
        rest = statistics.median(t - sum(v for k, v in p.items() if k != "bound") for t, p in rounds)
        print(f"| {name} | " + " | ".join(f"{value:.3f}" for value in medians.values()) + f" | {rest:.3f} |")
    print(f"machine: {machine_line(environment())}")


if __name__ == "__main__":
    main()
