"""The `decodekit` command line (typer + rich). Thin: parse, call the Python API, render."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from decodekit.api.errors import DecodeKitError
from decodekit.bench.workloads import MIXED_FULL_REPEATS, MIXED_FULL_REQUESTS, MIXED_REPEATS, MIXED_REQUESTS
from decodekit.models import BUNDLED_MODEL_NAME
from decodekit.tables import print_table

if TYPE_CHECKING:
    from pydantic import ValidationError

app = typer.Typer(help="decodekit: composable decoding strategies on a paged, continuously batched engine.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def render_summary(summary: dict[str, Any]) -> None:
    """Print the summary table (the figures of `decodekit.recipe_runner.summarize`)."""
    table = Table(title="summary", show_header=False)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    table.add_row("requests", str(summary["requests"]))
    several = summary.get("sequences", summary["requests"]) > summary["requests"]
    if several:  # n > 1 or beam search's num_return_sequences: the token figures below count every sequence
        table.add_row("returned sequences", str(summary["sequences"]))
    table.add_row("output tokens" + (" (all sequences)" if several else ""), str(summary["output_tokens"]))
    table.add_row("wall time", f"{summary['wall_s']:.2f} s")
    table.add_row("tokens/s", f"{summary['tokens_per_s']:.1f}" if summary["tokens_per_s"] else "-")
    table.add_row("TTFT p50 / p90", f"{ms(summary['ttft_p50_s'])} / {ms(summary['ttft_p90_s'])}")
    table.add_row("TPOT p50 / p90" + (" (per step)" if several else ""),
                  f"{ms(summary['tpot_p50_s'])} / {ms(summary['tpot_p90_s'])}")
    table.add_row("finish reasons", ", ".join(f"{k}: {v}" for k, v in summary["finish_reasons"].items()))
    if summary.get("acceptance_rate") is not None:
        table.add_row("draft acceptance", f"{summary['acceptance_rate']:.1%} "
                                          f"({summary['accepted_tokens']} of {summary['draft_tokens']} tokens)")
        by_proposer = summary.get("proposer_tokens") or {}
        if len(by_proposer) > 1:  # a chain: each proposer's share
            for name, counts in by_proposer.items():
                rate = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
                table.add_row(f"  by {name}", f"{rate:.1%} ({counts['accepted']} of {counts['drafted']} tokens)")
    if summary.get("speedup_vs_plain") is not None:
        # the speedup and the two rates it is the ratio of (each strategy's mean over its runs of the comparison),
        # both counted on each request's first answer, so several returned sequences do not inflate one side
        table.add_row("speedup vs plain sample", f"{summary['speedup_vs_plain']:.2f}x "
                                                 f"({summary['strategy_tokens_per_s']:.1f} vs "
                                                 f"{summary['plain_tokens_per_s']:.1f} mean tokens/s"
                                                 + (" of each request's first answer)" if several else ")"))
    if summary.get("errors"):
        table.add_row("failed requests", str(len(summary["errors"])))
    if summary.get("bad_inputs"):
        table.add_row("bad input lines", "\n".join(summary["bad_inputs"]))
    console.print(table)


@app.command()
def generate(
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A prompt (repeatable).")],
    model: Annotated[str, typer.Option(help="Model: bundled name, folder, .gguf or hub id.")] = "smollm2-135m-instruct",
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = True,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Per-request seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if available).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text and a table.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Less logging.")] = False,
) -> None:
    """Generate answers for prompts with the engine, then print them and a summary table."""
    _setup_logging(quiet or as_json)
    from pydantic import ValidationError

    from decodekit import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop=stop or [])
    except ValidationError as exc:
        _fail(_flag_errors(exc))
    except ValueError as exc:
        _fail(str(exc))
    try:
        llm = LLM(model, dtype=dtype, device=device)
        texts = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompt]
        start = time.perf_counter()
        outputs = llm.generate(texts, params, add_special_tokens=not chat)
        wall = time.perf_counter() - start
    except DecodeKitError as exc:
        _fail(str(exc))
    from decodekit.recipe_runner import summarize

    summary = summarize(outputs, wall)
    if as_json:
        rows = [{"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                 "error": o.error, "metrics": o.metrics.as_dict()} for p, o in zip(prompt, outputs)]
        print(json.dumps({"outputs": rows, "summary": summary}))
        return
    for p, o in zip(prompt, outputs):
        console.print(f"[bold cyan]>>> {p}[/]")
        console.print(o.text if o.error is None else f"[red]error: {o.error}[/]")
    render_summary(summary)


def _flag_errors(exc: ValidationError) -> str:
    """`SamplingParams` errors as the command line's flags: `--temperature: must be greater than or equal to 0,
    got -1.0` (one line per error)."""
    import re

    lines = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        field = next((str(part) for part in err["loc"] if isinstance(part, str)), "")
        if not field:  # a check across fields names the field in backticks: "`stop` strings must be non-empty"
            named = re.search(r"`(\w+)`", message)
            field = named.group(1) if named else ""
        flag = f"--{field.replace('_', '-')}" if field else "the sampling options"
        got = err.get("input")
        if not isinstance(got, (dict, list)) and f"got {got!r}" not in message:
            message += f", got {got!r}"
        lines.append(f"{flag}: {message}")
    return "\n".join(lines)


@app.command()
def run(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file (see docs/recipes.md).")],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="A prompt (repeatable); replaces the "
                                                     "recipe's inputs.")] = None,
    prompts: Annotated[Path | None, typer.Option(help="A .jsonl or .txt prompts file; replaces the recipe's "
                                                 "inputs.")] = None,
    output: Annotated[Path | None, typer.Option(help="Write one JSON line per request (default: the recipe's "
                                                "outputs.file).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text and a table.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, less logging.")] = False,
    trace: Annotated[Path | None, typer.Option(help="Record the decoding trace (`sampling.trace`, default 5 "
                                               "candidates per stage) and write it here, one JSON line per "
                                               "request.")] = None,
) -> None:
    """Run a recipe over its prompts; print the answers and a summary table.

    Exit status: 0 when every request ran; 1 when some input lines were bad, some requests failed (the others
    still run and are written) or an output file could not be written after all (its lines are printed instead);
    2 when nothing could run (an invalid recipe, an output file that cannot be written, a model that does not
    load).
    """
    _setup_logging(quiet or as_json)
    from decodekit.core.plan import Components
    from decodekit.core.plugin_manager import get_plugin_manager
    from decodekit.core.registry import Registry
    from decodekit.recipe import check_machine, load_recipe
    from decodekit.recipe_runner import DEFAULT_TRACE, output_row, read_inputs, run_recipe, summarize, trace_row

    try:
        pm = get_plugin_manager()
        registry = Registry.from_plugin_manager(pm)
        recipe = load_recipe(recipe_path, overrides or [], registry=registry)
        if trace is not None and recipe.sampling.trace is None:
            recipe = load_recipe(recipe_path, [*(overrides or []), f"sampling.trace={DEFAULT_TRACE}"],
                                 registry=registry)
        target = output or (Path(recipe.outputs.file) if recipe.outputs.file else None)
        # a file that cannot be written fails now, not after the whole run with its results lost
        for flag, path in (("--output" if output else "outputs.file", target), ("--trace", trace)):
            if path is not None:
                _check_writable(path, flag)
        requests, bad = read_inputs(recipe, Components(registry), prompt or [], prompts)
        if not requests:
            _fail(f"{recipe.source}: no prompts to run: give --prompt, --prompts, or inputs.prompts / inputs.file"
                  + "".join(f"\n  {b}" for b in bad))
        check_machine(recipe)  # the device, CUDA graphs and KV memory, before the model loads
        for b in bad:
            err_console.print(f"[yellow]skipped[/] {escape(str(b))}", soft_wrap=True)
        llm = recipe.build_llm(pm)
        with _progress(len(requests) * (3 if recipe.outputs.compare_plain else 1), quiet or as_json) as on_output:
            result = run_recipe(recipe, llm, requests, on_output)
    except DecodeKitError as exc:
        _fail(str(exc))
    summary = summarize(result.outputs, result.wall_s, bad, result.plain_outputs, result.plain_wall_s,
                        result.strategy_wall_s)
    rows = [output_row(r, o) for r, o in zip(result.requests, result.outputs)]
    rows += [{"id": b.id, "input": b.where, "error": b.message} for b in bad]
    if as_json:
        print(json.dumps({"recipe": recipe.source, "model": recipe.model, "summary": summary, "outputs": rows}))
    else:
        for request, out in zip(result.requests, result.outputs):
            _print_answer(request.prompt, out)
        render_summary(summary)
    unwritten = False
    if target is not None:  # with --json, the rows are in the object printed above
        unwritten |= not _write_lines(target, rows, echo=None if as_json else sys.stdout)
    if trace is not None:  # with --json, stdout holds one object: the trace lines go to stderr
        unwritten |= not _write_lines(trace, [trace_row(r, o) for r, o in zip(result.requests, result.outputs)],
                                      echo=sys.stderr if as_json else sys.stdout)
    if summary["errors"] or bad or unwritten:
        raise typer.Exit(1)


def _check_writable(target: Path, flag: str) -> None:
    """Fail now (exit 2, naming the option) when `target` cannot be written: a folder, a missing folder, no
    permission. A file that did not exist is created to find out, then removed."""
    if target.is_dir():
        _fail(f"{flag} {target}: is a folder; give a file path, e.g. {target / 'out.jsonl'}")
    existed = target.exists()
    try:
        with target.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        _fail(f"{flag} {target}: cannot be written ({reason}); nothing was run")
    if not existed:
        target.unlink(missing_ok=True)


def _write_lines(target: Path, rows: list[dict[str, Any]], echo: Any) -> bool:
    """Write one JSON object per line. When the file cannot be written after all (it was checked before the run),
    say so and print the lines to `echo` (a stream; None: they are printed already) instead of losing them;
    returns whether the file was written."""
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    try:
        target.write_text(lines, encoding="utf-8")
        return True
    except OSError as exc:
        where = (" (its rows are in the JSON printed above)" if echo is None
                 else f"; its lines follow on {'stderr' if echo is sys.stderr else 'stdout'}")
        err_console.print(f"[bold red]error:[/] cannot write {escape(str(target))}: {escape(str(exc))}{where}",
                          soft_wrap=True)
        if echo is not None:
            echo.write(lines)
            echo.flush()
        return False


@contextmanager
def _progress(total: int, hidden: bool) -> Iterator[Callable[[Any], None]]:
    """A progress bar on stderr (requests done, tokens/s); yields the engine's `on_output` callback."""
    columns = (SpinnerColumn(), TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} tokens/s"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True, disable=hidden) as progress:
        task = progress.add_task("run", total=total, rate="-")
        start, tokens = time.perf_counter(), 0

        def on_output(out: Any) -> None:
            nonlocal tokens
            tokens += sum(len(ids) for ids in out.delta_token_ids)
            rate = f"{tokens / max(time.perf_counter() - start, 1e-9):.1f}"
            progress.update(task, advance=1 if out.finished else 0, rate=rate)

        yield on_output


def _print_answer(prompt: str, out: Any) -> None:
    console.print(f"[bold cyan]>>> {escape(prompt)}[/]", soft_wrap=True, highlight=False)
    if out.error is not None:
        console.print(f"[red]error: {escape(out.error)}[/]", soft_wrap=True)
    elif len(out.outputs) == 1:
        console.print(escape(out.text), soft_wrap=True, highlight=False)
    else:
        for choice in out.outputs:
            score = "" if choice.score is None else f" (score {choice.score:.3f})"
            console.print(f"[dim]\\[{choice.index}]{score}[/] {escape(choice.text)}", soft_wrap=True,
                          highlight=False)


@app.command()
def trace(
    trace_path: Annotated[Path, typer.Argument(metavar="FILE", help="A trace file, written by `decodekit run "
                                               "RECIPE --trace FILE`.")],
    html: Annotated[Path | None, typer.Option(help="Write a self-contained HTML page here (click a token to see "
                                              "its step) instead of printing.")] = None,
    request: Annotated[str | None, typer.Option(help="Only this request: its id, else its 0-based position in "
                                                "the file.")] = None,
    sequence: Annotated[int | None, typer.Option(help="Only this output of each request (n > 1, beam search).")
                        ] = None,
    token: Annotated[int | None, typer.Option(help="Show this token's step in detail: each stage's candidates, how "
                                              "it was chosen, drafts, beams (with --html: select it).")] = None,
    steps: Annotated[str | None, typer.Option(help="Show these steps in detail: A:B (token indices, B excluded; "
                                              "A: or :B for an open end).")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Show every step in detail.")] = False,
) -> None:
    """Look at a decoding trace: each token coloured by its probability, and for the steps asked for, the candidates
    stage by stage (model, then each processor), how the token was chosen, drafts, beam decisions and the stop."""
    from decodekit.trace_view import (
        only_sequence,
        parse_steps,
        read_trace,
        render_terminal,
        select_requests,
        write_html,
    )

    try:
        chosen = select_requests(read_trace(trace_path), request)
        span = parse_steps(steps) if steps is not None else None
    except DecodeKitError as exc:
        _fail(str(exc))
    if html is None:
        render_terminal(chosen, console, sequence=sequence, token=token, steps=span, show_all=show_all)
        return
    chosen = only_sequence(chosen, sequence)
    first = chosen[0]
    out_index = sequence if sequence is not None else (first.outputs[0].index if first.outputs else 0)
    select = None if token is None else {"request": first.id, "output": out_index, "token": token}
    try:
        write_html(chosen, html, source=str(trace_path), select=select)
    except OSError as exc:
        _fail(f"cannot write {html}: {exc}")
    tokens = sum(len(o.steps) for r in chosen for o in r.outputs)
    console.print(f"wrote {escape(str(html))} ({len(chosen)} request{'s' if len(chosen) != 1 else ''}, {tokens} "
                  f"tokens): open it in a browser, e.g. {escape(html.resolve().as_uri())}", soft_wrap=True,
                  highlight=False)


@app.command()
def serve(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file: the model, engine limits and "
                                                "every request's defaults (see docs/serving.md).")],
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="DECODEKIT_API_KEY", show_default=False,
                                                help="Require `Authorization: Bearer KEY` on /v1/* (401 "
                                                "otherwise); /health and /metrics stay open.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Another name the model answers to (listed first "
                                                          "by /v1/models).")] = None,
    max_waiting: Annotated[int | None, typer.Option(min=1, help="Answer 429 while this many requests wait to "
                                                    "start (default: no bound).")] = None,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Answer 413 to larger request bodies.")] = 4 << 20,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
    use_ray: Annotated[bool, typer.Option("--ray", help="Serve as a Ray Serve deployment of replicas, each with "
                                          "its own engine (needs decodekit[ray]).")] = False,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: the cluster to join (`auto`, "
                                                    "`ray://host:10001`); default: RAY_ADDRESS, else a local "
                                                    "cluster.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="With --ray: replicas (a fixed number).")] = 1,
    min_replicas: Annotated[int, typer.Option(min=0, help="With --ray and --max-replicas: the fewest replicas.")
                            ] = 1,
    max_replicas: Annotated[int | None, typer.Option(min=1, help="With --ray: autoscale between --min-replicas and "
                                                     "this, by requests in flight.")] = None,
    target_ongoing_requests: Annotated[float, typer.Option(min=0.1, help="With --max-replicas: requests in flight "
                                                           "per replica that autoscaling aims at.")] = 32.0,
    cpus_per_replica: Annotated[int, typer.Option(min=1, help="With --ray: CPUs (and torch threads) per replica.")
                                ] = 1,
) -> None:
    """Serve a recipe over HTTP with OpenAI's API: POST /v1/chat/completions and /v1/completions (streaming,
    logprobs, JSON schemas, beam search and speculative decoding through extra fields), GET /v1/models, /health,
    /metrics. SIGTERM or Ctrl-C lets the requests in flight finish, then exits. With --ray, the same app runs as
    a Ray Serve deployment of --replicas replicas (or autoscaled up to --max-replicas) behind Ray's HTTP proxy."""
    _setup_logging(False)
    from decodekit.core.plugin_manager import get_plugin_manager
    from decodekit.core.registry import Registry
    from decodekit.recipe import check_models, load_recipe
    from decodekit.serve import ServeOptions, create_app, run_server

    options = ServeOptions(host=host, port=port, api_key=api_key or None, served_model_name=served_model_name,
                           max_waiting=max_waiting, max_body_bytes=max_body_bytes)
    ray_flags = (ray_address is not None, replicas != 1, max_replicas is not None, cpus_per_replica != 1)
    if not use_ray and any(ray_flags):
        _fail("--ray-address, --replicas, --max-replicas and --cpus-per-replica need --ray")
    try:
        pm = get_plugin_manager()
        recipe = load_recipe(recipe_path, overrides or [], registry=Registry.from_plugin_manager(pm))
        if use_ray:
            from decodekit.serve.ray_serve import ReplicaOptions, import_serve

            import_serve()  # a missing extra fails here, before anything starts
            if _local_ray(ray_address):  # a model missing here fails now, not in every replica's start-up
                check_models(recipe, Registry.from_plugin_manager(pm))
            scale = ReplicaOptions(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                                   target_ongoing_requests=target_ongoing_requests,
                                   cpus_per_replica=cpus_per_replica, address=ray_address)
            scale.deployment_options()  # contradictory replica options fail here too
        else:
            server = create_app(recipe, options, plugin_manager=pm)
    except DecodeKitError as exc:
        _fail(str(exc))
    address = f"[{host}]" if ":" in host else host
    names = ", ".join(repr(n) for n in dict.fromkeys(n for n in (served_model_name, recipe.model) if n))
    where = f"http://{address}:{port}/v1{' (API key required)' if options.api_key else ''}"
    if not use_ray:
        console.print(f"serving {escape(names)} ({escape(recipe.source)}) at {where}", soft_wrap=True,
                      highlight=False)
        run_server(server, options)
        return
    from decodekit.serve.ray_serve import serve_until_signalled

    count = f"{min_replicas}-{max_replicas} autoscaled" if max_replicas is not None else str(replicas)
    console.print(f"deploying {escape(names)} ({escape(recipe.source)}) on Ray Serve: {count} replicas of "
                  f"{cpus_per_replica} CPU{'s' if cpus_per_replica > 1 else ''}, at {where}", soft_wrap=True,
                  highlight=False)
    try:
        serve_until_signalled(recipe, options, scale, on_ready=lambda: console.print(
            "ready: every replica is up (Ctrl-C or SIGTERM stops the deployment)"))
    except (DecodeKitError, RuntimeError) as exc:  # Ray Serve reports a deployment that failed as RuntimeError
        _fail(f"the Ray Serve deployment failed: {exc}")


@app.command()
def batch(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file: the model, engine limits and "
                                                "every row's defaults.")],
    input_path: Annotated[str, typer.Option("--input", "-i", help="Rows: .jsonl (objects with prompt or "
                                            "messages, optional id and overrides), .parquet or .txt; with --ray "
                                            "also a folder, glob or URI of them (s3://...).")],
    output_path: Annotated[str, typer.Option("--output", "-o", help="One row per input row, joined by id, in "
                                             "input order: .jsonl or .parquet. Rows already there are skipped. "
                                             "With --ray, a folder (or URI) makes Ray Data write it as files.")],
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
    use_ray: Annotated[bool, typer.Option("--ray", help="Run over Ray Data: one engine per replica (needs "
                                          "decodekit[ray]).")] = False,
    ray_address: Annotated[str | None, typer.Option(help="The Ray cluster to join (`auto`, `ray://host:10001`); "
                                                    "default: RAY_ADDRESS, else a local cluster.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="With --ray: engines (Ray actors).")] = 1,
    cpus_per_replica: Annotated[int | None, typer.Option(min=1, help="With --ray: CPUs (and torch threads) per "
                                                         "replica (default: the cluster's CPUs / replicas).")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="With --ray: rows per batch handed to a replica.")] = 32,
    output_format: Annotated[str, typer.Option(help="With --ray and a folder output: jsonl or parquet files.")
                             ] = "jsonl",
    retry_errors: Annotated[bool, typer.Option(help="Run again the rows the output holds with an error.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, less logging.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Offline batch inference: run a recipe over every row of a dataset and write one output row per input row
    (a row that cannot run gets an `error`, never lost). A rerun resumes: rows already in the output are skipped.

    Exit status: 0 when every row ran; 1 when some rows have an error; 2 when nothing could run.
    """
    _setup_logging(quiet or as_json)
    from rich.progress import TimeRemainingColumn

    from decodekit.batch import RayOptions, run_batch
    from decodekit.core.plugin_manager import get_plugin_manager
    from decodekit.core.registry import Registry
    from decodekit.recipe import check_models, load_recipe

    if not use_ray and (ray_address is not None or replicas != 1 or cpus_per_replica is not None):
        _fail("--ray-address, --replicas and --cpus-per-replica need --ray")
    ray = RayOptions(ray_address, replicas, cpus_per_replica, batch_size, output_format) if use_ray else None
    columns = (SpinnerColumn(), TextColumn("rows"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} tokens/s"), TimeElapsedColumn(), TextColumn("eta"),
               TimeRemainingColumn())
    try:
        pm = get_plugin_manager()
        recipe = load_recipe(recipe_path, overrides or [], registry=Registry.from_plugin_manager(pm))
        if use_ray and _local_ray(ray_address):  # a model missing here fails now, not in every replica
            check_models(recipe, Registry.from_plugin_manager(pm))
        with Progress(*columns, console=err_console, transient=True, disable=quiet or as_json) as progress:
            task = progress.add_task("batch", total=None, rate="-")
            clock = {"start": time.perf_counter(), "tokens": 0}

            def on_start(rows: int, todo: int) -> None:
                if not rows:  # a folder job: Ray Data counts the rows as it reads them
                    return
                progress.update(task, total=todo)
                if rows > todo:
                    err_console.print(f"resuming: {rows - todo} of {rows} rows are already in {output_path}")

            def on_row(row: dict[str, Any]) -> None:
                usage = row.get("usage") or {}
                clock["tokens"] += usage.get("completion_tokens", 0)
                rate = clock["tokens"] / max(time.perf_counter() - clock["start"], 1e-9)
                progress.update(task, advance=1, rate=f"{rate:.1f}")

            summary = run_batch(recipe, input_path, output_path, ray=ray, retry_errors=retry_errors,
                                plugin_manager=pm, on_start=on_start, on_row=on_row)
    except DecodeKitError as exc:
        _fail(str(exc))
    figures = {"rows": summary.rows, "skipped (already in the output)": summary.skipped,
               "written": summary.written, "errors": summary.errors, "output tokens": summary.output_tokens,
               "wall time": f"{summary.wall_s:.2f} s", "replicas": summary.replicas,
               "rows/s": f"{summary.rows_per_s:.2f}" if summary.rows_per_s else "-",
               "tokens/s": f"{summary.tokens_per_s:.1f}" if summary.tokens_per_s else "-"}
    if as_json:
        print(json.dumps({"recipe": recipe.source, "output": str(output_path), **{
            "rows": summary.rows, "skipped": summary.skipped, "written": summary.written, "errors": summary.errors,
            "output_tokens": summary.output_tokens, "wall_s": summary.wall_s, "replicas": summary.replicas,
            "error_samples": summary.error_samples}}))
    else:
        table = Table(title=f"batch → {output_path}", show_header=False)
        for key, value in figures.items():
            table.add_row(key, str(value))
        for sample in summary.error_samples:  # the first few; every one is in its row's `error`
            table.add_row("error", escape(sample if len(sample) <= 100 else sample[:99] + "…"))
        console.print(table)
    if summary.errors:
        raise typer.Exit(1)


def _local_ray(address: str | None) -> bool:
    """Whether a Ray job runs on this machine (no cluster address given): then its models can be checked here."""
    import os

    return address is None and not os.environ.get("RAY_ADDRESS")


recipe_app = typer.Typer(help="Work with recipe files.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("check")
def recipe_check(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file.")],
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
) -> None:
    """Validate a recipe without loading its model, and print it resolved (defaults filled in, the plan in order).

    The model (and draft) must resolve without loading: the bundled name, a .gguf file, a folder with a
    config.json, a hub id in the local Hugging Face cache, or a spec a plugin's loader accepts. The checks `run`
    makes of this machine before loading the model run too: the device exists, `engine.cuda_graphs: true` has CUDA,
    `engine.kv_cache_memory` holds two KV blocks of the model (read from its config.json; a note says when that is
    not on disk yet). Where the recipe leaves the dtype to `auto`, the dtype it chooses on this machine is printed
    with the reason."""
    import yaml

    from decodekit.core.plugin_manager import get_plugin_manager
    from decodekit.core.registry import Registry
    from decodekit.recipe import check_machine, check_models, describe_recipe, dtype_choice, load_recipe

    try:
        registry = Registry.from_plugin_manager(get_plugin_manager())
        recipe = load_recipe(recipe_path, overrides or [], registry=registry)
        check_models(recipe, registry)
        notes = check_machine(recipe)  # what `run` checks before loading the model: device, CUDA graphs, KV memory
    except DecodeKitError as exc:
        _fail(str(exc))
    print(yaml.safe_dump(describe_recipe(recipe, registry), sort_keys=False, allow_unicode=True), end="")
    choice = dtype_choice(recipe)
    if choice is not None:  # `dtype: auto` depends on this machine: say what it chose and why
        err_console.print(f"{escape(recipe.source)}: {escape(choice)}", soft_wrap=True)
    for note in notes:
        err_console.print(f"[yellow]note:[/] {escape(recipe.source)}: {escape(note)}", soft_wrap=True)
    err_console.print(f"[green]{recipe.source}: ok[/]")


@app.command()
def plugins(as_json: Annotated[bool, typer.Option("--json", help="Print JSON (with parameter schemas).")] = False,
            ) -> None:
    """List installed plugins, what each registers, and where it came from."""
    from decodekit.core.plugin_manager import get_plugin_manager, plugin_origins
    from decodekit.core.registry import Registry

    try:
        pm = get_plugin_manager()
        registry = Registry.from_plugin_manager(pm)
    except DecodeKitError as exc:
        _fail(str(exc))
    kinds = ("processors", "stopping_criteria", "strategies", "proposers", "constraint_backends")
    rows: dict[str, dict[str, Any]] = {name: {"origin": origin, **{k: [] for k in kinds}}
                                       for name, origin in plugin_origins(pm).items()}
    for kind in kinds:
        for entry in getattr(registry, kind).values():
            model = entry.params_model
            rows.setdefault(entry.plugin, {"origin": "?", **{k: [] for k in kinds}})[kind].append({
                "name": entry.name, "description": entry.description, "default": entry.default,
                "params": model.model_json_schema() if model is not None else None})
    for plugin_name, extras in _loaders_and_commands(pm).items():
        rows.setdefault(plugin_name, {"origin": "?", **{k: [] for k in kinds}}).update(extras)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="decodekit plugins")
    for col in ("plugin", "from", "processors", "stopping criteria", "strategies", "proposers"):
        # every cell is a name to copy into a recipe: in a terminal too narrow, fold it rather than cut it
        table.add_column(col, overflow="fold")
    for name, row in rows.items():  # constraint backends are in --json (a seventh column wraps names at 80 columns)
        # one name a line: the table stays narrow, and a name never breaks at a wrap between two of them
        table.add_row(name, row["origin"], *("\n".join(e["name"] for e in row[k]) for k in kinds[:4]))
    print_table(console, table)


def _loaders_and_commands(pm: Any) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each plugin's model loaders and CLI commands, by calling its own registration hooks alone (the registry keeps
    loaders without their plugin, and commands live on the typer app)."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for impl in pm.hook.decodekit_register_model_loaders.get_hookimpls():
        loaders: list[Any] = []
        impl.function(register=loaders.append)
        out.setdefault(impl.plugin_name, {"model_loaders": [], "commands": []})["model_loaders"] = [
            {"name": getattr(loader, "name", type(loader).__name__),
             "description": (getattr(getattr(loader, "load", None), "__doc__", None) or "").strip().split("\n")[0]}
            for loader in loaders]
    for impl in pm.hook.decodekit_register_commands.get_hookimpls():
        scratch = typer.Typer()
        impl.function(cli=scratch)
        out.setdefault(impl.plugin_name, {"model_loaders": [], "commands": []})["commands"] = [
            {"name": command.name or (command.callback.__name__.replace("_", "-") if command.callback else "?"),
             "description": (command.help or (command.callback.__doc__ if command.callback else "") or "")
             .strip().split("\n")[0]}
            for command in scratch.registered_commands]
    return out


@app.command()
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
    _setup_logging(True)
    matrix_only = {"--dtypes": dtypes, "--batches": batches, "--strategies": strategies, "--output": output}
    misplaced = [flag for flag, value in matrix_only.items() if value is not None and workload != "matrix"]
    if misplaced:
        _fail(f"{', '.join(misplaced)} {'is' if len(misplaced) == 1 else 'are'} for `decodekit bench matrix`")
    if full and workload != "mixed":
        _fail("--full is for `decodekit bench mixed`")
    if peer_url and workload != "serve":
        _fail("--peer-url is for `decodekit bench serve`; the other workloads take --peer")
    if peer_gguf is not None and not any(p.split("=", 1)[0].strip().lower().startswith("llama")
                                         for p in peer or []):
        _fail("--peer-gguf is for a llama.cpp peer (--peer llama.cpp)")
    if workload == "serve":
        if peer:
            _fail("bench serve runs servers: give a running peer server with --peer-url URL")
        picked = [f"{key}={value}" for key, value in (("model", model), ("dtype", dtype)) if value]
        _bench_serve(recipe_path, [*(overrides or []), *picked], baseline or ["transformers-serve"], clients,
                     num_requests, seed, threads, as_json, peer_url or [])
        return
    peer_specs = _peer_specs(peer or [], peer_gguf)
    from decodekit.bench import RichBenchProgress, render_table, result_json, run_benchmark

    engine_options: dict[str, Any] = {}
    try:
        if recipe_path is not None:
            from decodekit.recipe import load_recipe

            recipe = load_recipe(recipe_path, overrides or [])
            engine_options = recipe.engine_options()
            model, dtype = model or recipe.model, dtype or recipe.dtype
    except (DecodeKitError, ValueError) as exc:
        _fail(str(exc))
    if workload == "matrix":
        _bench_matrix(model, dtype, dtypes, batches, strategies, output_len, repeats, seed, threads, engine_options,
                      recipe_path, overrides or [], output, as_json, peer_specs)
        return
    if workload == "mixed":  # a quick default size; --full: the long run (run_benchmark's own defaults)
        num_requests = num_requests if num_requests is not None else MIXED_FULL_REQUESTS if full else MIXED_REQUESTS
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
        with RichBenchProgress(err_console, disable=as_json) as progress:
            result = run_benchmark(workload, model=model or BUNDLED_MODEL_NAME, dtype=dtype or "auto",
                                   progress=progress, **kwargs)
    except (DecodeKitError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        print(result_json(result))
    else:
        render_table(result, console)


def _peer_specs(peers: list[str], gguf: Path | None) -> list[Any]:
    """The `--peer` values as `PeerSpec`s (an unknown name fails here, before anything loads)."""
    if not peers:
        return []
    from decodekit.bench.peers import parse_peer

    try:
        return [parse_peer(text, gguf=str(gguf) if gguf is not None else None) for text in peers]
    except DecodeKitError as exc:
        _fail(str(exc))


def _split(value: str | None, flag: str, kind: type[Any] = str) -> list[Any] | None:
    """A comma-separated option as a list (None when not given); a bad item fails with the option's name."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",") if item.strip()]
    try:
        return [kind(item) for item in items] or _fail(f"{flag} names nothing")
    except ValueError:
        _fail(f"{flag} takes comma-separated {'integers' if kind is int else 'names'}, got {value!r}")


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
                        f"--strategies {','.join(strategy_list)}", f"--repeats {rounds}", f"--output-len {output_len}",
                        *([f"--threads {threads}"] if threads is not None else []),
                        *(f"--peer {p.kind}{'=' + p.python if p.python else ''}" for p in peers or []),
                        *sorted({f"--peer-gguf {p.gguf}" for p in peers or [] if p.gguf})])
    try:
        with RichBenchProgress(err_console, disable=as_json) as progress:
            result = run_matrix(model or BUNDLED_MODEL_NAME, dtypes=dtype_list, batches=batch_list,
                                strategies=strategy_list, output_len=output_len, repeats=rounds, seed=seed,
                                engine_options=engine_options, num_threads=threads, progress=progress,
                                peers=peers or [])
    except (DecodeKitError, ValueError) as exc:
        _fail(str(exc))
    if output is not None:
        try:
            output.write_text(matrix_markdown(result, command), encoding="utf-8")
        except OSError as exc:
            _fail(f"cannot write {output}: {exc}")
    if as_json:
        print(matrix_json(result))
    else:
        render_matrix_table(result, console)
        if output is not None:
            err_console.print(f"[dim]markdown written to {escape(str(output))}[/dim]")


def _bench_serve(recipe_path: Path | None, overrides: list[str], baseline: list[str], clients: int,
                 num_requests: int | None, seed: int, threads: int | None, as_json: bool,
                 peer_urls: list[str] | None = None) -> None:
    """`bench serve`: both servers as subprocesses, one after the other, the same streamed workload (then any
    OpenAI-compatible server already running at a `--peer-url`)."""
    from decodekit.bench.serving.report import render_serve_table, serve_result_json
    from decodekit.bench.serving.run import DEFAULT_RECIPE, run_serve_benchmark

    unknown = sorted(set(baseline) - {"transformers-serve", "none"})
    if unknown:
        _fail(f"unknown baseline(s) {unknown} for serve; choose transformers-serve or none")
    sizes: dict[str, Any] = {} if num_requests is None else {"num_requests": num_requests}
    try:
        result = run_serve_benchmark(recipe_path or DEFAULT_RECIPE, overrides, clients=clients, seed=seed,
                                     threads=threads, baseline="none" not in baseline, peer_urls=peer_urls or [],
                                     progress=lambda line: err_console.print(f"[dim]{escape(line)}[/dim]"), **sizes)
    except (DecodeKitError, ValueError, RuntimeError) as exc:
        _fail(str(exc))
    if as_json:
        print(serve_result_json(result))
    else:
        render_serve_table(result, console)


def _third_party_plugins_installed() -> bool:
    """Whether an entry-point plugin would load (one of the `decodekit` group that `DECODEKIT_PLUGINS` allows, as
    `decodekit.core.plugin_manager` reads them). Only those can add commands: decodekit's own plugins add none
    (tests/test_first_minutes.py holds them to that), so without one `decodekit --help` imports no plugin (nor
    torch) to list the commands."""
    import importlib.metadata
    import os

    allowed_env = os.environ.get("DECODEKIT_PLUGINS")
    allowed = None if allowed_env is None else {n.strip() for n in allowed_env.split(",") if n.strip()}
    return any(allowed is None or ep.name in allowed for ep in importlib.metadata.entry_points(group="decodekit"))


def main() -> None:
    """Entry point: add plugin commands, run, and turn a DecodeKitError into one line and a non-zero exit."""
    try:
        if _third_party_plugins_installed():
            from decodekit.core.plugin_manager import get_plugin_manager

            get_plugin_manager().hook.decodekit_register_commands(cli=app)
        app()
    except DecodeKitError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)



