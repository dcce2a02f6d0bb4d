"""A real `decodekit serve` app on uvicorn in a background thread, on a free loopback port, for tests that talk to it
with real clients (the `openai` SDK, httpx, lm-evaluation-harness)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from decodekit import hookimpl
from decodekit.api.processors import LogitsProcessor
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.recipe import Recipe
from decodekit.serve import ServeOptions, create_app

KEY = "test-key"


class _Slow(LogitsProcessor):
    """Sleeps 20 ms per step of the requests that name it, which keeps them running long enough to be disconnected,
    queued behind or shut down while in flight."""

    name = "slow"

    def __call__(self, logits, batch):
        time.sleep(0.02)
        return logits


class _SlowPlugin:
    @hookimpl
    def decodekit_register_processors(self, register):
        register("slow", _Slow)


SLOW = {"processors": ["slow"], "ignore_eos": True}


class Served:
    """An app served by uvicorn in a background thread, on a loopback port bound before it starts (with the `slow`
    processor registered)."""

    def __init__(self, recipe: Recipe, plugins: tuple[object, ...] = (), **options: Any) -> None:
        pm = get_plugin_manager(load_entry_points=False)
        pm.register(_SlowPlugin(), "slow")
        for plugin in plugins:  # a test's own plugins, beside decodekit's
            pm.register(plugin)
        self.app = create_app(recipe, ServeOptions(**options), plugin_manager=pm)
        self.service = self.app.state.service
        self.engine = self.service.engine
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(**{"base_url": f"{self.url}/v1", "api_key": KEY, "max_retries": 0, **kwargs})

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until nothing waits or runs and every KV block is free."""
        deadline = time.monotonic() + timeout
        allocator = self.engine.allocator
        while self.engine.has_unfinished_requests() or self.engine.requests or self.service.live \
                or allocator.num_free_blocks != allocator.num_blocks:
            assert time.monotonic() < deadline, f"not idle: {self.engine.stats()}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
