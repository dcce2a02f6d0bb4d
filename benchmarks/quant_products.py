"""GGUF quantized weights multiplied as stored (`GgufMatrix`), per format and row count, against the memory bound.

For each format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) a model's worth of decoder-layer products (SmolLM2-135M's shapes,
`--layers` of them, so the weights stream from memory as a decode step's do; the K-quants' 256-weight blocks need
widths padded to 768 and 1536) is multiplied by 1 to 64 rows, each way decodekit can:
  - `native`: the kernel that dequantizes blocks in registers (`dk_quant_linear`), on each code path this CPU has
    (`--isa`, default all: avx512, avx2, portable);
  - `gemm`: blocks of rows dequantized to float32, then BLAS (`dequantized_mm`: what `GgufMatrix` runs above
    GGUF_NATIVE_MAX_ROWS rows).
Each pass's median time gives the bytes of stored weights read per second (GB/s) and that rate as a fraction of the
machine's read bandwidth (a large `torch.sum`, measured first; `--bandwidth` to give it). The native/gemm crossover
per format is the row count GGUF_NATIVE_MAX_ROWS should take (`execution/fused/stored_matrices.py`).

Timings are only meaningful on a quiet machine; `--smoke` runs tiny sizes once (a check that the script runs).

Usage: python benchmarks/quant_products.py [--rows 1 2 4 8 16 32 64] [--formats Q4_1 Q8_0 ...] [--isa avx512 ...]
       [--layers 30] [--threads 2] [--repeats 10] [--bandwidth GB/s] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from decodekit.api.models import StoredWeight
from decodekit.bench.machine import environment, machine_line, read_bandwidth
from decodekit.execution.fused.stored_matrices import GgufMatrix
from decodekit.execution.fused.weight_matrices import dequantized_mm
from decodekit.execution.kernels.native import load_kernels
from decodekit.execution.kernels.quant import GGUF_FORMATS, row_bytes

# One SmolLM2-135M layer's products (out, in): q/k/v fused, o, gate/up fused, down.
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def layer_shapes(fmt: str, layers: int) -> list[tuple[int, int]]:
    """`layers` layers' product shapes, widths rounded up to whole blocks of `fmt`."""
    per_block = GGUF_FORMATS[fmt][1]
    return [(out, -(-width // per_block) * per_block) for out, width in LAYER] * layers


def random_matrices(fmt: str, shapes: list[tuple[int, int]], kernels, isa: str) -> list[GgufMatrix]:
    """One `GgufMatrix` of random bytes per shape (timing only: the values do not matter, except finite scales,
    which random bytes may not give, so every byte is kept below 0x7C: fp16 exponents short of infinity)."""
    g = torch.Generator().manual_seed(0)
    matrices = []
    for out, width in shapes:
        data = torch.randint(0, 0x7C, (out, row_bytes(fmt, width)), dtype=torch.uint8, generator=g)
        matrices.append(GgufMatrix([StoredWeight(fmt, data, (out, width))], None, kernels, isa))
    return matrices


def native_pass(matrices: list[GgufMatrix], inputs: list[torch.Tensor], fmt: str) -> None:
    """Every matrix's native product (`dk_quant_linear` on the matrix's code path), whatever the rows."""
    for matrix, x in zip(matrices, inputs):
        _, laid_out, blocks = matrix.parts[0]  # the format as laid out (Q4_1 may be interleaved: `laid_out_for`)
        matrix.quant.linear(x, blocks, laid_out, x.new_empty(x.shape[0], matrix.out_dim), isa=matrix.isa)


def gemm_pass(matrices: list[GgufMatrix], inputs: list[torch.Tensor]) -> None:
    """Every matrix's product by dequantized blocks and BLAS (`dequantized_mm`), whatever the rows."""
    for matrix, x in zip(matrices, inputs):
        dequantized_mm(x, None, matrix.out_dim, matrix.dequantized_blocks())


def median_seconds(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, interleaved round by round after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--formats", nargs="+", default=list(GGUF_FORMATS), choices=list(GGUF_FORMATS))
    parser.add_argument("--isa", nargs="+", default=None, help="code paths to time (default: all this CPU has)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bandwidth", type=float, default=None, help="read bandwidth in GB/s (default: measured)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.layers, args.repeats = [1, 3], 1, 1
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if isinstance(kernels, str):
        raise SystemExit(f"needs the native kernels: {kernels}")
    isas = args.isa or list(reversed(kernels.quant.available))
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else 1e9 if args.smoke else read_bandwidth()
    print(machine_line(environment(), "float32 activations, GGUF weights"), flush=True)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s{' (smoke: not measured)' if args.smoke else ''}")
    print(f"{'format':>6} {'rows':>4} {'MB':>7} " + " ".join(f"{way + ' GB/s (bound)':>24}"
                                                         for way in [*isas, "gemm"]))
    for fmt in args.formats:
        shapes = layer_shapes(fmt, args.layers)
        ways = {isa: random_matrices(fmt, shapes, kernels, isa) for isa in isas}
        stored = sum(m.parts[0][2].numel() for m in ways[isas[0]])
        g = torch.Generator().manual_seed(1)
        for rows in args.rows:
            inputs = [torch.randn(rows, width, generator=g) for _, width in shapes]

            calls: dict[str, Callable[[], object]] = {
                isa: functools.partial(native_pass, matrices, inputs, fmt) for isa, matrices in ways.items()}
            calls["gemm"] = functools.partial(gemm_pass, ways[isas[0]], inputs)
            seconds = median_seconds(calls, args.repeats)
            cells = [f"{stored / s / 1e9:9.2f} ({stored / s / bandwidth:5.0%})" for s in seconds.values()]
            print(f"{fmt:>6} {rows:4} {stored / 1e6:7.1f} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
