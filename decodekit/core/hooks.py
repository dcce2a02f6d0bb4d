"""The engine's lifecycle hooks (request added, step finished, request finished), each call guarded.

A plugin's lifecycle hook runs inside the step loop, so its exception must not become the engine's: a hook that
raises while a request is added fails that request alone; one that raises after a step or when a request has
finished (nothing left to fail) is logged, naming the plugin, and the engine goes on.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import pluggy

from decodekit.api.sequence import Request, RequestOutput
from decodekit.core.registry import hook_owners

log = logging.getLogger("decodekit.engine")


class LifecycleHooks:
    """Calls the lifecycle hooks of every loaded plugin through pluggy and contains their failures.

    Args:
        plugin_manager: the engine's plugin manager.
        engine: what the hooks receive as `engine`.
    """

    def __init__(self, plugin_manager: pluggy.PluginManager, engine: Any) -> None:
        self.hook = plugin_manager.hook
        self.engine = engine

    def engine_started(self) -> None:
        """Before any request: a hook that raises here fails the engine's construction (nothing is serving yet)."""
        self.hook.decodekit_engine_started(engine=self.engine)

    def request_added(self, request: Request) -> str | None:
        """Tell the plugins a request was queued; returns why a hook failed (the request must then fail)."""
        return self._call("decodekit_request_added", request=request)

    def step_finished(self, outputs: list[RequestOutput]) -> None:
        """Tell the plugins a step ended (a hook failure is logged: the step's outputs are already made)."""
        self._call("decodekit_step_finished", outputs=outputs)

    def request_finished(self, request: Request, output: RequestOutput) -> None:
        """Tell the plugins a request ended (a hook failure is logged: the request is already over)."""
        self._call("decodekit_request_finished", request=request, output=output)

    def _call(self, name: str, **kwargs: Any) -> str | None:
        caller = getattr(self.hook, name)
        try:
            caller(engine=self.engine, **kwargs)
        except Exception as exc:
            plugin = _culprit(caller, exc.__traceback__)
            message = f"plugin {plugin!r}: its {name} hook raised {exc!r}"
            log.warning("%s", message, exc_info=exc)
            return message
        return None


def _culprit(caller: Any, tb: TracebackType | None) -> str:
    """The plugin whose hook implementation raised: the innermost traceback frame that is one of them."""
    owners = hook_owners(caller)
    found = "unknown"
    while tb is not None:
        found = owners.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found
