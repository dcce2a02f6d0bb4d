"""Moved to `decodekit.core.plugin_manager`; this import path stays for code written against earlier docs."""

from decodekit.core.plugin_manager import (
    ALLOW_LIST_ENV,
    DEFAULT_PLUGINS,
    ENTRY_POINT_GROUP,
    get_plugin_manager,
    plugin_origins,
)

__all__ = [
    "ALLOW_LIST_ENV",
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "get_plugin_manager",
    "plugin_origins",
]
