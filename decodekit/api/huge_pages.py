"""Weights on transparent huge pages: a batch-1 CPU token streams every weight once, and on 4 KiB pages that is a
TLB miss every 4 KiB.

A float32 SmolLM2 token reads 538 MB of weights, 131,000 pages of 4 KiB; on 2 MiB pages, 270. Where the kernel
gives huge pages only to memory that asks for them (`/sys/kernel/mm/transparent_hugepage/enabled` set to
`madvise`, the usual default), torch's allocations never ask, so the weights lie on 4 KiB pages. Measured on a
2-core Zen 3 (AVX2, `madvise`): SmolLM2's 120 layer products of one row on `dk_gemv` (425 MB) took 22.8 ms on
torch's memory and 20.0 ms on huge pages (1.14x, alternating in one process). (llama.cpp reads its weights from a
memory-mapped file; this machine showed 424 MB of file-backed huge pages while it ran.)

`on_huge_pages(tensor)` copies a CPU tensor of at least `MIN_BYTES` into an arena of anonymous memory advised
`MADV_HUGEPAGE` (chunks of `CHUNK_BYTES`, 2 MiB-aligned, each tensor 4 KiB-aligned in it) and returns the copy; the
arena's chunks live as long as a tensor in them does, and a tensor's pages go back to the kernel (`MADV_DONTNEED`)
when it and its last view die: a weight laid out anew (`stored_matrices.laid_out_for`) and dropped is not kept
resident by its neighbours in the chunk. It returns the tensor itself where that cannot apply: not
Linux, transparent huge pages `never`, a GPU or small tensor, or `DECODEKIT_HUGE_PAGES=0`. Only where bytes lie
changes: the values, and every product, are the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import threading
import weakref
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
# Tensors smaller than this stay where they are (a tiny model's weights, a bias). Smaller than a huge page on purpose:
# the arena packs tensors side by side, so a model's many small matrices (SmolLM2's int8 or Q4_1 ones, 0.2-1.8 MB)
# share huge pages.
MIN_BYTES = 64 * 1024
# Bytes an arena maps at a time (more for a larger tensor): a model's weights in a few mappings, and at most one
# chunk's tail unused.
CHUNK_BYTES = 64 * 2**20
# Where each tensor starts in a chunk: a page, so no two tensors share one.
ALIGN = 4096
ENV = "DECODEKIT_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages_available() -> bool:
    """Whether weights can be placed on transparent huge pages here: Linux with `MADV_HUGEPAGE`, the kernel's
    setting `always` or `madvise`, and `DECODEKIT_HUGE_PAGES` not turning it off."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _give_back(chunk: weakref.ref[mmap.mmap], start: int, length: int) -> None:
    """A dead tensor's pages back to the kernel (`MADV_DONTNEED`: read again they are zeros); nothing if its chunk
    is gone or the kernel refuses."""
    mapping = chunk()
    if mapping is None or mapping.closed:
        return
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(mmap.MADV_DONTNEED, start, length)


class HugePageArena:
    """Anonymous memory advised onto huge pages, handed out as tensors (bump allocation: a dead tensor's pages are
    given back to the kernel, its addresses not reused)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._chunk: mmap.mmap | None = None
        self._next = 0  # offset of the next free byte in the current chunk
        self._end = 0
        # every live chunk's addresses, first to last byte: a chunk unmapped when its last tensor died is forgotten,
        # since the kernel may hand its addresses to the next mapping (a file's, torch's allocator's)
        self._spans: list[tuple[int, int, weakref.ref[mmap.mmap]]] = []

    def _new_chunk(self, nbytes: int) -> None:
        size = max(self.chunk_bytes, nbytes) + HUGE_PAGE  # room to start on a 2 MiB boundary
        chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        chunk.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
        self._chunk, self._next, self._end = chunk, -address % HUGE_PAGE, size
        self._spans.append((address, address + size, weakref.ref(chunk)))

    def holds_address(self, address: int) -> bool:
        """Whether `address` lies in one of this arena's chunks that is still mapped."""
        with self._lock:
            self._spans = [span for span in self._spans if span[2]() is not None]
            return any(start <= address < end for start, end, _ in self._spans)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie in this arena (a copy made here, or a view of one)."""
        return self.holds_address(tensor.data_ptr())

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` (same shape, dtype and values) in the arena."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if self._chunk is None or self._next + nbytes > self._end:
                self._new_chunk(nbytes)
            assert self._chunk is not None
            start = self._next
            self._next = -(-(start + nbytes) // ALIGN) * ALIGN
            # the tensor's own buffer, a ctypes array over its bytes of the chunk: it holds the chunk (which lives
            # while any tensor in it does), and it dies with the tensor's storage (the tensor and every view of it),
            # when its pages (whole: no two tensors share one) go back to the kernel
            own = (ctypes.c_char * nbytes).from_buffer(self._chunk, start)
            release = weakref.finalize(own, _give_back, weakref.ref(self._chunk), start, self._next - start)
            release.atexit = False  # at exit the process's memory goes anyway; later exit handlers may still read it
            out = torch.frombuffer(own, dtype=tensor.dtype, count=tensor.numel())
        return out.view(tensor.shape).copy_(tensor)


_ARENA = HugePageArena()


def in_file_mapping(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes lie in a memory-mapped file (/proc/self/maps; False where that cannot be read): a
    weight transformers read from safetensors with mmap. Moving such a weight frees nothing while any other tensor
    keeps the file mapped (its pages stay resident, as page cache), so a copy would add its size to the process."""
    address = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(part, 16) for part in fields[0].split("-"))
                if start <= address < end:
                    return len(fields) >= 6 and fields[5].startswith("/")
    except (OSError, ValueError):
        return False
    return False


def on_huge_pages(tensor: torch.Tensor, unless_file_mapped: bool = False) -> torch.Tensor:
    """`tensor` copied onto transparent huge pages (the process's arena), or `tensor` itself where that does not
    apply (see the module's docstring) or it lies there already: a weight moved once is never copied again (the
    fused decoder and the re-laid linears may both take the same module's rows). With `unless_file_mapped`, a tensor
    in a memory-mapped file stays too (`in_file_mapping`: for a weight the caller does not copy anyway)."""
    if (tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < MIN_BYTES
            or not huge_pages_available() or _ARENA.holds(tensor)
            or (unless_file_mapped and in_file_mapping(tensor))):
        return tensor
    return _ARENA.copy(tensor.detach())
