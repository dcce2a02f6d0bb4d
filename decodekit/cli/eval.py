"""`decodekit eval RECIPE --tasks T`: lm-evaluation-harness tasks with decodekit as the model (the recipe's engine
scores and generates), a table of their figures and a JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context
from decodekit.cli.run import _check_writable
from decodekit.tables import print_table


def eval_command(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file (see docs/recipes.md).")],
    tasks: Annotated[str, typer.Option(help="lm-eval tasks (or groups), comma-separated.")],
    include_path: Annotated[Path | None, typer.Option(help="A folder of local task YAML files (JSONL data works "
                                                      "offline).")] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many documents per task.")] = None,
    output: Annotated[Path | None, typer.Option(help="Write the figures (and every sample) here as JSON.")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
    apply_chat_template: Annotated[bool, typer.Option(help="Wrap each task prompt in the model's chat "
                                                      "template.")] = False,
    seed: Annotated[int, typer.Option(help="lm-eval's seeds (few-shot sampling, python, numpy, torch).")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Less logging.")] = False,
) -> None:
    """Evaluate a recipe on lm-evaluation-harness tasks: loglikelihood tasks through the model's prompt logprobs
    (as lm-eval's `hf` backend scores them), generation tasks through the recipe (its sampling, processors, strategy
    and constraints; the task's stop strings and `max_gen_toks`).

    Exit status: 0 on success; 2 when nothing could run (a bad recipe, an unknown task, lm-eval not installed, a
    request that failed).
    """
    terminal.setup_logging(quiet)
    from decodekit.eval.harness import evaluate, task_manager
    from decodekit.recipe import check_machine

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        context = load_context()
        recipe = context.load_recipe(recipe_path, overrides)
        manager = task_manager(task_list, include_path)
        if limit is not None and limit < 1:
            terminal.fail(f"--limit must be at least 1, got {limit}")
        if output is not None:
            _check_writable(output, "--output")
        check_machine(recipe)
        from decodekit.api.startup_heap import freeze_startup_heap
        from decodekit.eval.model import DecodekitLM

        lm = DecodekitLM(recipe=recipe, llm=recipe.build_llm(context.plugin_manager))
        freeze_startup_heap()  # one engine for the process's life: collections skip what it has built
        scores = evaluate(lm, task_list, manager, limit=limit, seed=seed, log_samples=output is not None,
                          apply_chat_template=apply_chat_template)
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    table = Table(title=f"decodekit eval · {recipe.source}")
    for column in ("task", "metric", "value"):
        table.add_column(column, justify="right" if column == "value" else "left", overflow="fold")
    for task, figures in scores.metrics.items():
        for name, value in figures.items():
            table.add_row(escape(task), escape(name), f"{value:.4f}")
    print_table(terminal.console, table)
    if output is not None:
        document = {"recipe": recipe.source, "model": recipe.model, "tasks": task_list, "limit": limit, "seed": seed,
                    "results": scores.metrics, "samples": scores.samples}
        output.write_text(json.dumps(document, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
        terminal.err_console.print(f"wrote {escape(str(output))}")
