"""Two versions of the native kernels' GGUF products side by side in ONE process: a git revision's sources (before)
against the working tree's (after), rounds alternating, the outputs compared bit for bit.

On a shared 2-core machine two timings minutes apart differ by more than most kernel changes gain; two libraries loaded
into the same process and timed in alternating rounds see the same machine, so their paired ratio is what to trust. For
each format and row count it multiplies one stored matrix (`--out` x `--width`, random blocks with sane scales) by
`--rows` activation rows, `--calls` products a round, `--rounds` rounds (each side the blocks as `GgufMatrix` lays them
out for its path, e.g. Q4_1 grouped on AVX2: `stored_matrices.laid_out_for`; `--stored-before`: the before side the
blocks as stored, for a revision that predates a layout, or to set the two layouts side by side with `--before HEAD`),
and prints ns a 32-weight chunk of a weight row for each side (the fastest round and the median), the median of the
rounds' paired ratios (after's speed over before's), and whether every output bit agreed. A small matrix (the default,
~1 MB) sits in cache: the arithmetic alone; a large one (`--out 32768`) streams from memory.

Usage: python benchmarks/kernel_ab.py [--before HEAD] [--stored-before] [--formats Q4_1 Q4_K] [--rows 1 4]
       [--isa avx2] [--out 1024] [--width 1536] [--threads 1] [--rounds 15] [--calls 600]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from decodekit.api.models import StoredWeight
from decodekit.bench.machine import environment, machine_line
from decodekit.execution.fused.stored_matrices import GgufMatrix
from decodekit.execution.kernels import native
from decodekit.execution.kernels.quant import GGUF_FORMATS, INTERLEAVED_Q4_1, interleave_q4_1, row_bytes

ROOT = Path(__file__).resolve().parents[1]
# Where each format's fp16 scales lie in a block (overwritten with small values: random bytes make infinities).
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def sources_at(revision: str, into: Path) -> tuple[Path, ...]:
    """The native sources as they were at `revision`, written under `into` (git show)."""
    paths = []
    for source in native.SOURCES:
        relative = source.relative_to(ROOT).as_posix()
        shown = subprocess.run(["git", "show", f"{revision}:{relative}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode != 0:
            raise SystemExit(f"--before {revision}: git has no {relative} there ({shown.stderr.strip()})")
        text = shown.stdout
        path = into / source.name
        path.write_text(text)
        paths.append(path)
    return tuple(paths)


def kernels_from(sources: tuple[Path, ...]) -> native.NativeKernels:
    """The kernel library built from `sources` (the cache keys on their text), loaded beside any other."""
    saved = native.SOURCES, native.SOURCE
    native.SOURCES, native.SOURCE = sources, sources[0]
    native.load_kernels.cache_clear()
    try:
        kernels = native.load_kernels()
    finally:
        native.SOURCES, native.SOURCE = saved
        native.load_kernels.cache_clear()
    if isinstance(kernels, str):
        raise SystemExit(f"the kernels did not build from {sources[0].parent}: {kernels}")
    return kernels


def stored_blocks(fmt: str, out: int, width: int) -> torch.Tensor:
    """Random blocks of `fmt` for an [out, width] weight, each fp16 scale 0.01 (finite, so outputs compare); `Q4_1x8`:
    such Q4_1 blocks interleaved by 8 rows (`out` a multiple of 8)."""
    if fmt == INTERLEAVED_Q4_1:
        return interleave_q4_1(stored_blocks("Q4_1", out, width))
    data = torch.randint(0, 256, (out, row_bytes(fmt, width)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    blocks = data.view(out, -1, GGUF_FORMATS[fmt][2])  # (type id, weights a block, bytes a block)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for offset in SCALE_OFFSETS[fmt]:
        blocks[:, :, offset:offset + 2] = half
    return data


def compare(fmt: str, rows: int, args: argparse.Namespace, libraries: list[native.NativeKernels]) -> str:
    """One format and row count, before against after: a line of the report."""
    data = stored_blocks(fmt, args.out, args.width)
    matrices = [GgufMatrix([StoredWeight(fmt, data, (args.out, args.width))], None, kernels, args.isa)
                for kernels in libraries]
    # (format, blocks) each side multiplies: as laid out for the path, or the before side's as stored
    laid_out = [(fmt, data) if side == 0 and args.stored_before else matrix.parts[0][1:]
                for side, matrix in enumerate(matrices)]
    x = torch.randn(rows, args.width, generator=torch.Generator().manual_seed(1))
    outputs = [x.new_empty(rows, args.out) for _ in matrices]

    def round_time(side: int) -> float:
        matrix, y = matrices[side], outputs[side]
        side_fmt, weight = laid_out[side]
        start = time.perf_counter()
        for _ in range(args.calls):
            matrix.quant.linear(x, weight, side_fmt, y, isa=args.isa)
        return (time.perf_counter() - start) / args.calls

    round_time(0), round_time(1)  # warm: caches, threads
    same = torch.equal(outputs[0], outputs[1])
    times: tuple[list[float], list[float]] = ([], [])
    for number in range(args.rounds):
        for side in ((0, 1) if number % 2 == 0 else (1, 0)):  # who goes first alternates
            times[side].append(round_time(side))
    chunks = args.out * args.width / 32
    before, after = (min(t) / chunks * 1e9 for t in times)
    before_median, after_median = (statistics.median(t) / chunks * 1e9 for t in times)
    ratio = statistics.median(b / a for b, a in zip(*times, strict=True))
    return (f"{fmt:>5} {rows:>4}   {before:7.2f} ({before_median:7.2f})   {after:7.2f} ({after_median:7.2f})   "
            f"{ratio:6.3f}x   {'equal' if same else 'DIFFER'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="HEAD", help="git revision of the sources to compare against")
    parser.add_argument("--formats", nargs="+", default=["Q4_1", "Q4_K"], choices=sorted(GGUF_FORMATS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--isa", default=None, help="code path (default: the best this CPU has)")
    parser.add_argument("--stored-before", action="store_true",
                        help="the before side multiplies the blocks as stored, not as laid out for the path")
    parser.add_argument("--out", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1536, help="a multiple of 256 (the K-quants' blocks)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=600, help="products a round")
    args = parser.parse_args()
    for fmt in args.formats:
        try:
            row_bytes(fmt, args.width)
        except ValueError as error:
            parser.error(f"--width {args.width}: {error}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        libraries = [kernels_from(sources_at(args.before, Path(folder))), kernels_from(native.SOURCES)]
        args.isa = libraries[1].quant.isa(args.isa)
        print(machine_line(environment(), "float32 activations, GGUF weights", threads=args.threads))
        print(f"before: {args.before}; after: the working tree; {args.out}x{args.width}, path {args.isa}, "
              f"{args.rounds} rounds of {args.calls} products")
        print("ns a chunk of a weight row, fastest round (median)")
        print("  fmt rows   before              after               after's speed   outputs")
        for fmt in args.formats:
            for rows in args.rows:
                print(compare(fmt, rows, args, libraries), flush=True)


if __name__ == "__main__":
    main()
