"""Measuring a model's `StepCost` (seconds of a forward by the rows it computes) on this machine, cached on disk.

A forward of R rows is timed as a speculative verification step looks: ceil(R / 4) sequences of up to 4 new tokens
after a short context, every row scored, over scratch blocks of the model's own KV pool (taken and freed between
two steps; the values in them do not matter, only the time). The curve is cached under `$DECODEKIT_CACHE/step_cost`
(beside the kernel cache), keyed by the model, how it runs (`ModelExecutor.forward_name`, dtype, device), torch's
thread count and version, and this CPU, so a later engine start on the same machine reads it instead of measuring.
A cached file is data, not code: one that does not parse is measured again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from decodekit.api.cpu import cpu_flags
from decodekit.api.step_cost import StepCost
from decodekit.execution.executor import ModelExecutor
from decodekit.execution.items import ForwardItem
from decodekit.execution.kernels.native import load_kernels
from decodekit.models.loader import cache_dir

log = logging.getLogger("decodekit.engine")

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
"""The row counts measured: batch 32 verifying 3 draft tokens each is 128 rows; past the last the curve goes on
linearly."""

CONTEXT = 32  # tokens before each sequence's new ones: attention over a short context, as in a decode step
TOKENS_PER_SEQUENCE = 4  # a verification's draft plus the target's own token
REPEATS = 5  # the fastest of these timings per row count (others were slowed by other work), after a warm-up


def cache_key(executor: ModelExecutor, name: str) -> str:
    """What makes a measured curve valid: the model, how it runs, the threads, torch, the native kernels (their
    library's name carries a hash of their source: a curve measured with older kernels is measured again), and this
    machine."""
    plan = executor.plan
    kernels = load_kernels()
    parts = [name, executor.forward_name, str(plan.geometry), str(plan.kv_dtype), str(executor.kv_cache.pool.device),
             str(torch.get_num_threads()), torch.__version__, platform.machine(), " ".join(sorted(cpu_flags())),
             _cpu_model(), json.dumps([ROWS, CONTEXT, TOKENS_PER_SEQUENCE]),
             kernels if isinstance(kernels, str) else kernels.path.name]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cached_step_cost(executor: ModelExecutor, name: str) -> StepCost | None:
    """The model's step cost on this machine: read from the cache, or measured now and cached; None when the pool
    has no blocks to spare for measuring now (ask again later)."""
    path = cache_dir() / "step_cost" / f"{cache_key(executor, name)}.json"
    try:
        data = json.loads(path.read_text())
        return StepCost(tuple(data["rows"]), tuple(data["seconds"]))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("measuring the step cost again: %s does not hold one (%s)", path, error)
    started = time.perf_counter()
    cost = measure_step_cost(executor)
    if cost is None:
        return None
    log.info("%s: step cost measured in %.1f s (%s rows: %s ms), cached in %s", name,
             time.perf_counter() - started, "/".join(map(str, cost.rows)),
             "/".join(f"{s * 1e3:.1f}" for s in cost.seconds), path.parent)
    _write(path, {"model": name, "forward": executor.forward_name, "rows": list(cost.rows),
                  "seconds": list(cost.seconds)})
    return cost


def _write(path: Path, data: dict[str, object]) -> None:
    """Write `data` as JSON to `path` atomically (concurrent engines at worst both measure); a cache that cannot be
    written is only logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as file:
            json.dump(data, file)
        os.replace(partial, path)
    except OSError as error:
        log.warning("could not cache the step cost in %s: %s", path, error)


@torch.inference_mode()
def measure_step_cost(executor: ModelExecutor, rows: tuple[int, ...] = ROWS) -> StepCost | None:
    """Time a forward of each of `rows` rows over scratch blocks of `executor`'s pool; row counts whose blocks the
    pool cannot spare now are left out (the curve extends linearly past the last measured); None when not even the
    first can be measured now."""
    allocator = executor.allocator
    measured: list[tuple[int, float]] = []
    for count in rows:
        lengths = [TOKENS_PER_SEQUENCE] * (count // TOKENS_PER_SEQUENCE) + (
            [count % TOKENS_PER_SEQUENCE] if count % TOKENS_PER_SEQUENCE else [])
        need = len(lengths) * allocator.blocks_needed(CONTEXT + TOKENS_PER_SEQUENCE)
        if need > allocator.num_free_blocks:
            break
        keys = [-1 - i for i in range(len(lengths))]  # sequence ids are >= 0: scratch keys never collide
        try:
            items = []
            for key, length in zip(keys, lengths):
                allocator.allocate(key, [])
                allocator.ensure_slots(key, 0, CONTEXT + length)
                items.append(ForwardItem([0] * length, CONTEXT, allocator.block_table(key), length))
            warmups = 3 if not measured else 1  # the very first forwards also warm up the allocator and caches
            times = [_timed_forward(executor, items) for _ in range(REPEATS + warmups)][warmups:]
        finally:
            for key in keys:
                if allocator.has(key):
                    allocator.free(key)
        measured.append((count, min(times)))
    if not measured:  # not even one row's blocks are free now: the caller measures later
        return None
    return StepCost(tuple(r for r, _ in measured), tuple(max(s, 1e-7) for _, s in measured))


def _timed_forward(executor: ModelExecutor, items: list[ForwardItem]) -> float:
    device = executor.kv_cache.pool.device
    start = time.perf_counter()
    executor.run(items, [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start

