"""`decodekit plugins`: every loaded plugin, where it came from, and what it registers (components with their
parameter schemas, model loaders, commands), as a table or JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from typer.models import CommandInfo

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context
from decodekit.tables import print_table

if TYPE_CHECKING:
    from collections.abc import Callable

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
    kinds = ("processors", "stopping_criteria", "strategies", "proposers", "constraint_backends", "tool_formats",
             "metrics", "reasoning_formats")
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
    # constraint backends, tool formats and metrics are in --json (more columns wrap at 80)
    for name, row in rows.items():
        # one name a line: the table stays narrow, and a name never breaks at a wrap between two of them
        table.add_row(name, row["origin"], *("\n".join(e["name"] for e in row[k]) for k in kinds[:4]))
    print_table(terminal.console, table)


def _loaders_and_commands(pm: pluggy.PluginManager) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each plugin's model loaders and CLI commands (the registry keeps loaders without their plugin, and commands
    live on the typer app). Each hook is called once through pluggy, as the registry and `decodekit.cli.main` call
    it, so its order, `tryfirst`/`trylast` and wrappers hold here too; what is registered is credited to the plugin
    whose hook implementation is registering it (`plugin_finder`: the implementation on the call stack)."""
    from decodekit.core.registry import plugin_finder

    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for caller in (pm.hook.decodekit_register_model_loaders, pm.hook.decodekit_register_commands):
        for impl in caller.get_hookimpls():  # a plugin that implements either hook is listed, even with nothing
            out.setdefault(impl.plugin_name, {"model_loaders": [], "commands": []})

    def extras(plugin_name: str) -> dict[str, list[dict[str, Any]]]:
        return out.setdefault(plugin_name, {"model_loaders": [], "commands": []})

    loaders_caller = pm.hook.decodekit_register_model_loaders
    loader_plugin = plugin_finder(loaders_caller)

    def register(loader: Any) -> None:
        extras(loader_plugin())["model_loaders"].append({
            "name": getattr(loader, "name", type(loader).__name__),
            "description": (getattr(getattr(loader, "load", None), "__doc__", None) or "").strip().split("\n")[0]})

    loaders_caller(register=register)
    commands_caller = pm.hook.decodekit_register_commands
    scratch = typer.Typer()
    scratch.registered_commands = credited = _CreditedCommands(plugin_finder(commands_caller))
    commands_caller(cli=scratch)
    for plugin_name, command in zip(credited.plugins, credited, strict=True):
        extras(plugin_name)["commands"].append({
            "name": command.name or (command.callback.__name__.replace("_", "-") if command.callback else "?"),
            "description": (command.help or (command.callback.__doc__ if command.callback else "") or "")
            .strip().split("\n")[0]})
    return out


class _CreditedCommands(list[CommandInfo]):
    """A typer app's `registered_commands` that also notes which plugin added each command: typer's `command`
    decorator appends its `CommandInfo` here from inside the plugin's hook implementation, where `find_plugin` can
    see it on the call stack."""

    def __init__(self, find_plugin: Callable[[], str]) -> None:
        super().__init__()
        self.find_plugin = find_plugin
        self.plugins: list[str] = []

    def append(self, command: CommandInfo) -> None:
        """Add a command, crediting the plugin that is registering it."""
        super().append(command)
        self.plugins.append(self.find_plugin())
