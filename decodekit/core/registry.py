"""Name -> component factory, filled once by calling the register hooks of every loaded plugin through pluggy.

Each register hook is one pluggy hook call, so pluggy's order holds: plugins registered later are called first
(third-party entry points before decodekit's default plugins), `tryfirst`/`trylast` move a plugin, and
hook wrappers run around the others. Within a plugin, registration order is kept; it fixes the order in which
default processors (the ones `SamplingParams` fields switch on) run.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import pluggy

from decodekit.api.constraints import BackendLoader
from decodekit.api.errors import PluginError
from decodekit.api.models import ModelLoader

_SINGULAR = {"processors": "processor", "stopping_criteria": "stopping criterion", "strategies": "strategy",
             "proposers": "proposer", "constraint_backends": "constraint backend", "tool_formats": "tool format",
             "metrics": "metric",
             "reasoning_formats": "reasoning format"}


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
    """Every processor, stopping criterion, strategy, proposer, constraint backend, tool-call format, reasoning
    format, quality metric and model loader the loaded plugins provide."""

    processors: dict[str, Entry] = field(default_factory=dict)
    stopping_criteria: dict[str, Entry] = field(default_factory=dict)
    strategies: dict[str, Entry] = field(default_factory=dict)
    proposers: dict[str, Entry] = field(default_factory=dict)
    constraint_backends: dict[str, Entry] = field(default_factory=dict)
    tool_formats: dict[str, Entry] = field(default_factory=dict)
    metrics: dict[str, Entry] = field(default_factory=dict)
    reasoning_formats: dict[str, Entry] = field(default_factory=dict)
    model_loaders: list[ModelLoader] = field(default_factory=list)

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> Registry:
        """Collect components by calling each registration hook once, through pluggy."""
        registry = cls()
        order = {name: i for i, (name, _) in enumerate(pm.list_name_plugin())}
        for hook, table in (
            ("decodekit_register_processors", registry.processors),
            ("decodekit_register_stopping_criteria", registry.stopping_criteria),
            ("decodekit_register_strategies", registry.strategies),
            ("decodekit_register_proposers", registry.proposers),
            ("decodekit_register_constraint_backends", registry.constraint_backends),
            ("decodekit_register_tool_formats", registry.tool_formats),
            ("decodekit_register_metrics", registry.metrics),
            ("decodekit_register_reasoning_formats", registry.reasoning_formats),
        ):
            caller = getattr(pm.hook, hook)
            caller(register=_registrar(table, hook, plugin_finder(caller), order))
        pm.hook.decodekit_register_model_loaders(register=registry.model_loaders.append)
        return registry

    def get(self, kind: str, name: str) -> Entry:
        """Look up a component by kind ("processors", "stopping_criteria", "strategies", "proposers",
        "constraint_backends", "tool_formats", "metrics", "reasoning_formats") and name."""
        table: dict[str, Entry] = getattr(self, kind)
        if name not in table:
            known = sorted(table)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            noun = _SINGULAR.get(kind, kind)
            raise PluginError(f"unknown {noun} {name!r}{hint}; known: {', '.join(known)}")
        return table[name]

    def backend_loaders(self) -> Mapping[str, BackendLoader]:
        """The registered constraint backends: name -> loader of the backend class."""
        return {name: entry.factory for name, entry in self.constraint_backends.items()}


def hook_owners(caller: Any) -> dict[CodeType, str]:
    """Which plugin each implementation of a pluggy hook belongs to, by its function's code object (to tell from
    a stack or a traceback which plugin's code is running)."""
    return {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()}


def plugin_finder(caller: Any) -> Callable[[], str]:
    """Which plugin is registering right now: the hook implementation on the call stack. pluggy calls every
    implementation itself, so the register callback learns its caller from the stack (this is only for messages
    and `decodekit plugins`: who registered what). Call the returned function from the callback the hook
    implementation calls (it looks from its caller's caller up); it answers "unknown" outside any of them."""
    owners = hook_owners(caller)

    def find() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in owners:
                return owners[frame.f_code]
            frame = frame.f_back  # type: ignore[assignment]
        return "unknown"

    return find


def _registrar(table: dict[str, Entry], hook: str, plugin: Callable[[], str],
               order: Mapping[str, int]) -> Callable[..., None]:
    def register(name: str, factory: Callable[..., Any], default: bool = False) -> None:
        plugin_name = plugin()
        if name in table:
            # blame the plugin that came later to the plugin manager (pluggy calls it first)
            first, second = sorted((plugin_name, table[name].plugin), key=lambda p: order.get(p, len(order)))
            raise PluginError(f"{hook}: {name!r} from plugin {second!r} is already registered by {first!r}")
        table[name] = Entry(name, factory, default, plugin_name)

    return register
