"""Ranks 1..N-1 of a split model as Ray actors (`tensor_parallel_backend: ray`), placed by a placement group.

One bundle per worker rank (its threads' CPUs, and a GPU where the model is on CUDA: Ray then shows each actor its
own device), PACK: on this node while it has room, then on the cluster's other nodes. The model goes to the actors
once through Ray's object store; the ranks meet at this node's IP (`MASTER_ADDR` where set). Each actor builds its
shard (`worker.build_worker`), then serves the steps (`worker.serve_steps`) in one long call, whose end (the actor
died, was killed, or stopped) is what `RayRank.is_alive` watches.

Ray is optional: nothing here imports it before a split model asks for it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from decodekit.api.errors import ConfigError
from decodekit.execution.parallel.worker import WorkerSpec, build_worker, serve_steps

log = logging.getLogger("decodekit.parallel")


def import_ray() -> Any:
    """The `ray` module, connected to a cluster (the one this process is connected to, else `RAY_ADDRESS`'s, else
    a new local one).

    Raises:
        ConfigError: Ray is not installed (the message names the extra and the option).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("tensor_parallel_backend 'ray': Ray is not installed: pip install 'decodekit[ray]'") \
            from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    return ray


def node_address() -> str:
    """Where the other ranks reach rank 0: `MASTER_ADDR` where set, else this node's IP as Ray sees it."""
    ray = import_ray()
    return os.environ.get("MASTER_ADDR") or str(ray.util.get_node_ip_address())


class _RankActor:
    """A worker rank inside a Ray actor: `build`, then `serve` until rank 0 stops it."""

    def __init__(self) -> None:
        self.runner: Any = None
        self.spec: WorkerSpec | None = None

    def build(self, spec: WorkerSpec, model: Any) -> int:
        """Build the shard; returns this actor's pid (a failure raises, and Ray hands the error to rank 0)."""
        self.spec, self.runner = spec, build_worker(spec, model)
        return os.getpid()

    def serve(self) -> None:
        """Serve the steps until rank 0 broadcasts None."""
        assert self.spec is not None
        serve_steps(self.spec, self.runner)


class RayRank:
    """A worker rank's Ray actor, seen the way rank 0 sees a worker process: `pid`, `is_alive`, `join`, `kill`, and
    `exit_text` saying how it ended."""

    def __init__(self, ray: Any, actor: Any, rank: int) -> None:
        self._ray = ray
        self.actor = actor
        self.rank = rank
        self.pid: int | None = None
        self.serving: Any = None  # the `serve` call's reference, once started

    def is_alive(self) -> bool:
        """Whether the actor still serves (or has not started serving yet)."""
        if self.serving is None:
            return True
        ready, _ = self._ray.wait([self.serving], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the actor to stop serving."""
        if self.serving is not None:
            self._ray.wait([self.serving], timeout=timeout)

    def kill(self) -> None:
        """Kill the actor."""
        self._ray.kill(self.actor, no_restart=True)

    def exit_text(self) -> str:
        """How the actor ended: the error Ray reports for it (an actor that died), or that it stopped."""
        try:
            self._ray.get(self.serving, timeout=0)
        except Exception as exc:  # what Ray raises for a dead actor: its message says how it died
            return f"stopped ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return "stopped"


def start_ray_ranks(specs: list[WorkerSpec], model: Any, cuda: bool, timeout_s: float) -> tuple[list[RayRank], Any]:
    """Place and start one actor per spec, wait for each to build its shard, then start their step loops. Returns
    the ranks and the placement group (to remove at the end).

    Raises:
        RuntimeError: the placement group could not be placed, or an actor failed to build its shard, within
            `timeout_s` (the message says which).
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, float] = {"CPU": float(specs[0].threads)}
    if cuda:
        bundle["GPU"] = 1.0
    group = placement_group([dict(bundle) for _ in specs], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {len(specs)} worker ranks of {bundle} within {timeout_s:.0f} s "
                           f"(the cluster's resources: {ray.available_resources()})")
    actor_class = ray.remote(_RankActor)
    model_ref = ray.put(model)
    ranks = []
    for index, spec in enumerate(specs):
        actor = actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()
        ranks.append(RayRank(ray, actor, spec.rank))
    builds = [rank.actor.build.remote(spec, model_ref) for rank, spec in zip(ranks, specs)]
    try:
        pids = ray.get(builds, timeout=timeout_s)
    except Exception as exc:
        for rank in ranks:
            rank.kill()
        remove_placement_group(group)
        raise RuntimeError(f"a tensor-parallel Ray actor failed to load its shard: {exc}") from exc
    for rank, pid in zip(ranks, pids):
        rank.pid = pid
        rank.serving = rank.actor.serve.remote()
    log.info("tensor parallel on Ray: worker ranks placed, pids %s", pids)
    return ranks, group


def remove_group(group: Any) -> None:
    """Give the placement group's resources back to the cluster."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)
