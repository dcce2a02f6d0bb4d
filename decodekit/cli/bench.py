"""`decodekit bench [WORKLOAD]`: decodekit beside transformers (and other engines) on one workload."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from decodekit.api.errors import DecodeKitError
from decodekit.bench.workloads import MIXED_FULL_REPEATS, MIXED_FULL_REQUESTS, MIXED_REPEATS, MIXED_REQUESTS
from decodekit.cli import terminal
from decodekit.cli.context import load_context
from decodekit.models import BUNDLED_MODEL_NAME


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
    matrix_only = {"--dtypes": dtypes, "--batches": batches, "--strategies": strategies, "--output": output}
    misplaced = [flag for flag, value in matrix_only.items() if value is not None and workload != "matrix"]
    if misplaced:
        terminal.fail(f"{', '.join(misplaced)} {'is' if len(misplaced) == 1 else 'are'} for `decodekit bench "
                      "matrix`")
    if full and workload != "mixed":
        terminal.fail("--full is for `decodekit bench mixed`")
    if peer_url and workload != "serve":
        terminal.fail("--peer-url is for `decodekit bench serve`; the other workloads take --peer")
    if peer_gguf is not None and not any(p.split("=", 1)[0].strip().lower().startswith("llama")
                                         for p in peer or []):
        terminal.fail("--peer-gguf is for a llama.cpp peer (--peer llama.cpp)")
    if workload == "serve":
        if peer:
            terminal.fail("bench serve runs servers: give a running peer server with --peer-url URL")
        picked = [f"{key}={value}" for key, value in (("model", model), ("dtype", dtype)) if value]
        _bench_serve(recipe_path, [*(overrides or []), *picked], baseline or ["transformers-serve"], clients,
                     num_requests, seed, threads, as_json, peer_url or [])
        return
    peer_specs = _peer_specs(peer or [], peer_gguf)
    from decodekit.bench import RichBenchProgress, render_table, result_json, run_benchmark

    engine_options: dict[str, Any] = {}
    try:
        if recipe_path is not None:
            recipe = load_context().load_recipe(recipe_path, overrides)
            engine_options = recipe.engine_options()
            model, dtype = model or recipe.model, dtype or recipe.dtype
    except (DecodeKitError, ValueError) as exc:
        terminal.fail(str(exc))
    if workload == "matrix":
        _bench_matrix(model, dtype, dtypes, batches, strategies, output_len, repeats, seed, threads, engine_options,
                      recipe_path, overrides or [], output, as_json, peer_specs)
        return
    if workload == "mixed":  # a quick default size; --full: the long run (run_benchmark's own defaults)
        num_requests = (num_requests if num_requests is not None
                        else MIXED_FULL_REQUESTS if full else MIXED_REQUESTS)
        repeats = repeats if repeats is not None else MIXED_FULL_REPEATS if full else MIXED_REPEATS
    kwargs: dict[str, Any] = {"batch_size": batch_size, "output_len": output_len, "seed": seed,
                              "num_threads": threads}
    kwargs.update({k: v for k, v in (("num_requests", num_requests), ("repeats", repeats)) if v is not None})
    if baseline:  # "none": no transformers baseline (decodekit against its --peer engines only)
        kwargs["baselines"] = () if baseline == ["none"] else tuple(baseline)
    if engine_options:
        kwargs["engine_options"] = engine_options
    if peer_specs:
        kwargs["peers"] = peer_specs
    try:
        with RichBenchProgress(terminal.err_console, disable=as_json) as progress:
            result = run_benchmark(workload, model=model or BUNDLED_MODEL_NAME, dtype=dtype or "auto",
                                   progress=progress, **kwargs)
    except (DecodeKitError, ValueError) as exc:
        terminal.fail(str(exc))
    if as_json:
        print(result_json(result))
    else:
        render_table(result, terminal.console)


def _peer_specs(peers: list[str], gguf: Path | None) -> list[Any]:
    """The `--peer` values as `PeerSpec`s (an unknown name fails here, before anything loads)."""
    if not peers:
        return []
    from decodekit.bench.peers import parse_peer

    try:
        return [parse_peer(text, gguf=str(gguf) if gguf is not None else None) for text in peers]
    except DecodeKitError as exc:
        terminal.fail(str(exc))


def _split(value: str | None, flag: str, kind: type[Any] = str) -> list[Any] | None:
    """A comma-separated option as a list (None when not given); a bad item fails with the option's name."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",") if item.strip()]
    try:
        return [kind(item) for item in items] or terminal.fail(f"{flag} names nothing")
    except ValueError:
        terminal.fail(f"{flag} takes comma-separated {'integers' if kind is int else 'names'}, got {value!r}")


def _bench_matrix(model: str | None, dtype: str | None, dtypes: str | None, batches: str | None,
                  strategies: str | None, output_len: int, repeats: int | None, seed: int, threads: int | None,
                  engine_options: dict[str, Any], recipe_path: Path | None, overrides: list[str], output: Path | None,
                  as_json: bool, peers: list[Any] | None = None) -> None:
    """`bench matrix`: every dtype x batch size x strategy cell, decodekit against its transformers baseline (and
    the peers in the greedy cells)."""
    from decodekit.bench import RichBenchProgress, matrix_json, matrix_markdown, render_matrix_table, run_matrix
    from decodekit.bench.matrix import DEFAULT_BATCHES, DEFAULT_DTYPES, STRATEGIES

    dtype_list = _split(dtypes, "--dtypes") or ([dtype] if dtype else list(DEFAULT_DTYPES))
    batch_list = _split(batches, "--batches", int) or list(DEFAULT_BATCHES)
    strategy_list = _split(strategies, "--strategies") or list(STRATEGIES)
    rounds = repeats if repeats is not None else 3
    picked = [f"--recipe {recipe_path}", *(f"--set {item}" for item in overrides)] if recipe_path else []
    if model and not recipe_path:
        picked.append(f"--model {model}")
    command = " ".join(["decodekit bench matrix", *picked,
                        f"--dtypes {','.join(dtype_list)}", f"--batches {','.join(map(str, batch_list))}",
                        f"--strategies {','.join(strategy_list)}", f"--repeats {rounds}",
                        f"--output-len {output_len}",
                        *([f"--threads {threads}"] if threads is not None else []),
                        *(f"--peer {p.kind}{'=' + p.python if p.python else ''}" for p in peers or []),
                        *sorted({f"--peer-gguf {p.gguf}" for p in peers or [] if p.gguf})])
    try:
        with RichBenchProgress(terminal.err_console, disable=as_json) as progress:
            result = run_matrix(model or BUNDLED_MODEL_NAME, dtypes=dtype_list, batches=batch_list,
                                strategies=strategy_list, output_len=output_len, repeats=rounds, seed=seed,
                                engine_options=engine_options, num_threads=threads, progress=progress,
                                peers=peers or [])
    except (DecodeKitError, ValueError) as exc:
        terminal.fail(str(exc))
    if output is not None:
        try:
            output.write_text(matrix_markdown(result, command), encoding="utf-8")
        except OSError as exc:
            terminal.fail(f"cannot write {output}: {exc}")
    if as_json:
        print(matrix_json(result))
    else:
        render_matrix_table(result, terminal.console)
        if output is not None:
            terminal.err_console.print(f"[dim]markdown written to {escape(str(output))}[/dim]")


def _bench_serve(recipe_path: Path | None, overrides: list[str], baseline: list[str], clients: int,
                 num_requests: int | None, seed: int, threads: int | None, as_json: bool,
                 peer_urls: list[str] | None = None) -> None:
    """`bench serve`: both servers as subprocesses, one after the other, the same streamed workload (then any
    OpenAI-compatible server already running at a `--peer-url`)."""
    from decodekit.bench.serving import DEFAULT_RECIPE, render_serve_table, run_serve_benchmark, serve_result_json

    unknown = sorted(set(baseline) - {"transformers-serve", "none"})
    if unknown:
        terminal.fail(f"unknown baseline(s) {unknown} for serve; choose transformers-serve or none")
    sizes: dict[str, Any] = {} if num_requests is None else {"num_requests": num_requests}
    try:
        result = run_serve_benchmark(recipe_path or DEFAULT_RECIPE, overrides, clients=clients, seed=seed,
                                     threads=threads, baseline="none" not in baseline, peer_urls=peer_urls or [],
                                     progress=lambda line: terminal.err_console.print(f"[dim]{escape(line)}[/dim]"),
                                     **sizes)
    except (DecodeKitError, ValueError, RuntimeError) as exc:
        terminal.fail(str(exc))
    if as_json:
        print(serve_result_json(result))
    else:
        render_serve_table(result, terminal.console)
