"""The process group of a tensor-parallel model, and the count of what its collectives move.

Ranks find each other the way torchrun's do (`MASTER_ADDR`, `MASTER_PORT`): rank 0 picks a free port on
127.0.0.1 unless the environment names one, and hands it to the workers it starts. Every collective has the group's
timeout, so a rank that stops answering fails the others' collective instead of hanging them.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective waits for the other ranks before it fails (a worker that died mid-step usually fails the
# collective at once, when its sockets close; this bounds the case where it hangs instead).
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks meet: torchrun's `MASTER_ADDR`/`MASTER_PORT`, the world size and the backend."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float = DEFAULT_TIMEOUT_S


def backend_for(device: torch.device, world_size: int) -> str:
    """NCCL where every rank has a CUDA device of its own; gloo elsewhere: CPUs, and more ranks than CUDA devices
    (NCCL refuses two ranks on one device; gloo all-reduces CUDA tensors through the host, which is how one GPU
    runs 2 ranks for an exactness check)."""
    if device.type == "cuda" and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def group_address(world_size: int, device: torch.device, timeout_s: float | None = None,
                  host: str | None = None) -> GroupAddress:
    """Rank 0's address for a new group: `host` (else `MASTER_ADDR`, else 127.0.0.1) and `MASTER_PORT` where set,
    else a port the OS says is free now; collectives time out after `timeout_s` (default `DEFAULT_TIMEOUT_S`, read
    now)."""
    host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "0")) or _free_port(host)
    return GroupAddress(host, port, world_size, backend_for(device, world_size), timeout_s or DEFAULT_TIMEOUT_S)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def join_group(address: GroupAddress, rank: int) -> None:
    """Join the group as `rank` (blocks until every rank has joined, or the timeout passes).

    Raises:
        RuntimeError: this process is already in a torch.distributed group (one tensor-parallel model per process).
    """
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel engine "
                           "per process (close the other first)")
    dist.init_process_group(address.backend, init_method=f"tcp://{address.host}:{address.port}", rank=rank,
                            world_size=address.world_size, timeout=timedelta(seconds=address.timeout_s))


def leave_group() -> None:
    """Leave the group, where this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class CommCounter:
    """What this rank's collectives moved: all-reduce payload bytes, calls and the seconds spent in them, broadcast
    bytes, steps and their tokens.

    Counted as the payload each rank contributes (a ring all-reduce of `b` bytes over N ranks sends
    `2 (N - 1) / N * b` bytes per rank on the wire; `docs/scale-out.md` turns one into the other)."""

    all_reduce_bytes: int = 0
    all_reduces: int = 0
    all_reduce_s: float = 0.0
    broadcast_bytes: int = 0
    steps: int = 0
    tokens: int = 0

    def reset(self) -> None:
        """Start counting from zero."""
        self.all_reduce_bytes = self.all_reduces = self.broadcast_bytes = self.steps = self.tokens = 0
        self.all_reduce_s = 0.0


def all_reduce(tensor: torch.Tensor, counter: CommCounter) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place, counting its bytes; returns it."""
    start = time.perf_counter()
    dist.all_reduce(tensor)
    counter.all_reduce_s += time.perf_counter() - start
    counter.all_reduce_bytes += tensor.numel() * tensor.element_size()
    counter.all_reduces += 1
    return tensor


def broadcast_object(value: object, device: torch.device, counter: CommCounter | None = None) -> object:
    """Rank 0's `value` on every rank (other ranks pass None): pickled into a byte tensor, its length first.

    A byte tensor rather than `broadcast_object_list`, so the bytes are counted and the tensor lives on the
    backend's device (NCCL broadcasts CUDA tensors only)."""
    if dist.get_rank() == 0:
        payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
        dist.broadcast(size, 0)
        dist.broadcast(payload, 0)
        if counter is not None:
            counter.broadcast_bytes += payload.numel() + size.element_size()
        return value
    size = torch.empty(1, dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, 0)
    return pickle.loads(payload.cpu().numpy().tobytes())
