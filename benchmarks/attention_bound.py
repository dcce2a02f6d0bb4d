"""The native paged attention of a batched decode step against the KV-read bound, by context length.

One layer of SmolLM2's shape (9 query heads on 3 KV heads of 64; `--heads/--kv-heads/--head-dim` for others):
`--rows` sequences of `context` cached tokens each score one new token; `dk_rope_cache_attend` (RoPE, KV write,
attention) is timed alone, and the bytes of keys and values it must read (`rows * context * kv_heads * head_dim *
2 * element size`) are divided by its median time: the KV-read rate, to set against the machine's read bandwidth
(`--bandwidth`, measured here by a large `torch.sum` when not given). Pools are laid out block by block in a
shuffled order, as a long-running server's are.

`--build avx2` (on an AVX-512 CPU) compiles and times the library as an AVX2 + FMA CPU builds it (8-key tiles), to
compare that kind's paths on this machine.

Usage: python benchmarks/attention_bound.py [--rows 32] [--contexts 64 256 1024 4096] [--kv-dtype float32|bfloat16]
       [--threads 2] [--repeats 20] [--build native|avx2] [--layers 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from decodekit.bench.machine import environment, machine_line, read_bandwidth
from decodekit.execution.kernels.native import SOURCES, DecodeAttentionPlan, NativeKernels, find_compiler, load_kernels


def avx2_build() -> NativeKernels:
    """The kernels compiled as for an AVX2 + FMA CPU (`-march=native -mno-avx512f`), in a temporary folder."""
    import subprocess
    import tempfile

    compiler = find_compiler()
    assert compiler is not None, "no C compiler"
    library = Path(tempfile.mkdtemp()) / "avx2.so"
    subprocess.run([compiler, "-O3", "-march=native", "-mno-avx512f", "-ffp-contract=off", "-fPIC", "-shared",
                    "-std=c11", "-fopenmp", "-o", str(library), *map(str, SOURCES), "-lm"], check=True)
    return NativeKernels(library)


def time_attention(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                   repeats: int, block_size: int = 16, kernels: NativeKernels | None = None,
                   layers: int = 1) -> dict[str, float]:
    """Median seconds of one layer's `rope_cache_attend` for `rows` sequences at `context` cached tokens, by path
    (`tiled`: 16 keys at a time, where the library has it; `keywise`: key by key; `bf16 dot`: the tiled path on bf16
    dot products, for a bf16 pool on a library built for AVX512-BF16), the paths interleaved call by call.

    With `layers` > 1 each call reads the next of that many layers' pools, as a decode step does (30 layers for
    SmolLM2): a layer's keys and values are then cold in the caches, where one layer's pool read again and again
    stays in them (up to its size)."""
    if kernels is None:
        loaded = load_kernels()
        assert not isinstance(loaded, str), loaded
        kernels = loaded
    per_seq = -(-(context + 1) // block_size)
    pools = []
    for _ in range(layers):
        order = torch.arange(rows * per_seq) if os.environ.get("SEQUENTIAL") else torch.randperm(rows * per_seq)
        blocks = order.view(rows, per_seq) + 1
        pool_blocks = rows * per_seq + 2
        keys = torch.randn(pool_blocks * block_size, kv_heads, head_dim).to(kv_dtype)
        values = torch.randn(pool_blocks * block_size, kv_heads, head_dim).to(kv_dtype)
        tables = [blocks[r].tolist() for r in range(rows)]
        slots = torch.tensor([tables[r][context // block_size] * block_size + context % block_size
                              for r in range(rows)])
        plan = DecodeAttentionPlan(slots, [1] * rows, [context] * rows, tables, block_size)
        positions = torch.full((rows,), context, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.cat([positions[:, None] * inv, positions[:, None] * inv], dim=-1)
        plan.set_rope(angles.cos(), angles.sin())
        pools.append((keys, values, plan))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    paths: dict[str, tuple[bool, bool]] = {"keywise": (False, False)}
    if kernels.tiled_attention:
        paths["tiled"] = (True, False)
    if kv_dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= kernels.dot_attention_max_dim:
        paths["bf16 dot"] = (True, True)
    times: dict[str, list[float]] = {path: [] for path in paths}
    calls = 0
    for i in range(repeats + 3):
        for path, (tiled, dot) in paths.items():
            keys, values, plan = pools[calls % layers]
            calls += 1
            work = qkv.clone()
            start = time.perf_counter()
            kernels.rope_cache_attend(work, heads, kv_heads, keys, values, plan, head_dim ** -0.5, tiled=tiled,
                                      bf16_dot=dot)
            if i >= 3:
                times[path].append(time.perf_counter() - start)
    return {path: statistics.median(values) for path, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=1,
                        help="cycle through this many layers' pools (cold KV, as a step reads it; 1: one warm pool)")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="read bandwidth in GB/s (0: measure it)")
    parser.add_argument("--build", choices=["native", "avx2"], default="native",
                        help="this CPU's build, or the AVX2 + FMA one (on an AVX-512 CPU)")
    args = parser.parse_args()
    kernels = avx2_build() if args.build == "avx2" else None
    torch.set_num_threads(args.threads)
    kv_dtype = getattr(torch, args.kv_dtype)
    bandwidth = args.bandwidth * 1e9 or read_bandwidth()
    print(machine_line(environment(), args.kv_dtype), f"| read bandwidth {bandwidth / 1e9:.1f} GB/s | "
          f"{args.build} build | {args.layers} layer{'s' if args.layers > 1 else ''} of pools", flush=True)
    print(f"{'context':>7} {'rows':>4} {'path':>8} {'ms/layer':>9} {'KV MB':>7} {'GB/s':>6} {'of bound':>8}")
    for context in args.contexts:
        by_path = time_attention(args.rows, context, args.heads, args.kv_heads, args.head_dim, kv_dtype,
                                 args.repeats, kernels=kernels, layers=args.layers)
        kv_bytes = args.rows * (context + 1) * args.kv_heads * args.head_dim * 2 * kv_dtype.itemsize
        for path, seconds in by_path.items():
            rate = kv_bytes / seconds
            print(f"{context:7} {args.rows:4} {path:>8} {seconds * 1e3:9.3f} {kv_bytes / 1e6:7.2f} {rate / 1e9:6.1f} "
                  f"{rate / bandwidth:8.0%}", flush=True)


if __name__ == "__main__":
    main()
