"""The modes of `decodekit bench`, a registry dispatched in one place (`run_mode`).

The workload names the mode: `batch1`, `batch`, `mixed` and `ttft` run decodekit against the transformers
baselines in one process (`decodekit.bench.run_benchmark`), `matrix` runs every dtype x batch size x strategy cell
(`decodekit.bench.run_matrix`), and `serve` runs `decodekit serve` against `transformers serve` over HTTP
(`decodekit.bench.serving`). A mode names the options that only it takes; given with another workload, they are
refused before anything loads, with the workload they belong to.

The modes are not typer sub-commands on purpose: `decodekit bench` takes its workload as an optional argument
among options every mode shares (`decodekit bench --peer llama.cpp` runs `mixed`; an option may come before the
workload), and `decodekit bench mixed --batches 1` says that `--batches` is for `bench matrix` rather than that no
such option exists. Sub-commands would change both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.markup import escape

from decodekit.api.errors import DecodeKitError
from decodekit.bench.workloads import MIXED_FULL_REPEATS, MIXED_FULL_REQUESTS, MIXED_REPEATS, MIXED_REQUESTS
from decodekit.cli import terminal
from decodekit.cli.context import load_context
from decodekit.models import BUNDLED_MODEL_NAME


@dataclass(frozen=True)
class BenchOptions:
    """Every option of `decodekit bench`, as parsed (None: not given; a repeatable option not given is empty).
    The field `name` is the option `--name` with dashes (`peer_url`: `--peer-url`), except `recipe_path`
    (`--recipe`), `overrides` (`--set`) and `as_json` (`--json`)."""

    workload: str
    recipe_path: Path | None
    overrides: list[str]
    model: str | None
    dtype: str | None
    num_requests: int | None
    batch_size: int
    output_len: int
    repeats: int | None
    full: bool
    baseline: list[str]
    seed: int
    threads: int | None
    clients: int
    dtypes: str | None
    batches: str | None
    strategies: str | None
    output: Path | None
    as_json: bool
    peer: list[str]
    peer_gguf: Path | None
    peer_url: list[str]


@dataclass(frozen=True)
class BenchMode:
    """One mode of `decodekit bench`: what runs it, and the options that only it takes."""

    run: Callable[[BenchOptions], None]
    """Runs the mode and prints its result (a user error ends it through `terminal.fail`)."""

    owns: tuple[str, ...] = ()
    """`BenchOptions` fields of options no other mode takes (each the option `--field-name`)."""

    elsewhere: str = ""
    """Appended to the refusal of its options given with another workload: what that workload takes instead."""


def run_mode(options: BenchOptions) -> None:
    """Refuse the options that belong to another mode than the workload's, then run the workload's mode. An unknown
    workload goes to the transformers harness, whose error names the workloads it knows."""
    for name, mode in MODES.items():
        misplaced = [f"--{field.replace('_', '-')}" for field in mode.owns
                     if name != options.workload and _given(getattr(options, field))]
        if misplaced:
            terminal.fail(f"{', '.join(misplaced)} {'is' if len(misplaced) == 1 else 'are'} for `decodekit bench "
                          f"{name}`{mode.elsewhere}")
    if options.peer_gguf is not None and not any(p.split("=", 1)[0].strip().lower().startswith("llama")
                                                 for p in options.peer):
        terminal.fail("--peer-gguf is for a llama.cpp peer (--peer llama.cpp)")
    MODES.get(options.workload, HARNESS).run(options)


def _given(value: Any) -> bool:
    """Whether an option was given: a flag set, a repeatable option named at least once, any other not None."""
    return bool(value) if isinstance(value, (bool, list)) else value is not None


# ---- the transformers harness: batch1, batch, mixed, ttft --------------------------------------------------------
def _run_harness(options: BenchOptions) -> None:
    """decodekit against the transformers baselines (and any `--peer`) on one workload of `run_benchmark`."""
    options, peers, engine_options = _prepare(options)
    from decodekit.bench import RichBenchProgress, render_table, result_json, run_benchmark

    kwargs: dict[str, Any] = {"batch_size": options.batch_size, "output_len": options.output_len,
                              "seed": options.seed, "num_threads": options.threads}
    kwargs.update({k: v for k, v in (("num_requests", options.num_requests), ("repeats", options.repeats))
                   if v is not None})
    if options.baseline:  # "none": no transformers baseline (decodekit against its --peer engines only)
        kwargs["baselines"] = () if options.baseline == ["none"] else tuple(options.baseline)
    if engine_options:
        kwargs["engine_options"] = engine_options
    if peers:
        kwargs["peers"] = peers
    try:
        with RichBenchProgress(terminal.err_console, disable=options.as_json) as progress:
            result = run_benchmark(options.workload, model=options.model or BUNDLED_MODEL_NAME,
                                   dtype=options.dtype or "auto", progress=progress, **kwargs)
    except (DecodeKitError, ValueError) as exc:
        terminal.fail(str(exc))
    if options.as_json:
        print(result_json(result))
    else:
        render_table(result, terminal.console)


def _run_mixed(options: BenchOptions) -> None:
    """`bench mixed`: the harness at a quick default size; `--full`: the long run (`run_benchmark`'s own
    defaults). A size given explicitly wins either way."""
    full = options.full
    _run_harness(replace(
        options,
        num_requests=options.num_requests if options.num_requests is not None
        else MIXED_FULL_REQUESTS if full else MIXED_REQUESTS,
        repeats=options.repeats if options.repeats is not None else MIXED_FULL_REPEATS if full else MIXED_REPEATS))


def _prepare(options: BenchOptions) -> tuple[BenchOptions, list[Any], dict[str, Any]]:
    """What the in-process modes share before they run: the `--peer` specs (an unknown peer fails first, before
    anything loads), then the `--recipe`'s engine limits, model and dtype (`--model` and `--dtype` win over the
    recipe's). Returns the options with the model and dtype filled in, the peers and the engine options."""
    peers = _peer_specs(options.peer, options.peer_gguf)
    engine_options: dict[str, Any] = {}
    try:
        if options.recipe_path is not None:
            recipe = load_context().load_recipe(options.recipe_path, options.overrides)
            engine_options = recipe.engine_options()
            options = replace(options, model=options.model or recipe.model, dtype=options.dtype or recipe.dtype)
    except (DecodeKitError, ValueError) as exc:
        terminal.fail(str(exc))
    return options, peers, engine_options


def _peer_specs(peers: list[str], gguf: Path | None) -> list[Any]:
    """The `--peer` values as `PeerSpec`s (an unknown name fails here, before anything loads)."""
    if not peers:
        return []
    from decodekit.bench.peers import parse_peer

    try:
        return [parse_peer(text, gguf=str(gguf) if gguf is not None else None) for text in peers]
    except DecodeKitError as exc:
        terminal.fail(str(exc))


# ---- matrix -----------------------------------------------------------------------------------------------------
def _run_matrix(options: BenchOptions) -> None:
    """`bench matrix`: every dtype x batch size x strategy cell, decodekit against its transformers baseline (and
    the peers in the greedy cells)."""
    options, peers, engine_options = _prepare(options)
    from decodekit.bench import RichBenchProgress, matrix_json, matrix_markdown, render_matrix_table, run_matrix
    from decodekit.bench.matrix import DEFAULT_BATCHES, DEFAULT_DTYPES, STRATEGIES

    model, output = options.model, options.output
    dtype_list = _split(options.dtypes, "--dtypes") or ([options.dtype] if options.dtype else list(DEFAULT_DTYPES))
    batch_list = _split(options.batches, "--batches", int) or list(DEFAULT_BATCHES)
    strategy_list = _split(options.strategies, "--strategies") or list(STRATEGIES)
    rounds = options.repeats if options.repeats is not None else 3
    recipe_path = options.recipe_path
    picked = [f"--recipe {recipe_path}", *(f"--set {item}" for item in options.overrides)] if recipe_path else []
    if model and not recipe_path:
        picked.append(f"--model {model}")
    # the command line that makes this table again, written above it in the markdown
    command = " ".join(["decodekit bench matrix", *picked,
                        f"--dtypes {','.join(dtype_list)}", f"--batches {','.join(map(str, batch_list))}",
                        f"--strategies {','.join(strategy_list)}", f"--repeats {rounds}",
                        f"--output-len {options.output_len}",
                        *([f"--threads {options.threads}"] if options.threads is not None else []),
                        *(f"--peer {p.kind}{'=' + p.python if p.python else ''}" for p in peers),
                        *sorted({f"--peer-gguf {p.gguf}" for p in peers if p.gguf})])
    try:
        with RichBenchProgress(terminal.err_console, disable=options.as_json) as progress:
            result = run_matrix(model or BUNDLED_MODEL_NAME, dtypes=dtype_list, batches=batch_list,
                                strategies=strategy_list, output_len=options.output_len, repeats=rounds,
                                seed=options.seed, engine_options=engine_options, num_threads=options.threads,
                                progress=progress, peers=peers)
    except (DecodeKitError, ValueError) as exc:
        terminal.fail(str(exc))
    if output is not None:
        try:
            output.write_text(matrix_markdown(result, command), encoding="utf-8")
        except OSError as exc:
            terminal.fail(f"cannot write {output}: {exc}")
    if options.as_json:
        print(matrix_json(result))
    else:
        render_matrix_table(result, terminal.console)
        if output is not None:
            terminal.err_console.print(f"[dim]markdown written to {escape(str(output))}[/dim]")


def _split(value: str | None, flag: str, kind: type[Any] = str) -> list[Any] | None:
    """A comma-separated option as a list (None when not given); a bad item fails with the option's name."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",") if item.strip()]
    try:
        return [kind(item) for item in items] or terminal.fail(f"{flag} names nothing")
    except ValueError:
        terminal.fail(f"{flag} takes comma-separated {'integers' if kind is int else 'names'}, got {value!r}")


# ---- serve ------------------------------------------------------------------------------------------------------
def _run_serve(options: BenchOptions) -> None:
    """`bench serve`: both servers as subprocesses, one after the other, the same streamed workload (then any
    OpenAI-compatible server already running at a `--peer-url`). `--model` and `--dtype` become overrides of the
    recipe served."""
    if options.peer:
        terminal.fail("bench serve runs servers: give a running peer server with --peer-url URL")
    from decodekit.bench.serving.report import render_serve_table, serve_result_json
    from decodekit.bench.serving.run import DEFAULT_RECIPE, run_serve_benchmark

    picked = [f"{key}={value}" for key, value in (("model", options.model), ("dtype", options.dtype)) if value]
    baseline = options.baseline or ["transformers-serve"]
    unknown = sorted(set(baseline) - {"transformers-serve", "none"})
    if unknown:
        terminal.fail(f"unknown baseline(s) {unknown} for serve; choose transformers-serve or none")
    sizes: dict[str, Any] = {} if options.num_requests is None else {"num_requests": options.num_requests}
    try:
        result = run_serve_benchmark(options.recipe_path or DEFAULT_RECIPE, [*options.overrides, *picked],
                                     clients=options.clients, seed=options.seed, threads=options.threads,
                                     baseline="none" not in baseline, peer_urls=options.peer_url,
                                     progress=lambda line: terminal.err_console.print(f"[dim]{escape(line)}[/dim]"),
                                     **sizes)
    except (DecodeKitError, ValueError, RuntimeError) as exc:
        terminal.fail(str(exc))
    if options.as_json:
        print(serve_result_json(result))
    else:
        render_serve_table(result, terminal.console)


HARNESS = BenchMode(_run_harness)
"""The mode of the transformers harness's workloads (and of a workload no mode knows: the harness refuses it)."""

MODES: dict[str, BenchMode] = {
    # the modes with options of their own are checked in this order, so a command line with two misplaced
    # options is refused for the first of them
    "batch1": HARNESS,
    "batch": HARNESS,
    "ttft": HARNESS,
    "matrix": BenchMode(_run_matrix, owns=("dtypes", "batches", "strategies", "output")),
    "mixed": BenchMode(_run_mixed, owns=("full",)),
    "serve": BenchMode(_run_serve, owns=("peer_url",), elsewhere="; the other workloads take --peer"),
}
"""Each workload of `decodekit bench` and its mode."""
