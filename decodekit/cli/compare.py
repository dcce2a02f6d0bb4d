"""`decodekit compare RECIPE...`: recipes and their sweeps side by side on the same seeded inputs: a progress bar, a
table of speed and quality, a JSON file with every figure, and a self-contained HTML report."""

from __future__ import annotations

import sys
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
from decodekit.cli.run import _check_writable
from decodekit.tables import print_table


def compare(
    recipe_paths: Annotated[list[Path], typer.Argument(metavar="RECIPE...", help="Recipe files to compare.")],
    sweep: Annotated[list[str] | None, typer.Option(help="Sweep a recipe key over values: key=v1,v2,... for every "
                                                    "recipe, RECIPE:key=v1,v2 for one (its file's stem or position); "
                                                    "repeatable (a grid).")] = None,
    prompts: Annotated[Path | None, typer.Option(help="Open prompts: a .jsonl or .txt file (as `run --prompts`).")
                       ] = None,
    tasks: Annotated[str | None, typer.Option(help="lm-eval tasks, comma-separated (needs the eval extra).")] = None,
    include_path: Annotated[Path | None, typer.Option(help="A folder of local lm-eval task YAML files.")] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many documents per task.")] = None,
    samples: Annotated[int, typer.Option(help="Seeded samples per prompt (distinct-n and self-BLEU compare "
                                         "them).")] = 4,
    seed: Annotated[int, typer.Option(help="The run's seed: every point draws the same seeds.")] = 0,
    metric: Annotated[list[str] | None, typer.Option(help="A quality metric to measure (repeatable; default: every "
                                                     "registered one a point can be measured by).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a key of every recipe: "
                                                        "key.path=value (repeatable).")] = None,
    output: Annotated[Path | None, typer.Option(help="Write every figure here as JSON.")] = None,
    html: Annotated[Path | None, typer.Option(help="Write the self-contained HTML report here.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, less logging.")] = False,
) -> None:
    """Compare recipes (and points of their sweeps) on speed and quality, over the same seeded inputs.

    Exit status: 0 when every point ran; 1 when some point failed (it is in the table and the files; the others
    ran); 2 when nothing could run (a bad recipe, sweep, metric, task or input, an output that cannot be written).
    """
    terminal.setup_logging(True)
    from decodekit.bench.machine import environment, machine_line
    from decodekit.compare.plan import plan_compare
    from decodekit.compare.points import parse_sweep
    from decodekit.compare.report import report_document, write_json
    from decodekit.compare.run import Engines, request_count, run_point
    from decodekit.recipe import check_machine

    try:
        context = load_context()
        plan = plan_compare(recipe_paths, context.registry, sweeps=[parse_sweep(s) for s in sweep or []],
                            overrides=overrides or [], metric_names=metric, prompts_file=prompts,
                            tasks=[t.strip() for t in (tasks or "").split(",") if t.strip()],
                            include_path=include_path, samples=samples, seed=seed, limit=limit)
        for flag, path in (("--output", output), ("--html", html)):
            if path is not None:
                _check_writable(path, flag)
        if html is not None:
            from decodekit.compare.plots import pyplot

            pyplot()  # matplotlib is there, or the run stops now rather than after every point ran
        for point in plan.points:
            check_machine(point.recipe)
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    for bad in plan.bad_inputs:
        terminal.err_console.print(f"[yellow]skipped[/] {escape(str(bad))}", soft_wrap=True)
    env = environment()
    engines = Engines(context.plugin_manager)
    results = []
    start = time.perf_counter()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=terminal.err_console, transient=True, disable=quiet) as progress:
        points_bar = progress.add_task("points", total=len(plan.points))
        requests_bar = progress.add_task("requests", total=request_count(plan) or None)

        def on_output(out: Any) -> None:
            if out.finished:
                progress.advance(requests_bar)

        for point in plan.points:
            progress.update(points_bar, description=f"points · {point.label}")
            results.append(run_point(plan, point, engines, on_output))
            progress.advance(points_bar)
    wall = time.perf_counter() - start
    document = report_document(plan, results, environment=env, machine=machine_line(env), wall_s=wall,
                               command=_command(recipe_paths))
    _print_table(document)
    if output is not None:
        write_json(document, output)
        terminal.err_console.print(f"wrote {escape(str(output))}")
    if html is not None:
        from decodekit.compare.html import write_html

        write_html(document, html)
        terminal.err_console.print(f"wrote {escape(str(html))}")
    if any(not r.ok for r in results):
        raise typer.Exit(1)


def _command(recipe_paths: list[Path]) -> list[str]:
    """The command line as typed, for the report (the recipes alone when it was not run from a shell)."""
    if sys.argv[1:2] == ["compare"]:
        return ["decodekit", *sys.argv[1:]]
    return ["decodekit", "compare", *(str(p) for p in recipe_paths)]


def _print_table(document: dict[str, Any]) -> None:
    """The comparison table, then the Pareto frontiers and the machine."""
    from decodekit.compare.report import comparison_table

    table = comparison_table(document)
    rich_table = Table(title=f"decodekit compare · {document['prompts']} prompts x {document['samples']} samples"
                             f"{' · tasks ' + ', '.join(document['tasks']) if document['tasks'] else ''}")
    for i, header in enumerate(table.headers):
        rich_table.add_column(header, justify="left" if i == 0 else "right", overflow="fold")
    for label, cells, best, frontier in table.rows:
        name = escape(label) + (" [blue]◆[/]" if frontier else "")
        if isinstance(cells, str):  # the whole message is printed under the table: one line here
            short = cells if len(cells) <= 40 else cells[:39] + "…"
            rich_table.add_row(name, f"[red]{escape(short)}[/]", *[""] * (len(table.headers) - 2))
        else:
            rich_table.add_row(name, *(f"[bold green]{escape(c)}[/]" if i in best else escape(c)
                                       for i, c in enumerate(cells)))
    print_table(terminal.console, rich_table)
    for label, cells, _, _ in table.rows:
        if isinstance(cells, str):
            terminal.console.print(f"[red]{escape(label)}[/]: {escape(cells)}", soft_wrap=True, highlight=False)
    for name, view in document["pareto"].items():
        terminal.console.print(f"[dim]frontier tokens/s vs {escape(name)}:[/] {escape(', '.join(view['all']))}",
                               soft_wrap=True, highlight=False)
    terminal.console.print(f"[dim]bold: best of its column · ◆: on a Pareto frontier · {escape(document['machine'])}"
                           "[/]", soft_wrap=True, highlight=False)
