"""`decodekit run RECIPE`: run a recipe over its prompts, print the answers and the summary table, and write the
output (and trace) files, one JSON line per request."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context
from decodekit.cli.summary import render_summary


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
    terminal.setup_logging(quiet or as_json)
    from decodekit.api.startup_heap import freeze_startup_heap
    from decodekit.core.plan import Components
    from decodekit.recipe import check_machine
    from decodekit.recipe_runner import DEFAULT_TRACE, output_row, read_inputs, run_recipe, summarize, trace_row

    try:
        context = load_context()
        recipe = context.load_recipe(recipe_path, overrides)
        if trace is not None and recipe.sampling.trace is None:
            recipe = context.load_recipe(recipe_path, [*(overrides or []), f"sampling.trace={DEFAULT_TRACE}"])
        target = output or (Path(recipe.outputs.file) if recipe.outputs.file else None)
        # a file that cannot be written fails now, not after the whole run with its results lost
        for flag, path in (("--output" if output else "outputs.file", target), ("--trace", trace)):
            if path is not None:
                _check_writable(path, flag)
        requests, bad = read_inputs(recipe, Components(context.registry), prompt or [], prompts)
        if not requests:
            terminal.fail(f"{recipe.source}: no prompts to run: give --prompt, --prompts, or inputs.prompts / "
                          "inputs.file" + "".join(f"\n  {b}" for b in bad))
        check_machine(recipe)  # the device, CUDA graphs and KV memory, before the model loads
        for b in bad:
            terminal.err_console.print(f"[yellow]skipped[/] {escape(str(b))}", soft_wrap=True)
        llm = recipe.build_llm(context.plugin_manager)
        freeze_startup_heap()  # one engine for the process's life: collections skip what it has built
        with _progress(len(requests) * (3 if recipe.outputs.compare_plain else 1), quiet or as_json) as on_output:
            result = run_recipe(recipe, llm, requests, on_output)
    except DecodeKitError as exc:
        terminal.fail(str(exc))
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
        terminal.fail(f"{flag} {target}: is a folder; give a file path, e.g. {target / 'out.jsonl'}")
    existed = target.exists()
    try:
        with target.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        terminal.fail(f"{flag} {target}: cannot be written ({reason}); nothing was run")
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
        terminal.err_console.print(f"[bold red]error:[/] cannot write {escape(str(target))}: {escape(str(exc))}"
                                   f"{where}", soft_wrap=True)
        if echo is not None:
            echo.write(lines)
            echo.flush()
        return False


@contextmanager
def _progress(total: int, hidden: bool) -> Iterator[Callable[[Any], None]]:
    """A progress bar on stderr (requests done, tokens/s); yields the engine's `on_output` callback."""
    columns = (SpinnerColumn(), TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} tokens/s"), TimeElapsedColumn())
    with Progress(*columns, console=terminal.err_console, transient=True, disable=hidden) as progress:
        task = progress.add_task("run", total=total, rate="-")
        start, tokens = time.perf_counter(), 0

        def on_output(out: Any) -> None:
            nonlocal tokens
            tokens += sum(len(ids) for ids in out.delta_token_ids)
            rate = f"{tokens / max(time.perf_counter() - start, 1e-9):.1f}"
            progress.update(task, advance=1 if out.finished else 0, rate=rate)

        yield on_output


def _print_answer(prompt: str, out: Any) -> None:
    """One request's answer under its prompt: its text, its error, or each of its returned sequences."""
    terminal.console.print(f"[bold cyan]>>> {escape(prompt)}[/]", soft_wrap=True, highlight=False)
    if out.error is not None:
        terminal.console.print(f"[red]error: {escape(out.error)}[/]", soft_wrap=True)
    elif len(out.outputs) == 1:
        terminal.console.print(escape(out.text), soft_wrap=True, highlight=False)
    else:
        for choice in out.outputs:
            score = "" if choice.score is None else f" (score {choice.score:.3f})"
            terminal.console.print(f"[dim]\\[{choice.index}]{score}[/] {escape(choice.text)}", soft_wrap=True,
                                   highlight=False)
