"""A batch job over Ray Data: the rows go through `map_batches` with a pool of stateful actors, each holding one
engine built from the recipe (`BatchReplica`), and come back in input order.

Ray Data owns the distribution: an actor pool of `replicas` actors, batches handed to whichever is free, back
pressure, and retries: a replica that dies (killed, out of memory, its node lost) is restarted and its batch runs
again, so no row is lost. A batch's rows only come back when the whole batch is done, and the driver writes each
id once, so none is duplicated. The driver reads the input and writes the output (ids, order and resume are the
same as in-process); the rows are small next to the compute.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.api.errors import ConfigError
from decodekit.batch.rows import InputRow
from decodekit.ray_support import connect, import_ray, portable
from decodekit.recipe import Recipe

log = logging.getLogger("decodekit.batch")


@dataclass
class RayOptions:
    """Where and how wide a job runs on Ray.

    Attributes:
        address: the cluster (`auto`, `ray://host:10001`, ...); None starts a local one unless `RAY_ADDRESS` is set.
        replicas: engines, one per Ray actor, each working through batches of rows.
        cpus_per_replica: CPUs reserved per replica, also its torch thread count (default: the cluster's CPUs
            divided by `replicas`).
        batch_size: rows per Ray Data batch (a replica runs a batch as one continuous batch; a failed replica's
            batch is retried whole on another).
        folder_format: the files written when the output is a folder (`jsonl` or `parquet`; see
            `decodekit.batch.ray_dataset`).
        batches_per_replica: batches a replica takes at once, all in its one continuous batch (so that a replica's
            engine stays as full as an in-process job's while a batch's last rows finish).
    """

    address: str | None = None
    replicas: int = 1
    cpus_per_replica: int | None = None
    batch_size: int = 32
    folder_format: str = "jsonl"
    batches_per_replica: int = 4

    def compute(self, ray: Any) -> Any:
        """Ray Data's actor pool for these options."""
        k = self.batches_per_replica
        return ray.data.ActorPoolStrategy(size=self.replicas, max_tasks_in_flight_per_actor=k,
                                          max_concurrent_calls_per_actor=k)



class BatchReplica:
    """A Ray Data actor: one engine built from the recipe, running in a background thread (`AsyncLLM`), taking
    several batches of rows at once into its one continuous batch (`RayOptions.batches_per_replica`).

    Args:
        recipe: the job's recipe (model paths absolute, see `portable`).
        threads: torch threads (the CPUs Ray reserved for this replica).
    """

    def __init__(self, recipe: Recipe, threads: int):
        import torch
        from transformers.utils import logging as hf_logging

        from decodekit.batch.worker import BatchWorker
        from decodekit.llm import AsyncLLM

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()  # Ray forwards workers' output to the driver: no loading bars in it
        self.worker = BatchWorker(recipe)
        self.engine = AsyncLLM(engine=self.worker.llm.engine)

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        """Output rows (JSON text, so that rows of any shape travel as one column) for a batch of input rows."""
        rows = [InputRow.from_json(str(text)) for text in batch["row"]]
        outputs = await self.worker.run_async(rows, self.engine)
        return {"out": [json.dumps(out, ensure_ascii=False) for out in outputs]}


def run_on_ray(recipe: Recipe, rows: Sequence[InputRow], options: RayOptions) -> Iterator[dict[str, Any]]:
    """Output rows of `rows`, in their order, computed by `options.replicas` engines on Ray.

    Raises:
        ConfigError: Ray is not installed, or the cluster has fewer CPUs than the replicas need.
    """
    ray = import_ray()
    started = connect(options.address)
    try:
        per_replica = replica_cpus(ray, options)
        configure(ray)
        blocks = max(1, math.ceil(len(rows) / options.batch_size))
        dataset = ray.data.from_items([{"row": row.to_json()} for row in rows], override_num_blocks=blocks)
        # Ray Data restarts a dead actor and retries its batch by default (max_restarts=-1, max_task_retries=-1):
        # that is what makes a killed replica lose no row.
        dataset = dataset.map_batches(
            BatchReplica, fn_constructor_args=(portable(recipe), per_replica), batch_size=options.batch_size,
            batch_format="numpy", compute=options.compute(ray), num_cpus=per_replica)
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            for text in batch["out"]:
                yield json.loads(str(text))
    finally:
        if started:
            ray.shutdown()


def replica_cpus(ray: Any, options: RayOptions) -> int:
    """The CPUs (and torch threads) of each replica: `options.cpus_per_replica`, else the cluster's CPUs divided
    by the replicas.

    Raises:
        ConfigError: the cluster has fewer CPUs than the replicas need.
    """
    cpus = int(ray.cluster_resources().get("CPU", 1))
    per_replica = options.cpus_per_replica or max(1, cpus // options.replicas)
    if per_replica * options.replicas > cpus:
        raise ConfigError(f"{options.replicas} replicas of {per_replica} CPUs need {per_replica * options.replicas} "
                          f"CPUs; the Ray cluster has {cpus}")
    return per_replica


def configure(ray: Any) -> None:
    """Ray Data's settings for a batch job: rows in input order, no progress bars of its own (`decodekit batch`
    draws one), its logging at warnings."""
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
