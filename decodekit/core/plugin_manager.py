"""The plugin manager: hookspecs, decodekit's default plugins, and third-party plugins from entry points.

Third-party plugins are found through the `decodekit` entry-point group. `DECODEKIT_PLUGINS` limits which of
them load: a comma-separated allow-list of entry-point names, or empty for none. The default plugins (the
modules in `DEFAULT_PLUGINS`: sampling processors, warpers, penalties, biases, stopping criteria, strategies and
proposers, model loaders, structured output) always load: the engine cannot decode without them, and they are
registered through the same hooks as any third-party plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os

import pluggy

from decodekit.api import hookspecs
from decodekit.api.errors import PluginError

log = logging.getLogger("decodekit.plugins")

ENTRY_POINT_GROUP = "decodekit"
ALLOW_LIST_ENV = "DECODEKIT_PLUGINS"
DEFAULT_PLUGINS = (
    "decodekit_plugins.sampling",
    "decodekit_plugins.warpers",
    "decodekit_plugins.penalties",
    "decodekit_plugins.biases",
    "decodekit_plugins.stopping",
    "decodekit_plugins.strategies",
    "decodekit_plugins.diverse_beam_search",
    "decodekit_plugins.contrastive_search",
    "decodekit_plugins.best_of",
    "decodekit_plugins.models",
    "decodekit_plugins.structured",
    "decodekit_plugins.hf_processors",
    "decodekit_plugins.tool_formats",
    "decodekit_plugins.tool_families",
    "decodekit_plugins.metrics",
    "decodekit_plugins.reasoning_formats",
)


def get_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh plugin manager with the hookspecs, the default plugins and (optionally) entry-point plugins."""
    pm = pluggy.PluginManager("decodekit")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        _load_entry_points(pm)
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allowed_env = os.environ.get(ALLOW_LIST_ENV)
    allowed = None if allowed_env is None else {n.strip() for n in allowed_env.split(",") if n.strip()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party package must not take decodekit down
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        if not pm.is_registered(plugin):
            pm.register(plugin, name=ep.name)
        log.debug("loaded plugin %s from %s", ep.name, ep.value)


def plugin_origins(pm: pluggy.PluginManager) -> dict[str, str]:
    """Map each loaded plugin's name to where it came from ("default" or "package==version")."""
    origin = {name: "default (decodekit)" for name in DEFAULT_PLUGINS}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(ep.name) is not None and ep.dist is not None:
            origin[ep.name] = f"{ep.dist.name}=={ep.dist.version}"
    return {name: origin.get(name, "registered in-process") for name, plugin in pm.list_name_plugin() if plugin}
