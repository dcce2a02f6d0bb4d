"""`decodekit bench [WORKLOAD]`: decodekit beside transformers (and other engines) on one workload.

One command whose options every workload shares: the workload is an optional argument among them (`decodekit
bench --peer llama.cpp` runs the default, `mixed`), and an option of another workload's is refused with the
workload it belongs to. What each workload runs, and which options are its own, is the registry of modes in
`decodekit.cli.bench_modes`; this module only parses the command line into `BenchOptions`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from decodekit.bench.workloads import MIXED_FULL_REPEATS, MIXED_FULL_REQUESTS, MIXED_REPEATS, MIXED_REQUESTS
from decodekit.cli import terminal
from decodekit.cli.bench_modes import BenchOptions, run_mode


def bench(
    workload: Annotated[str, typer.Argument(help="batch1, batch, mixed, ttft, matrix (dtype x batch size x strategy, "
                                            "each cell against its transformers baseline), or serve (`decodekit "
                                            "serve` against `transformers serve --continuous-batching` over HTTP)."
                                            )] = "mixed",
    recipe_path: Annotated[Path | None, typer.Option("--recipe", help="Take the model, dtype and engine limits "
                                                     "from this recipe (not its sampling: every system runs the "
                                                     "same greedy fixed-length requests). serve: the recipe "
                                                     "served (default recipes/quickstart.yaml).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a key of the --recipe: "
                                                        "key.path=value (repeatable).")] = None,
    model: Annotated[str | None, typer.Option(help="Model to benchmark (default: the recipe's, else "
                                              "smollm2-135m-instruct).")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32, bfloat16 or float16 (default: the recipe's, "
                                              "else auto).")] = None,
    num_requests: Annotated[int | None, typer.Option(help=f"Requests in the mixed workload (default "
                                                     f"{MIXED_REQUESTS}, --full {MIXED_FULL_REQUESTS}); serve: "
                                                     "chat requests (default 64).")] = None,
    batch_size: Annotated[int, typer.Option(help="Batch size (batch workload, HF static batches).")] = 16,
    output_len: Annotated[int, typer.Option(help="Output tokens (batch1/batch/matrix workloads).")] = 64,
    repeats: Annotated[int | None, typer.Option(help=f"Interleaved rounds; medians are reported (default 3; mixed "
                                                f"{MIXED_REPEATS}, --full {MIXED_FULL_REPEATS}).")] = None,
    full: Annotated[bool, typer.Option("--full", help=f"mixed: the long run ({MIXED_FULL_REQUESTS} requests, "
                                       f"{MIXED_FULL_REPEATS} rounds; about 45 minutes on a 2-core CPU) instead of "
                                       f"the quick default ({MIXED_REQUESTS} requests, {MIXED_REPEATS} rounds).")
                    ] = False,
    baseline: Annotated[list[str] | None, typer.Option(help="hf-sequential, hf-static, hf-cb (repeatable), or none "
                                                       "(decodekit and its --peer engines only); serve: "
                                                       "transformers-serve (default) or none.")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's); serve: the servers'.")
                       ] = None,
    clients: Annotated[int, typer.Option(min=1, help="serve: concurrent streaming clients.")] = 16,
    dtypes: Annotated[str | None, typer.Option("--dtypes", help="matrix: comma-separated dtypes (default "
                                               "float32,auto; auto is bfloat16 on CUDA and on a CPU with bf16 dot "
                                               "products, else float32; a dtype runs once however often it is "
                                               "named).")] = None,
    batches: Annotated[str | None, typer.Option("--batches", help="matrix: comma-separated batch sizes (default "
                                                "1,8,64).")] = None,
    strategies: Annotated[str | None, typer.Option("--strategies", help="matrix: comma-separated strategies "
                                                   "(default greedy,speculative,beam).")] = None,
    output: Annotated[Path | None, typer.Option("--output", help="matrix: also write the table as markdown to "
                                                "this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table (and no progress bar).")
                       ] = False,
    peer: Annotated[list[str] | None, typer.Option("--peer", help="Run another engine beside decodekit on the same "
                                                   "token ids (repeatable): vllm=/path/to/python (vLLM's CPU build "
                                                   "in its own environment) or llama.cpp[=/path/to/python] "
                                                   "(llama-cpp-python, one request at a time; default: this "
                                                   "Python). See docs/peers.md.")] = None,
    peer_gguf: Annotated[Path | None, typer.Option("--peer-gguf", help="llama.cpp peer: the GGUF file to read "
                                                   "(default: one made from the bundled Q4_1 file in the precision "
                                                   "paired with decodekit's: F32, BF16, or Q8_0 with int8).")] = None,
    peer_url: Annotated[list[str] | None, typer.Option("--peer-url", help="serve: also send the workload to an "
                                                       "OpenAI-compatible server already running at this URL "
                                                       "(`vllm serve`, `llama-server`, ...), as [name=]URL "
                                                       "(repeatable).")] = None,
) -> None:
    """Run decodekit and transformers side by side on one workload; print medians and ratios, and the machine."""
    terminal.setup_logging(True)
    run_mode(BenchOptions(
        workload=workload, recipe_path=recipe_path, overrides=overrides or [], model=model, dtype=dtype,
        num_requests=num_requests, batch_size=batch_size, output_len=output_len, repeats=repeats, full=full,
        baseline=baseline or [], seed=seed, threads=threads, clients=clients, dtypes=dtypes, batches=batches,
        strategies=strategies, output=output, as_json=as_json, peer=peer or [], peer_gguf=peer_gguf,
        peer_url=peer_url or []))
