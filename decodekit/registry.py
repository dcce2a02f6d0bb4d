"""Name -> component factory, filled once from the register hooks of every loaded plugin."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from decodekit.constraints import register_backend
from decodekit.errors import PluginError
from decodekit.models import ModelLoader

_SINGULAR = {"processors": "processor", "stopping_criteria": "stopping criterion", "strategies": "strategy",
             "proposers": "proposer"}


@dataclass(frozen=True)
class Entry:
    """A registered component: how to build it, whether engines use it by default, and which plugin gave it."""

    name: str
    factory: Callable[..., Any]
    default: bool
    plugin: str

    @property
    def params_model(self) -> Any:
        """The pydantic model of the component's parameters (its factory's `Params`), or None."""
        return getattr(self.factory, "Params", None)

    @property
    def description(self) -> str:
        """The first line of the component's docstring."""
        doc = (getattr(self.factory, "__doc__", None) or "").strip()
        return doc.splitlines()[0] if doc else ""


@dataclass
class Registry:
    """Every processor, stopping criterion, strategy and model loader the loaded plugins provide."""

    processors: dict[str, Entry] = field(default_factory=dict)
    stopping_criteria: dict[str, Entry] = field(default_factory=dict)
    strategies: dict[str, Entry] = field(default_factory=dict)
    proposers: dict[str, Entry] = field(default_factory=dict)
    model_loaders: list[ModelLoader] = field(default_factory=list)

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> Registry:
        """Collect components by calling each registration hook once per plugin."""
        registry = cls()
        # Registration order (defaults first, then entry points, then in-process) fixes the processor order.
        for plugin_name, plugin in pm.list_name_plugin():
            if plugin is None:  # blocked plugin
                continue
            for hook, table in (
                ("decodekit_register_processors", registry.processors),
                ("decodekit_register_stopping_criteria", registry.stopping_criteria),
                ("decodekit_register_strategies", registry.strategies),
                ("decodekit_register_proposers", registry.proposers),
            ):
                impl = getattr(plugin, hook, None)
                if impl is None:
                    continue
                impl(register=_registrar(table, plugin_name, hook))
            backends_impl = getattr(plugin, "decodekit_register_constraint_backends", None)
            if backends_impl is not None:
                backends_impl(register=register_backend)
            loaders_impl = getattr(plugin, "decodekit_register_model_loaders", None)
            if loaders_impl is not None:
                loaders_impl(register=registry.model_loaders.append)
        return registry

    def get(self, kind: str, name: str) -> Entry:
        """Look up a component by kind ("processors", "stopping_criteria", "strategies", "proposers") and name."""
        table: dict[str, Entry] = getattr(self, kind)
        if name not in table:
            known = sorted(table)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            noun = _SINGULAR.get(kind, kind)
            raise PluginError(f"unknown {noun} {name!r}{hint}; known: {', '.join(known)}")
        return table[name]

    def defaults(self, kind: str) -> list[Any]:
        """Build the default components of a kind, in registration order."""
        return [entry.factory() for entry in getattr(self, kind).values() if entry.default]


def _registrar(table: dict[str, Entry], plugin_name: str, hook: str) -> Callable[..., None]:
    def register(name: str, factory: Callable[..., Any], default: bool = False) -> None:
        if name in table:
            raise PluginError(
                f"{hook}: {name!r} from plugin {plugin_name!r} is already registered by {table[name].plugin!r}"
            )
        table[name] = Entry(name, factory, default, plugin_name)

    return register
