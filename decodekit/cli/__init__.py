"""The `decodekit` command line (typer + rich). Thin: parse, call the Python API, render.

The app is assembled here from one module per command:

    generate.py     decodekit generate -p PROMPT ...      prompts and sampling flags, no recipe
    run.py          decodekit run RECIPE                  a recipe over its prompts, output and trace files
    trace.py        decodekit trace FILE                  a decoding trace in the terminal or as HTML
    serve.py        decodekit serve RECIPE                OpenAI's HTTP API (and `--ray`)
    batch.py        decodekit batch RECIPE -i ROWS -o OUT offline batch inference (and `--ray`)
    recipe.py       decodekit recipe check RECIPE         a recipe validated and printed resolved
    plugins.py      decodekit plugins                     what the loaded plugins register
    bench.py        decodekit bench [WORKLOAD]            benchmarks; its modes are in bench_modes.py
    eval.py         decodekit eval RECIPE --tasks T       lm-evaluation-harness tasks with the recipe as the model
    compare.py      decodekit compare RECIPE...           recipes and sweeps side by side: speed and quality

and what they share: `terminal` (the consoles, `fail`, logging), `context` (plugin manager -> registry -> recipe,
the set-up of every recipe command) and `summary` (the table `run` and `generate` print).

Importing this package imports no torch (`decodekit --help` stays fast): each command imports the engine, the
models and the plugins inside its function.
"""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from decodekit.api.errors import DecodeKitError
from decodekit.cli import batch, bench, compare, generate, plugins, recipe, run, serve, terminal, trace
from decodekit.cli import eval as eval_cmd

app = typer.Typer(help="decodekit: composable decoding strategies on a paged, continuously batched engine.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
"""The `decodekit` application: decodekit's commands (plugin commands join it in `main`)."""

# the order of `decodekit --help` (typer lists the `recipe` group after the commands)
app.command()(generate.generate)
app.command()(run.run)
app.command()(trace.trace)
app.command()(serve.serve)
app.command()(batch.batch)
app.add_typer(recipe.app, name="recipe")
app.command()(plugins.plugins)
app.command()(bench.bench)
app.command(name="eval")(eval_cmd.eval_command)
app.command()(compare.compare)


def _third_party_plugins_installed() -> bool:
    """Whether an entry-point plugin would load (one of the `decodekit` group that `DECODEKIT_PLUGINS` allows, as
    `decodekit.core.plugin_manager` reads them). Only those can add commands: decodekit's own plugins add none
    (tests/recipes/test_readme_and_first_commands.py holds them to that), so without one `decodekit --help` imports
    no plugin (nor torch) to list the commands."""
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
        terminal.err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)
