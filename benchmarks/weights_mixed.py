"""decodekit's weight formats side by side on the mixed workload: bf16 (or int8) weights against float32 weights and
transformers' static batching, interleaved rounds in one process (the harness of `decodekit bench`).

The first system named is the reference: the ratios printed are its useful tokens/s over each other's (medians of
per-round ratios). Every decodekit system holds its own copy of the bundled model, loaded in float32; a weight
format is the engine's `quantization`, and a `:kv-bf16` suffix (e.g. `bf16:kv-bf16`) gives that system a bfloat16
KV cache (`kv_cache_dtype`).

Usage: python benchmarks/weights_mixed.py [--weights bf16 float32 bf16:kv-bf16] [--num-requests 16] [--repeats 2]
       [--threads 0] [--no-hf]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from decodekit.bench.baselines import DecodekitSystem, HFGenerateSystem, System
from decodekit.bench.harness import measure, torch_threads
from decodekit.bench.machine import environment, machine_line
from decodekit.bench.workloads import make_workload
from decodekit.models import load_model

FORMATS = ("float32", "bf16", "int8")
SYSTEMS = tuple(f"{weights}{kv}" for weights in FORMATS for kv in ("", ":kv-bf16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", nargs="+", choices=SYSTEMS, default=["bf16", "float32"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-hf", action="store_true", help="leave out transformers' static batching")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    work = make_workload("mixed", loaded.tokenizer, num_requests=args.num_requests)
    def decodekit(system: str) -> Callable[[], System]:
        weights, _, kv = system.partition(":")
        options = {} if weights == "float32" else {"quantization": weights}
        if kv:
            options["kv_cache_dtype"] = "bfloat16"
        return lambda: DecodekitSystem(loaded.model, loaded.tokenizer, "float32", options)

    builders: dict[str, Callable[[], System]] = {f"decodekit {weights}": decodekit(weights) for weights in args.weights}
    if not args.no_hf:
        builders["hf-static"] = lambda: HFGenerateSystem(loaded.model, loaded.tokenizer, work.batch_size)
    with torch_threads(args.threads or None):
        print(machine_line(environment(), "float32"), flush=True)
        print(work.describe(), flush=True)
        figures, ratios, notes = measure(builders, work, args.repeats)
    reference = next(iter(builders))
    for name, figure in figures.items():
        if figure.tokens_per_s is None:
            print(f"{name:22} no figures: {figure.error}")
            continue
        print(f"{name:22} {figure.tokens_per_s:7.1f} useful tok/s" + ("" if name == reference else
                                                                       f"   {reference} / {name}: {ratios[name]:.2f}x"))
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
