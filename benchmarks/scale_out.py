"""`decodekit batch` in-process vs over Ray Data with 1 and 2 replicas, side by side in one run, on the bundled model.

    python benchmarks/scale_out.py [--rows 48 96] [--max-tokens 32] [--repeats 2]

Every configuration gets the machine's CPUs: in-process, one engine with all the torch threads; Ray with 1 replica,
one engine with all of them; Ray with 2 replicas, two engines with half each. The Ray cluster is started once,
before the timed runs (its start-up is reported on its own). Each timed run is a whole job, `run_batch` from the
input file to the output file: reading, the replicas' start-up and model loading, generating and writing. The
configurations are interleaved, repeated, and the medians reported.

Ray's cost is the difference from the in-process job with the same CPUs: fitted over the two dataset sizes as a
fixed part (per job: actors, imports, model loading) and a per-row part. The last table puts the measured
per-replica throughput on paper for a larger cluster: a job of `--paper-rows` rows on N replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from decodekit.batch import RayOptions, run_batch
from decodekit.bench.machine import cpu_description
from decodekit.recipe import recipe_from_data

TOPICS = ["the ocean", "volcanoes", "bread", "chess", "the moon", "bicycles", "honeybees", "glaciers", "jazz",
          "libraries", "rainforests", "lighthouses"]
ASKS = ["Explain {} to a child.", "Give three facts about {}.", "Write a short poem about {}.",
        "What is the history of {}?"]


def write_rows(path: Path, count: int) -> None:
    rows = [{"prompt": ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def timed(recipe: Any, source: Path, ray: RayOptions | None, work: Path) -> dict[str, float]:
    out = work / f"out-{time.perf_counter_ns()}.jsonl"
    first: list[float] = []
    start = time.perf_counter()
    summary = run_batch(recipe, source, out, ray=ray, on_row=lambda _: first or first.append(time.perf_counter()))
    wall = time.perf_counter() - start
    assert summary.errors == 0 and summary.written == summary.rows, summary
    out.unlink()
    return {"wall_s": wall, "first_row_s": first[0] - start, "tokens": summary.output_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs=2, default=[48, 96], help="two dataset sizes (for the fit)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per Ray Data batch")
    parser.add_argument("--paper-rows", type=int, default=100_000)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args()

    import ray
    import torch

    cpus = os.cpu_count() or 1
    recipe = recipe_from_data({"model": "smollm2-135m-instruct", "dtype": "float32",
                               "engine": {"kv_cache_memory": "256MiB"},
                               "sampling": {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True},
                               "inputs": {"chat": True}})
    start = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    cluster_start = time.perf_counter() - start
    torch.set_num_threads(cpus)
    configs: dict[str, RayOptions | None] = {
        "in-process": None,
        "ray, 1 replica": RayOptions(replicas=1, cpus_per_replica=cpus, batch_size=args.batch_size),
        f"ray, {cpus} replicas": RayOptions(replicas=cpus, cpus_per_replica=1, batch_size=args.batch_size),
    }
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sources = {}
        for rows in args.rows:
            sources[rows] = work / f"rows-{rows}.jsonl"
            write_rows(sources[rows], rows)
        timed(recipe, sources[args.rows[0]], None, work)  # warm-up: model conversion cache, kernels, page cache
        for _ in range(args.repeats):
            for rows in args.rows:
                for name, ray_options in configs.items():
                    figures = timed(recipe, sources[rows], ray_options, work)
                    results.setdefault((name, rows), []).append(figures)
                    print(f"{name:>16} {rows:4d} rows: {figures['wall_s']:6.2f} s", file=sys.stderr)
    ray.shutdown()
    report(args, cpus, cluster_start, configs, results)


def report(args: Any, cpus: int, cluster_start: float, configs: dict[str, Any],
           results: dict[tuple[str, int], list[dict[str, float]]]) -> None:
    console = Console(width=200)
    machine = cpu_description()
    med = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in results.items()}
    small, large = args.rows
    table = Table(title=f"decodekit batch: bundled SmolLM2-135M, float32, greedy, {args.max_tokens} tokens per row "
                        f"(medians of {args.repeats}; {machine.get('cpu')}, {', '.join(machine.get('cpu_flags', []))},"
                        f" {cpus} CPUs; Ray cluster start {cluster_start:.1f} s, not in the times)")
    for column in ("configuration", "rows", "wall s", "first row s", "rows/s", "tokens/s", "vs in-process"):
        table.add_column(column, justify="right")
    for rows in args.rows:
        base = med[("in-process", rows)]["wall_s"]
        for name in configs:
            m = med[(name, rows)]
            table.add_row(name, str(rows), f"{m['wall_s']:.2f}", f"{m['first_row_s']:.2f}",
                          f"{rows / m['wall_s']:.2f}", f"{m['tokens'] / m['wall_s']:.1f}", f"{base / m['wall_s']:.2f}x")
    console.print(table)

    overhead = Table(title="Ray's cost over the in-process job with the same CPUs (fitted: fixed + per row)")
    for column in ("configuration", "fixed per job s", "per row ms", "steady rows/s", "steady rows/s per replica"):
        overhead.add_column(column, justify="right")
    steady: dict[str, float] = {}
    for name, options in configs.items():
        a, b = med[(name, small)]["wall_s"], med[(name, large)]["wall_s"]
        rate = (large - small) / (b - a) if b > a else float("nan")  # marginal rows/s: what more rows cost
        steady[name] = rate
        if options is None:
            overhead.add_row(name, "-", "-", f"{rate:.2f}", f"{rate:.2f}")
            continue
        base_a, base_b = med[("in-process", small)]["wall_s"], med[("in-process", large)]["wall_s"]
        per_row = ((b - base_b) - (a - base_a)) / (large - small)
        fixed = (a - base_a) - per_row * small
        overhead.add_row(name, f"{fixed:.2f}", f"{per_row * 1000:.1f}", f"{rate:.2f}",
                         f"{rate / options.replicas:.2f}")
    console.print(overhead)

    one = next(name for name, o in configs.items() if o is not None and o.cpus_per_replica == 1)
    per_replica = steady[one] / configs[one].replicas
    fixed = med[(one, small)]["wall_s"] - small / steady[one]
    paper = Table(title=f"On paper: {args.paper_rows:,} rows on N replicas of 1 CPU each, from the measured "
                        f"{per_replica:.2f} rows/s per replica and {fixed:.1f} s per job (start-up), assuming "
                        "each replica keeps its own cores and memory bandwidth")
    for column in ("replicas", "wall", "rows/s", "speedup vs 1 replica"):
        paper.add_column(column, justify="right")
    one_wall = fixed + args.paper_rows / per_replica
    for n in (1, 2, 4, 8, 16, 64, 256):
        wall = fixed + args.paper_rows / (n * per_replica)
        paper.add_row(str(n), f"{wall / 3600:.2f} h" if wall > 3600 else f"{wall / 60:.1f} min",
                      f"{args.paper_rows / wall:.1f}", f"{one_wall / wall:.1f}x")
    console.print(paper)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "cpus": cpus, "cluster_start_s": cluster_start,
                                         "medians": {f"{k[0]}|{k[1]}": v for k, v in med.items()}}, indent=1))


if __name__ == "__main__":
    main()
