"""The one-row products of the five-launch GPU layer (`kernels/gpu_layer.linear`) against the copy bandwidth and
cuBLAS, over tile choices.

For each product of a decoder layer in the two shapes of `random_model.py` (q/k/v with the norm inside, the output
product adding into the residual, gate/up with the norm and SiLU-gating, the down product adding into the
residual), bf16, one row: the time of one launch inside a CUDA graph (`triton.testing.do_bench_cudagraph`, so
without launch overhead, as the engine runs it), the weight bytes over that time, and the same for cuBLAS
(`F.linear` alone, no norm or epilogue), for the default tiles (`gpu_layer.one_row_tiles`) and a sweep of
`(block_n, block_k, num_warps)`. Prints one table per shape; the best tile of each product is marked. Then one
decode token's attention launch (`gpu_layer.rope_attend`) over contexts, parts and keys a loop iteration. A product
repeated alone reads a weight that fits the L2 (50-60 MB on an H100/H200) partly from there: the small products'
figures are optimistic; a layer's four back to back (Llama-1B's 116 MiB) read from memory, as a decode step does.

Run on the GPU machine (benchmarks/gpu_session.sh does):

    python benchmarks/gpu_linear.py --shapes llama-1b smollm2-135m
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gpu_step import copy_bandwidth  # benchmarks/ is on the path of a script run from it

from decodekit.execution.kernels import gpu_layer

# (hidden, intermediate, query heads, kv heads, head size) of random_model.py's shapes
SHAPES = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama-1b": (2048, 8192, 32, 8, 64)}
SWEEP = [(n, k, w) for n in (2, 4, 8) for k, w in ((512, 4), (1024, 4), (2048, 8))]


def time_graph(fn: Callable[[], object]) -> float:
    """Seconds per call of `fn` replayed in a CUDA graph (median)."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=30, return_mode="median")) / 1e3


def products(shape: str) -> list[tuple[str, dict[str, Any], torch.Tensor]]:
    """`(name, keyword arguments of gpu_layer.linear, weight)` of one layer's four products."""
    hidden, inter, heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)

    norm = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16)
    return [
        ("q/k/v (+norm)", {"norm_weight": norm, "eps": 1e-5}, weight((heads + 2 * kv_heads) * dim, hidden)),
        ("out (+residual)", {"residual": residual}, weight(hidden, heads * dim)),
        ("gate/up (+norm, silu)", {"norm_weight": norm, "eps": 1e-5, "gated": True}, weight(2 * inter, hidden)),
        ("down (+residual)", {"residual": residual}, weight(hidden, inter)),
    ]


def launch_cost(torch_kernel: bool = False) -> float:
    """Microseconds per launch of a kernel that adds one to one element, 200 back to back in one CUDA graph: the
    floor under each of a graph's dependent launches."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one_kernel(cell_ptr):
        tl.store(cell_ptr, tl.load(cell_ptr) + 1.0)

    def add_one(cell: torch.Tensor) -> None:
        add_one_kernel[(1,)](cell)

    cell = torch.zeros(1, device="cuda")

    def chain() -> None:
        for _ in range(200):
            if torch_kernel:
                cell.add_(1)
            else:
                add_one(cell)

    return time_graph(chain) * 1e6 / 200


def attention_inputs(shape: str, context: int, parts: int, block_size: int = 16) -> tuple[Any, ...]:
    """`gpu_layer.rope_attend`'s arguments for one decode token of `shape` after `context` keys (random bf16 pool,
    blocks in a shuffled order, as a pool that served other requests holds them)."""
    from decodekit.execution.attention.gpu import TokenTable

    _, _, heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(1)
    blocks = -(-(context + 1) // block_size)
    keys = torch.randn(blocks * block_size, kv_heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    values = torch.randn(blocks * block_size, kv_heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).to("cuda")
    table = TokenTable(torch.zeros(1, dtype=torch.long, device="cuda"),
                       torch.tensor([context + 1], device="cuda"), order[None, :], single_query=True, parts=parts)
    slots = (order[context // block_size] * block_size + context % block_size).reshape(1)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=gen, device="cuda").to(torch.bfloat16)
    angles = torch.rand(1, dim // 2, generator=gen, device="cuda")
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(torch.bfloat16)
    return qkv, cos, sin, heads, kv_heads, keys, values, slots, table, block_size, dim ** -0.5


def attention_sweep(shape: str, contexts: tuple[int, ...] = (256, 1024, 4096)) -> None:
    """One decode token's `rope_attend` (RoPE, KV write, paged attention, and the merge launch for several parts)
    alone in a graph, over parts (programs sharing the keys) and keys a loop iteration; prints a table per
    context with the engine's choice (`attention_parts`) marked."""
    from decodekit.execution.attention.gpu import attention_parts

    print(f"\n{shape}: rope_attend of one decode token, µs (parts x keys an iteration; * the engine's parts)")
    blocks_n = (32, 64)
    print("| context | parts | " + " | ".join(f"{b} keys" for b in blocks_n) + " |")
    print("|---|---|" + "---|" * len(blocks_n))
    for context in contexts:
        chosen = attention_parts(1, SHAPES[shape][3], context + 1, torch.device("cuda"))
        for parts in (1, 2, 4, 8, 16):
            args = attention_inputs(shape, context, parts)
            cells = []
            for block_n in blocks_n:
                try:
                    seconds = time_graph(functools.partial(gpu_layer.rope_attend, *args, block_n=block_n))
                    cells.append(f"{seconds * 1e6:.1f}")
                except Exception as error:  # a tile too large for the registers
                    cells.append(type(error).__name__)
            print(f"| {context} | {parts}{'*' if parts == chosen else ''} | " + " | ".join(cells) + " |")


def time_chain(layer: list[tuple[str, dict[str, Any], torch.Tensor]]) -> float:
    """Seconds of a layer's products launched back to back in one graph (each alone is `time_product`)."""
    inputs = [torch.ones(1, weight.shape[1], device="cuda", dtype=weight.dtype) for _, _, weight in layer]
    return time_graph(lambda: [gpu_layer.linear(x, weight, **options)
                               for x, (_, options, weight) in zip(inputs, layer)])


def time_product(x: torch.Tensor, weight: torch.Tensor, options: dict[str, Any], tiles: tuple[int, int, int] | None,
                 cublas: bool = False) -> float:
    """Seconds of one `gpu_layer.linear` launch with `tiles` (None: the default), or of cuBLAS's plain product."""
    if cublas:
        return time_graph(lambda: F.linear(x, weight))
    return time_graph(lambda: gpu_layer.linear(x, weight, tiles=tiles, **options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--products", action=argparse.BooleanOptionalAction, default=True,
                        help="Time the products (--no-products: the attention sweep alone).")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True,
                        help="Also sweep one decode token's attention launch over parts and keys an iteration.")
    args = parser.parse_args()
    os.environ["DECODEKIT_GPU_PDL"] = "0"  # each product alone: a launch after itself gains nothing from it
    rate = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {rate / 1e12:.2f} TB/s; bf16, one row; times inside a "
          f"CUDA graph (median)")
    for shape in args.shapes if args.products else []:
        print(f"\n{shape}:\n| product | weight | cuBLAS | default tiles | best swept tiles |\n|---|---|---|---|---|")
        total = {"cublas": 0.0, "default": 0.0, "best": 0.0}
        for name, options, weight in products(shape):
            x = torch.randn(1, weight.shape[1], device="cuda").to(torch.bfloat16)
            size = weight.numel() * weight.element_size()
            cublas = time_product(x, weight, options, None, cublas=True)
            gated = bool(options.get("gated"))
            default = gpu_layer.one_row_tiles(weight.shape[0] // (2 if gated else 1), weight.shape[1], x.device, gated)
            timed = {default: time_product(x, weight, options, None)}
            for tiles in SWEEP if args.sweep else []:
                if tiles not in timed:
                    try:
                        timed[tiles] = time_product(x, weight, options, tiles)
                    except Exception as error:  # a tile too large for the registers or shared memory
                        print(f"  {name} {tiles}: {type(error).__name__}")
            best = min(timed, key=timed.__getitem__)
            total["cublas"] += cublas
            total["default"] += timed[default]
            total["best"] += timed[best]
            cells = [f"{t * 1e6:.1f} µs ({size / t / 1e12:.2f} TB/s)" for t in (cublas, timed[default], timed[best])]
            print(f"| {name} | {size / 2**20:.1f} MiB | {cells[0]} | {cells[1]} {default} | {cells[2]} {best} |")
        print(f"| a layer's four, each alone | | {total['cublas'] * 1e6:.1f} µs | {total['default'] * 1e6:.1f} µs | "
              f"{total['best'] * 1e6:.1f} µs |")
        layer = products(shape)
        for pdl in ("0", "1"):
            os.environ["DECODEKIT_GPU_PDL"] = pdl
            print(f"| the four back to back in one graph (default tiles, {'programmatic' if pdl == '1' else 'plain'}"
                  f" launches) | | | {time_chain(layer) * 1e6:.1f} µs | |")
    if args.attention:
        os.environ["DECODEKIT_GPU_PDL"] = "0"
        for shape in args.shapes:
            attention_sweep(shape)
    print(f"\nper launch inside a graph, 200 launches of a one-element kernel: {launch_cost():.2f} µs Triton, "
          f"{launch_cost(torch_kernel=True):.2f} µs torch")


if __name__ == "__main__":
    main()
