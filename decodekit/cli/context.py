"""What the recipe commands start from, set up in one place: the plugin manager (decodekit's plugins and the
entry points `DECODEKIT_PLUGINS` allows), the registry its plugins fill through pluggy, and a recipe validated
against that registry. `run`, `serve`, `batch`, `recipe check`, `plugins` and `bench --recipe` each build this once
and pass its plugin manager on (to the engine, the server, the batch job), so every part of a command sees the
same plugins.

Everything heavy is imported when a context is built, not when this module is: `decodekit --help` imports it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pluggy

    from decodekit.core.registry import Registry
    from decodekit.recipe import Recipe


@dataclass(frozen=True)
class CommandContext:
    """The loaded plugins of one command: their manager and the registry of what they register."""

    plugin_manager: pluggy.PluginManager
    registry: Registry

    def load_recipe(self, path: Path, overrides: Sequence[str] | None) -> Recipe:
        """Read and validate the recipe at `path` with its `--set key.path=value` overrides, against this
        context's registry.

        Raises:
            RecipeError: as `decodekit.recipe.load_recipe` (the message names the file and the key).
        """
        from decodekit.recipe import load_recipe

        return load_recipe(path, overrides or [], registry=self.registry)

    def check_models_for_ray(self, recipe: Recipe, ray_address: str | None) -> None:
        """When a Ray job runs on this machine (no cluster address given, neither `--ray-address` nor
        `RAY_ADDRESS`), check now that the recipe's models resolve, so a missing one fails here once, not in every
        replica's start-up. On a remote cluster the models are the cluster's to find.

        Raises:
            RecipeError: a model does not resolve (as `decodekit.recipe.check_models`).
        """
        if ray_address is None and not os.environ.get("RAY_ADDRESS"):
            from decodekit.recipe import check_models

            check_models(recipe, self.registry)


def load_context() -> CommandContext:
    """Load the plugins (`decodekit.core.plugin_manager.get_plugin_manager`) and fill a registry from them.

    Raises:
        PluginError: a plugin fails to load or registers a name twice.
    """
    from decodekit.core.plugin_manager import get_plugin_manager
    from decodekit.core.registry import Registry

    plugin_manager = get_plugin_manager()
    return CommandContext(plugin_manager, Registry.from_plugin_manager(plugin_manager))
