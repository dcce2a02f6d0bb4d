"""Rank 0 of a model split over N ranks: `TensorParallelRunner` starts ranks 1..N-1, and runs each step on its
own shard after broadcasting the step's inputs to them.

It is the engine's `ModelRunner` for a split model (`ModelExecutor` builds one where `plan.tensor_parallel > 1`):
the same `forward` / `forward_with_hidden`, the logits and hidden states computed on rank 0 alone (the LM head is
replicated). A worker that exits, or a collective that fails or times out, fails the step with `EngineDeadError`
naming the rank, and every later step with the same error: the engine fails those steps' requests and goes on
answering (nothing hangs), while the workers still alive are stopped and the group is left.
"""

from __future__ import annotations

import logging
import queue
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from decodekit.api.errors import EngineDeadError
from decodekit.api.models import LoadedModel
from decodekit.execution.attention.kv_cache import PagedKVCache
from decodekit.execution.items import ForwardItem
from decodekit.execution.parallel.group import (
    CommCounter,
    broadcast_object,
    group_address,
    join_group,
    leave_group,
)
from decodekit.execution.parallel.ray_ranks import RayRank, node_address, remove_group, start_ray_ranks
from decodekit.execution.parallel.worker import WorkerSpec, build_rank, worker_main
from decodekit.execution.plan import ExecutionPlan

log = logging.getLogger("decodekit.parallel")

# How long rank 0 waits for the workers to load their shards (spawning a Python with torch, planning, slicing).
START_TIMEOUT_S = 600.0


class _Workers:
    """The worker ranks (processes, or Ray actors seen as processes: `ray_ranks.RayRank`) and whether the group is
    joined; closed once (by `close`, or at exit)."""

    def __init__(self, processes: list[Any], placement: Any = None) -> None:
        self.processes = processes
        self.placement = placement  # a Ray placement group to remove at the end
        self.joined = False

    def dead(self) -> str | None:
        """Which worker has exited, and how, or None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                how = process.exit_text() if isinstance(process, RayRank) else f"exited with code {process.exitcode}"
                return f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
        return None

    def close(self, device: torch.device, stop: bool) -> None:
        """Stop the workers (`stop`: ask them through the group first) and leave the group."""
        if stop and self.joined:
            try:
                broadcast_object(None, device)
            except Exception as exc:  # a worker already gone: it is terminated below
                log.info("tensor-parallel stop message failed: %r", exc)
        for process in self.processes:
            if stop:
                process.join(timeout=10)
            if process.is_alive():  # after a failure (or a worker that does not stop): a hung or stopped
                process.kill()      # (SIGSTOP) worker would sit on SIGTERM, not on SIGKILL
                process.join(timeout=5)
        if self.joined:
            leave_group()
            self.joined = False
        self.processes = []
        if self.placement is not None:
            remove_group(self.placement)
            self.placement = None


class TensorParallelRunner:
    """Rank 0's runner of a model split over `plan.tensor_parallel` ranks (see the module's docstring).

    Args:
        loaded: the whole model (rank 0 cuts its own shard, in place where `in_place`, else of a copy).
        plan: its plan (`plan.geometry` is one rank's).
        num_blocks: KV blocks in each rank's pool.
        in_place: whether rank 0 may cut its shard out of `loaded.model` itself (nothing else reads the module).

    Raises:
        EngineDeadError: a worker failed to start (its error is in the message).
    """

    runs_decode = False
    """No native decode runs: every rank runs each step (`ModelRunner.decode_run`)."""

    def __init__(self, loaded: LoadedModel, plan: ExecutionPlan, num_blocks: int, in_place: bool) -> None:
        ranks = plan.tensor_parallel
        self.comm = CommCounter()
        self.dead: str | None = None
        on_ray = plan.config.tensor_parallel_backend == "ray"
        address = group_address(ranks, loaded.device, host=node_address() if on_ray else None)
        specs = [WorkerSpec(rank, address, None if on_ray else loaded.model, loaded.name, loaded.dtype,
                            loaded.device, loaded.owned, plan.config, num_blocks, torch.get_num_threads())
                 for rank in range(1, ranks)]
        status: Any = None
        if on_ray:  # the actors build their shards before rank 0 cuts its own out of the module
            try:
                processes, placement = start_ray_ranks(specs, loaded.model, loaded.device.type == "cuda",
                                                       START_TIMEOUT_S)
            except RuntimeError as exc:
                raise EngineDeadError(str(exc)) from exc
            self._workers = _Workers(list(processes), placement)
        else:
            context = mp.get_context("spawn")
            status = context.Queue()
            self._workers = _Workers([])
            for spec in specs:
                process = context.Process(target=worker_main, args=(spec, status), daemon=True,
                                          name=f"decodekit-tp-rank{spec.rank}")
                process.start()  # pickles the unsplit model now (its tensors move to shared memory)
                self._workers.processes.append(process)
        self.kv_cache: PagedKVCache
        self.kv_cache, self._runner = build_rank(loaded, plan, num_blocks, 0, self.comm, in_place)
        self.device = self._runner.device
        self.fused = self._runner.fused
        self.model = self._runner.model
        self._finalizer = weakref.finalize(self, self._workers.close, self.device, True)
        try:
            if status is not None:
                self._await_workers(status, ranks - 1)
            join_group(address, 0)
        except BaseException:
            self._finalizer()
            raise
        self._workers.joined = True
        log.info("tensor parallel: %d ranks (%s%s), rank 0 here, workers %s", ranks, address.backend,
                 ", on Ray" if on_ray else "", [p.pid for p in self._workers.processes])

    def _await_workers(self, status: Any, count: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        ready = 0
        while ready < count:
            try:
                rank, error = status.get(timeout=0.5)
            except queue.Empty:
                dead = self._workers.dead()
                if dead is not None:
                    raise EngineDeadError(f"{dead} while loading its shard") from None
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"the tensor-parallel workers did not load their shards within "
                                          f"{START_TIMEOUT_S:.0f} s") from None
                continue
            if error is not None:
                raise EngineDeadError(f"tensor-parallel rank {rank} failed to load its shard:\n{error}")
            ready += 1

    @property
    def workers(self) -> list[Any]:
        """The worker processes still held (ranks 1..N-1 in order; empty once stopped)."""
        return list(self._workers.processes)

    def forward(self, items: list[ForwardItem], block_copies: list[tuple[int, int]]) -> torch.Tensor:
        """`ModelRunner.forward` over the split model."""
        return self.forward_with_hidden(items, block_copies)[0]

    def decode_run(self, token: int, position: int, block_table: list[int], steps: int, stop_ids: Sequence[int],
                   block_copies: list[tuple[int, int]], draws: Any = None, interrupt: Any = None) -> list[int] | None:
        """None: a split model runs no native decode runs (`runs_decode`)."""
        return None

    def forward_with_hidden(self, items: list[ForwardItem], block_copies: list[tuple[int, int]]
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ModelRunner.forward_with_hidden` over the split model: the inputs broadcast to every rank, each rank's
        shard run, the logits (and hidden states) from rank 0.

        Raises:
            EngineDeadError: a worker has exited or a collective failed (now or at an earlier step).
        """
        if self.dead is None:
            self.dead = self._workers.dead()
        if self.dead is not None:
            self._stop()
            raise EngineDeadError(self.dead)
        try:
            broadcast_object((items, block_copies), self.device, self.comm)
            out = self._runner.forward_with_hidden(items, block_copies)
        except Exception as exc:
            time.sleep(0.2)  # a worker killed mid-step: let its exit be seen, to name it
            self.dead = self._workers.dead() or f"a tensor-parallel collective failed: {exc!r}"
            self._stop()
            raise EngineDeadError(self.dead) from exc
        self.comm.steps += 1
        self.comm.tokens += sum(len(it.token_ids) for it in items)
        return out

    def _stop(self) -> None:
        self._workers.close(self.device, stop=False)

    def close(self) -> None:
        """Stop the workers and leave the group (also done at exit, or when the runner is collected)."""
        self._finalizer()
