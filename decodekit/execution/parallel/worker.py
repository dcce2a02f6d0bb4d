"""A rank's shard built and run: what every rank does to make its shard (`build_rank`), and the loop of ranks
1..N-1 (`worker_main`, the target of the processes rank 0 starts).

A worker gets the whole model from rank 0 (through shared memory: torch.multiprocessing's pickling of tensors),
plans it under the same options (so it makes the same choices: fused decoder or transformers' forward, kernels,
prepacking), cuts its shard, and then runs, step after step, the forward of the inputs rank 0 broadcasts, asking
for no logits: only rank 0 reads them. `None` from rank 0 ends the loop.
"""

from __future__ import annotations

import copy
import logging
import traceback
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from decodekit.api.config import EngineConfig
from decodekit.api.models import LoadedModel
from decodekit.execution.attention.kv_cache import PagedKVCache
from decodekit.execution.items import ForwardItem
from decodekit.execution.parallel.group import CommCounter, GroupAddress, broadcast_object, join_group, leave_group
from decodekit.execution.parallel.shard import row_parallel_fused, row_parallel_hooks, shard_model
from decodekit.execution.plan import ExecutionPlan, plan_execution
from decodekit.execution.runner import ModelRunner

log = logging.getLogger("decodekit.parallel")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled to it): its rank, where the group meets, the model as rank 0 has it
    (not yet split), and how rank 0 planned it."""

    rank: int
    address: GroupAddress
    model: Any
    name: str
    dtype: torch.dtype
    device: torch.device
    owned: bool
    config: EngineConfig
    num_blocks: int
    threads: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: the next CUDA device for each rank (wrapping around), the CPU for every rank on one."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


def build_rank(loaded: LoadedModel, plan: ExecutionPlan, num_blocks: int, rank: int, counter: CommCounter,
               in_place: bool) -> tuple[PagedKVCache, ModelRunner]:
    """Cut rank `rank`'s shard of `loaded.model` (in place, or of a copy where another part still reads the whole
    module), and build its KV pool (its share of the KV heads) and its runner, whose row-parallel products
    all-reduce over the group (counted in `counter`)."""
    model = loaded.model if in_place else copy.deepcopy(loaded.model)
    shard_model(model, rank, plan.tensor_parallel)
    device = rank_device(loaded.device, rank)
    model.to(device)
    geometry = plan.geometry
    kv_cache = PagedKVCache(geometry.num_layers, num_blocks, plan.config.block_size, geometry.num_kv_heads,
                            geometry.head_dim, plan.kv_dtype, device)
    runner = ModelRunner(model, kv_cache, plan)
    if runner.fused is not None:
        row_parallel_fused(runner.fused, counter)
    else:
        row_parallel_hooks(model, counter)
    return kv_cache, runner


def worker_main(spec: WorkerSpec, status: Any) -> None:
    """A worker process's life: build its shard, say so on `status` (`(rank, None)`, or the error), then serve the
    steps (`serve_steps`)."""
    try:
        runner = build_worker(spec)
    except Exception:  # whatever fails here is reported to rank 0, which refuses to start
        status.put((spec.rank, traceback.format_exc()))
        return
    status.put((spec.rank, None))
    serve_steps(spec, runner)


def build_worker(spec: WorkerSpec, model: Any = None) -> ModelRunner:
    """A worker's shard and runner, from `spec` (or `model`, where the spec travels without it: a Ray actor gets it
    from the object store)."""
    torch.set_num_threads(spec.threads)
    loaded = LoadedModel(spec.model if model is None else model, None, spec.name, spec.dtype, spec.device, spec.owned)
    plan = plan_execution(loaded, spec.config)  # the same choices rank 0 made for the same model and options
    return build_rank(loaded, plan, spec.num_blocks, spec.rank, CommCounter(), in_place=True)[1]


def serve_steps(spec: WorkerSpec, runner: ModelRunner) -> None:
    """Join the group, then run each step rank 0 broadcasts until it broadcasts None (or the group fails: rank 0
    is gone)."""
    join_group(spec.address, spec.rank)
    try:
        with torch.inference_mode():
            while True:
                message = broadcast_object(None, runner.device)
                if message is None:
                    break
                items, block_copies = cast(tuple[list[ForwardItem], list[tuple[int, int]]], message)
                runner.forward_with_hidden(_no_outputs(items), block_copies)
    except Exception:  # rank 0 died or left: nothing to serve, exit
        log.warning("tensor-parallel rank %d stops:\n%s", spec.rank, traceback.format_exc())
    finally:
        leave_group()


def _no_outputs(items: list[ForwardItem]) -> list[ForwardItem]:
    """The step's items asking for no logits and no hidden states (rank 0 reads those)."""
    return [replace(it, num_logits=0, num_hidden=0) for it in items]
