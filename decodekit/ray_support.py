"""Ray for the front-ends that scale out (`decodekit batch --ray`, `decodekit serve --ray`): importing it with a
message naming the extra, joining (or starting) a cluster, and making a recipe fit to ship to Ray's workers.

Ray is optional (`pip install 'decodekit[ray]'`): nothing here imports it before it is asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from decodekit.api.errors import ConfigError
from decodekit.recipe import Recipe

RAY_EXTRA_MESSAGE = "Ray is not installed: pip install 'decodekit[ray]' (Ray Data and Ray Serve)"


def import_ray() -> Any:
    """The `ray` module, with Ray Data.

    Raises:
        ConfigError: Ray is not installed (the message names the `ray` extra).
    """
    try:
        import ray
        import ray.data
    except ImportError:
        raise ConfigError(RAY_EXTRA_MESSAGE) from None
    return ray


def connect(address: str | None, **init_options: Any) -> bool:
    """Connect to the Ray cluster at `address` (None: `RAY_ADDRESS`, else start a local one), unless connected.
    Returns whether this call connected (and so should disconnect at the end)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
             **init_options)
    return True


def portable(recipe: Recipe) -> Recipe:
    """The recipe with local model paths (the model's, the draft's) made absolute: Ray workers do not run in the
    driver's directory."""

    def absolute(spec: str) -> str:
        path = Path(spec)
        return str(path.resolve()) if not path.is_absolute() and path.exists() else spec

    update: dict[str, Any] = {"model": absolute(recipe.model)}
    if recipe.draft is not None:
        update["draft"] = recipe.draft.model_copy(update={"model": absolute(recipe.draft.model)})
    return recipe.model_copy(update=update)
