"""The products of one decoder layer (and the LM head) by rows, in each way decodekit can multiply them on a CPU:
float32 weights (`Matrix`: `dk_gemv` / oneDNN-prepacked float32 / BLAS), bf16 panels in float32 arithmetic
(`Bf16Matrix`, `dk_linear_bf16`), and bf16 on the CPU's own bf16 dot products (`Bf16Matrix(bf16_gemm=True)`,
oneDNN). The shapes are SmolLM2-135M's (q/k/v fused, o, gate/up fused, down, LM head); the three ways are timed
call by call, interleaved, and the medians printed in microseconds, with the layer's sum and the ratio of the bf16
GEMM to the other two.

Usage: python benchmarks/bf16_products.py [--rows 1 2 4 8 16 32 64 128 256] [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from decodekit.bench.machine import environment, machine_line
from decodekit.execution.fused.weight_matrices import Bf16Matrix, Matrix, onednn_bf16_available
from decodekit.execution.kernels.native import load_kernels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
WAYS = ("float32", "bf16 panels", "bf16 gemm")


def onednn_bf16(matrix: Bf16Matrix, x: torch.Tensor) -> torch.Tensor:
    """`matrix`'s product on its oneDNN bf16 copy whatever the rows (`Bf16Matrix` itself takes its panels below
    `BF16_GEMM_MIN_ROWS`)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), matrix.packed, None, "none", [],
                                              "").to(torch.float32)


def median_us(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median microseconds of each call, the calls interleaved round by round after two warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 2):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if isinstance(kernels, str) or not onednn_bf16_available():
        raise SystemExit(f"needs the native kernels and oneDNN's bf16 products: {kernels}")
    print(machine_line(environment(), "float32 / bfloat16"), flush=True)
    g = torch.Generator().manual_seed(0)
    matrices = {}
    for name, (out, width) in SHAPES.items():
        weight = torch.randn(out, width, generator=g) * 0.05
        col = weight.t().contiguous() if out >= width else weight.t()  # down_proj stays row-major, as fused
        matrices[name] = (Matrix(col, None, True, kernels), Bf16Matrix(weight, None, kernels),
                          Bf16Matrix(weight, None, kernels, bf16_gemm=True), width)
    print(f"{'rows':>4} {'product':>8} " + " ".join(f"{way + ' us':>15}" for way in WAYS))
    for rows in args.rows:
        layer = dict.fromkeys(WAYS, 0.0)
        for name, (f32, panels, gemm, width) in matrices.items():
            x = torch.randn(rows, width, generator=g)
            got = median_us({"float32": functools.partial(f32, x), "bf16 panels": functools.partial(panels, x),
                             "bf16 gemm": functools.partial(onednn_bf16, gemm, x)}, args.repeats)
            if name != "lm_head":
                for way in WAYS:
                    layer[way] += got[way]
            print(f"{rows:4} {name:>8} " + " ".join(f"{got[way]:15.1f}" for way in WAYS), flush=True)
        print(f"{rows:4} {'layer':>8} " + " ".join(f"{layer[way]:15.1f}" for way in WAYS)
              + f"   gemm/float32 {layer['bf16 gemm'] / layer['float32']:.2f}"
              + f"   gemm/panels {layer['bf16 gemm'] / layer['bf16 panels']:.2f}", flush=True)


if __name__ == "__main__":
    main()
