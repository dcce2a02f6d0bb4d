"""The cost of a decode step by rows (1..64) for each weight format, beside the time to read its weights once.

For each format decodekit runs the bundled SmolLM2-135M-Instruct in (`float32`; `bf16` weights; `int8` weights; the
bundled GGUF's blocks as stored, Q4_1 and Q8_0), one engine is built and its decode steps of 1, 2, 4, ... 64 rows are
timed (`step_cost.step_costs`: every row one sequence with `--context` cached tokens, shuffled order, median of
`--repeats`). The bound drawn beside each curve is the memory bound of a step: the bytes of weights that format
multiplies (every decoder-layer product and the LM head, as the fused decoder holds them) over the machine's read
bandwidth (a large `torch.sum`, `decodekit.bench.machine.read_bandwidth`, or `--bandwidth`). A step can be no faster
than reading its weights once; at one row the ratio of the two is how near the bound batch-1 decode runs, and as rows
grow the curve leaves the bound where the step becomes compute-bound.

Prints a table, writes the costs as JSON (`--json`) and draws the curves with matplotlib (`--plot FILE.png`: log-log,
one colour per format, its bound dashed). Timings are only meaningful on a quiet machine; `--smoke` runs 1-2 rows
once on the int8 format (checks that the script runs).

Usage: python benchmarks/step_curve.py [--formats float32 bf16 int8 gguf] [--rows 1 2 4 8 16 32 64] [--context 64]
       [--repeats 5] [--threads 2] [--bandwidth GB/s] [--json FILE] [--plot FILE.png] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch
from step_cost import step_costs

from decodekit import LLM
from decodekit.bench.machine import environment, machine_line, read_bandwidth
from decodekit.execution.fused.stored_matrices import GgufMatrix
from decodekit.execution.fused.weight_matrices import Bf16Matrix, Int8Matrix, Matrix

# format name -> the LLM arguments that run it
FORMATS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bf16": {"dtype": "float32", "quantization": "bf16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "gguf": {"dtype": "auto"},
}


def matrix_bytes(matrix: Any) -> int:
    """Bytes of weights one product of `matrix` reads at one row (its bias aside): the float32 weight, the bf16 or
    int8 panels (with the int8 scales), or a GGUF matrix's stored blocks."""
    if isinstance(matrix, Matrix):
        return matrix.weight.numel() * matrix.weight.element_size()
    if isinstance(matrix, Int8Matrix):
        return matrix.panels.nbytes + matrix.scale.nbytes
    if isinstance(matrix, Bf16Matrix):
        return matrix.panels.nbytes
    if isinstance(matrix, GgufMatrix):
        return sum(blocks.nbytes for _, _, blocks in matrix.parts)
    raise TypeError(f"no byte count for {type(matrix).__name__}")


def step_weight_bytes(llm: LLM) -> int:
    """The weights a decode step multiplies: every decoder layer's four products and the LM head."""
    decoder = llm.engine.model.runner.fused
    if decoder is None:
        raise RuntimeError("this engine runs no fused decoder: its weights are not counted here")
    layers = sum(matrix_bytes(getattr(layer, name)) for layer in decoder.layers
                 for name in ("qkv", "o", "gate_up", "down"))
    return layers + matrix_bytes(decoder.lm_head)


def plot_title(env: dict[str, Any], context: int, bandwidth: float) -> str:
    """Two short lines: the CPU, its flags and threads; the context and the read bandwidth of the bound."""
    flags = " ".join(env.get("cpu_flags") or [])
    return (f"{env.get('cpu')}, {env.get('torch_threads', '?')} threads ({flags}), commit {env.get('git_commit')}\n"
            f"decode step by rows, {context} tokens of context; bound: weights at {bandwidth / 1e9:.0f} GB/s")


def draw(curves: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """Step time against rows per format (solid, dots) with its weight-read bound (dashed), log-log, to `path`."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.8))
    for index, (name, curve) in enumerate(curves.items()):
        colour = f"C{index}"
        costs = {int(r): ms for r, ms in curve["costs_ms"].items()}  # JSON keys are strings
        rows = sorted(costs)
        axes.plot(rows, [costs[r] for r in rows], "o-", color=colour,
                  label=f"{name} ({curve['weight_mb']:.0f} MB)")
        axes.axhline(curve["bound_ms"], color=colour, linestyle="--", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    ticks = sorted({int(r) for curve in curves.values() for r in curve["costs_ms"]})
    axes.set_xticks(ticks, [str(t) for t in ticks])
    axes.set_xlabel("rows in the step (sequences decoding one token)")
    axes.set_ylabel("ms per step")
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(title="solid: measured; dashed: weights read once", fontsize=8, title_fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bandwidth", type=float, default=None, help="read bandwidth in GB/s (default: measured)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write the curves here (PNG; needs matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="1-2 rows once, int8 only: checks that it runs")
    parser.add_argument("--from-json", default=None, help="draw --plot from a --json file written before")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as handle:
            record = json.load(handle)
        if args.plot:
            draw(record["curves"], args.plot, plot_title(record["environment"], record["context"],
                                                         record["bandwidth_gbs"] * 1e9))
        return
    if args.smoke:
        args.formats, args.rows, args.repeats = ["int8"], [1, 2], 1
    torch.set_num_threads(args.threads)
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else read_bandwidth()
    line = machine_line(environment(), "float32")
    print(line, f"| read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    curves: dict[str, dict[str, Any]] = {}
    for name in args.formats:
        llm = LLM("smollm2-135m-instruct", **FORMATS[name])
        weight_bytes = step_weight_bytes(llm)
        costs = step_costs(llm.engine.model, max(args.rows), args.context, args.repeats, row_counts=args.rows)
        bound = weight_bytes / bandwidth
        curves[name] = {"weight_mb": weight_bytes / 1e6, "bound_ms": bound * 1e3,
                        "costs_ms": {rows: cost * 1e3 for rows, cost in costs.items()}}
        one = costs[min(costs)]
        print(f"{name}: {weight_bytes / 1e6:.0f} MB of weights a step, bound {bound * 1e3:.2f} ms; "
              f"{min(costs)} row(s) {one * 1e3:.2f} ms = {bound / one:.0%} of the bound "
              f"({weight_bytes / one / 1e9:.1f} GB/s)", flush=True)
        for rows in sorted(costs):
            print(f"  {rows:3} rows: {costs[rows] * 1e3:7.2f} ms  ({costs[rows] / rows * 1e3:6.2f} ms/row, "
                  f"{costs[rows] / bound:5.2f}x the bound)")
        del llm
        gc.collect()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": environment(), "bandwidth_gbs": bandwidth / 1e9, "context": args.context,
                       "curves": curves}, handle, indent=1)
    if args.plot:
        draw(curves, args.plot, plot_title(environment(), args.context, bandwidth))


if __name__ == "__main__":
    main()
