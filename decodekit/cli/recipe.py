"""`decodekit recipe ...`: the commands that work with recipe files without running them (today `check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context

app = typer.Typer(help="Work with recipe files.", no_args_is_help=True)
"""The `recipe` group; `decodekit.cli` adds it to the main app."""


@app.command("check")
def check(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file.")],
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
) -> None:
    """Validate a recipe without loading its model, and print it resolved (defaults filled in, the plan in order).

    The model (and draft) must resolve without loading: the bundled name, a .gguf file, a folder with a
    config.json, a hub id in the local Hugging Face cache, or a spec a plugin's loader accepts. The checks `run`
    makes of this machine before loading the model run too: the device exists, `engine.cuda_graphs: true` has CUDA,
    and, from the model's config.json (a note says when that is not on disk yet), the engine's own plan of how the
    model runs here (printed; an option it refuses is refused now) and `engine.kv_cache_memory` holding two KV blocks
    of it. Where the recipe leaves the dtype to `auto`, the dtype it chooses on this machine is printed with the
    reason."""
    import yaml

    from decodekit.recipe import check_machine, check_models, describe_recipe, dtype_choice

    try:
        context = load_context()
        recipe = context.load_recipe(recipe_path, overrides)
        check_models(recipe, context.registry)
        machine = check_machine(recipe)  # what `run` checks before loading the model: device, plan, KV memory
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    print(yaml.safe_dump(describe_recipe(recipe, context.registry), sort_keys=False, allow_unicode=True), end="")
    choice = dtype_choice(recipe)
    if choice is not None:  # `dtype: auto` depends on this machine: say what it chose and why
        terminal.err_console.print(f"{escape(recipe.source)}: {escape(choice)}", soft_wrap=True)
    if machine.plan is not None:  # the engine's own plan: what `run` will do with this model here
        runs = f"runs: {machine.plan.describe()}"
        if machine.plan.reasons:  # why a choice was not the obvious one (a fused decoder off, ...)
            runs += f" ({'; '.join(machine.plan.reasons)})"
        if machine.plan.draft is not None:
            runs += f"; the draft: {machine.plan.draft.describe()}"
        terminal.err_console.print(f"{escape(recipe.source)}: {escape(runs)}", soft_wrap=True)
    for note in machine.notes:
        terminal.err_console.print(f"[yellow]note:[/] {escape(recipe.source)}: {escape(note)}", soft_wrap=True)
    terminal.err_console.print(f"[green]{recipe.source}: ok[/]")
