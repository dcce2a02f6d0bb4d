"""`decodekit plugins`: every loaded plugin, where it came from, and what it registers (components with their
parameter schemas, model loaders, commands), as a table or JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context
from decodekit.tables import print_table

if TYPE_CHECKING:
    import pluggy


def plugins(as_json: Annotated[bool, typer.Option("--json", help="Print JSON (with parameter schemas).")] = False,
            ) -> None:
    """List installed plugins, what each registers, and where it came from."""
    from decodekit.core.plugin_manager import plugin_origins

    try:
        context = load_context()
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    pm, registry = context.plugin_manager, context.registry
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
    print_table(terminal.console, table)


def _loaders_and_commands(pm: pluggy.PluginManager) -> dict[str, dict[str, list[dict[str, Any]]]]:
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
