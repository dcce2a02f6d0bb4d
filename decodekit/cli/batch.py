"""`decodekit batch RECIPE --input ROWS --output OUT`: offline batch inference over a dataset (`decodekit.batch`),
here or over Ray Data (`--ray`), resumable, with a progress bar and a summary table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context


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
    terminal.setup_logging(quiet or as_json)
    from rich.progress import TimeRemainingColumn

    from decodekit.batch import RayOptions, run_batch

    if not use_ray and (ray_address is not None or replicas != 1 or cpus_per_replica is not None):
        terminal.fail("--ray-address, --replicas and --cpus-per-replica need --ray")
    ray = RayOptions(ray_address, replicas, cpus_per_replica, batch_size, output_format) if use_ray else None
    columns = (SpinnerColumn(), TextColumn("rows"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} tokens/s"), TimeElapsedColumn(), TextColumn("eta"),
               TimeRemainingColumn())
    try:
        context = load_context()
        recipe = context.load_recipe(recipe_path, overrides)
        if use_ray:
            context.check_models_for_ray(recipe, ray_address)
        with Progress(*columns, console=terminal.err_console, transient=True, disable=quiet or as_json) as progress:
            task = progress.add_task("batch", total=None, rate="-")
            clock = {"start": time.perf_counter(), "tokens": 0}

            def on_start(rows: int, todo: int) -> None:
                if not rows:  # a folder job: Ray Data counts the rows as it reads them
                    return
                progress.update(task, total=todo)
                if rows > todo:
                    terminal.err_console.print(f"resuming: {rows - todo} of {rows} rows are already in "
                                               f"{output_path}")

            def on_row(row: dict[str, Any]) -> None:
                usage = row.get("usage") or {}
                clock["tokens"] += usage.get("completion_tokens", 0)
                rate = clock["tokens"] / max(time.perf_counter() - clock["start"], 1e-9)
                progress.update(task, advance=1, rate=f"{rate:.1f}")

            summary = run_batch(recipe, input_path, output_path, ray=ray, retry_errors=retry_errors,
                                plugin_manager=context.plugin_manager, on_start=on_start, on_row=on_row)
    except DecodeKitError as exc:
        terminal.fail(str(exc))
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
        terminal.console.print(table)
    if summary.errors:
        raise typer.Exit(1)
