"""`decodekit serve RECIPE --ray --replicas N`: the OpenAI app of `decodekit serve` as a Ray Serve deployment.

Each replica is a Ray actor holding one engine and the same FastAPI app (`create_app`), so every endpoint, error
shape, the API key and `/metrics` are those of the single-process server. Ray Serve's HTTP proxy spreads requests
over the replicas (to the one with the fewest requests in flight, among two picked at random), and with
`autoscaling` it adds and removes replicas by the number of requests in flight. Each response names its replica in
the `x-decodekit-replica` header; `/metrics` is the metrics of the replica that answers it (Ray's own metrics
export covers the whole deployment, see docs/scale-out.md).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from decodekit.api.errors import ConfigError
from decodekit.recipe import Recipe
from decodekit.serve.app import ServeOptions

log = logging.getLogger("decodekit.serve")

REPLICA_HEADER = "x-decodekit-replica"
"""The response header naming the replica that answered."""

APP_NAME = "decodekit"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


@dataclass
class ReplicaOptions:
    """How many replicas serve, and what each gets.

    Attributes:
        replicas: a fixed number of replicas (ignored when `max_replicas` is set).
        min_replicas: with autoscaling, the fewest replicas (0 lets it scale to zero when idle).
        max_replicas: set to autoscale between `min_replicas` and this.
        target_ongoing_requests: with autoscaling, the requests in flight per replica it aims at.
        max_ongoing_requests: requests a replica takes at once, all in its engine's continuous batch (Ray Serve's
            own default, 5, would leave an engine mostly idle); more wait at the proxy.
        cpus_per_replica: CPUs Ray reserves for each replica, also its torch threads (default 1).
        address: the Ray cluster (`auto`, `ray://host:10001`); None: `RAY_ADDRESS`, else a local cluster.
    """

    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 32.0
    max_ongoing_requests: int = 256
    cpus_per_replica: int = 1
    address: str | None = None

    def deployment_options(self) -> dict[str, Any]:
        """`serve.deployment` options: a replica count or an autoscaling config, and the CPUs of each."""
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.cpus_per_replica},
                                   "max_ongoing_requests": self.max_ongoing_requests}
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            if self.max_replicas < max(self.min_replicas, 1):
                raise ConfigError(f"max_replicas ({self.max_replicas}) must be at least min_replicas "
                                  f"({self.min_replicas}) and 1")
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": max(self.min_replicas, 1),
                "target_ongoing_requests": self.target_ongoing_requests}
        return options


class ReplicaHeader:
    """ASGI middleware adding `x-decodekit-replica: <id>` to every HTTP response (streams included)."""

    def __init__(self, app: ASGIApp, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        """Pass through, adding the header to `http.response.start`."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class OpenAIReplica:
    """One Ray Serve replica: an engine built from the recipe behind the OpenAI app (see `create_app`).

    Args:
        recipe: the recipe served (local model paths absolute).
        options: the app's options (API key, body limit, waiting bound; host and port are the proxy's).
        threads: torch threads (the CPUs Ray reserved for the replica).
    """

    def __init__(self, recipe: Recipe, options: ServeOptions, threads: int):
        import torch
        from ray import serve
        from transformers.utils import logging as hf_logging

        from decodekit.serve.app import create_app

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()
        self.replica = serve.get_replica_context().replica_tag
        # (not `self.app`: Ray Serve's ingress wrapper owns that name)
        self.openai_app = create_app(recipe, options)
        self.openai_app.add_middleware(ReplicaHeader, replica=self.replica)

    def __serve_build_asgi_app__(self) -> Any:
        """The replica's ASGI app (Ray Serve calls this once the replica is built)."""
        return self.openai_app


def build_application(recipe: Recipe, options: ServeOptions, replicas: ReplicaOptions) -> Any:
    """The Ray Serve application serving `recipe` (bind it with `serve.run`).

    Raises:
        ConfigError: Ray Serve is not installed, or the replica options contradict each other.
    """
    serve = import_serve()
    from decodekit.ray_support import portable

    deployment = serve.deployment(serve.ingress()(OpenAIReplica), name="openai",
                                  **replicas.deployment_options())
    return deployment.bind(portable(recipe), options, replicas.cpus_per_replica)


def import_serve() -> Any:
    """The `ray.serve` module.

    Raises:
        ConfigError: Ray (with Serve) is not installed; the message names the `ray` extra.
    """
    from decodekit.ray_support import RAY_EXTRA_MESSAGE

    try:
        from ray import serve
    except ImportError:
        raise ConfigError(RAY_EXTRA_MESSAGE) from None
    return serve


def start(recipe: Recipe, options: ServeOptions, replicas: ReplicaOptions) -> bool:
    """Deploy the recipe on Ray Serve, its HTTP proxy at `options.host:options.port`, and return once every replica
    is up (the deployment keeps running on the cluster; `stop` ends it). Returns whether this call started Ray
    (connected to the cluster, or started a local one), for `stop`."""
    serve = import_serve()
    from decodekit.ray_support import connect

    started = connect(replicas.address)
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_application(recipe, options, replicas), name=APP_NAME, route_prefix="/", blocking=False)
    return started


def stop(disconnect: bool = False, within_s: float = 45.0) -> None:
    """Delete the deployment (Ray Serve lets the requests in flight finish) and shut Ray Serve down, waiting at most
    `within_s` (a Ctrl-C in a terminal also stops a local cluster's processes, and then nobody answers); with
    `disconnect`, leave the Ray cluster too (a local one stops)."""
    serve = import_serve()

    def shut_down() -> None:
        serve.delete(APP_NAME)
        serve.shutdown()

    worker = threading.Thread(target=shut_down, name="decodekit-serve-stop", daemon=True)
    worker.start()
    worker.join(within_s)
    if worker.is_alive():
        log.warning("Ray Serve did not stop within %.0f s (was the cluster stopped already?)", within_s)
    if disconnect:
        import ray

        ray.shutdown()


def serve_until_signalled(recipe: Recipe, options: ServeOptions, replicas: ReplicaOptions,
                          on_ready: Callable[[], None] | None = None) -> None:
    """`start`, call `on_ready`, then wait for SIGINT or SIGTERM and `stop` (Ray Serve lets the requests in flight
    finish, up to `options.graceful_shutdown_s`)."""
    started = start(recipe, options, replicas)
    if on_ready is not None:
        on_ready()
    stopped = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopped.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopped.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop(disconnect=started, within_s=options.graceful_shutdown_s + 15)
