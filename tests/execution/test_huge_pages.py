"""Weights on transparent huge pages: the same values, in memory advised MADV_HUGEPAGE (a fused model on them:
`test_fused_decoder.test_fusing_keeps_every_weight_value_and_stores_none_twice`)."""

from __future__ import annotations

import ctypes
import gc
import itertools

import pytest
import torch

from decodekit.api import huge_pages
from decodekit.api.huge_pages import ALIGN, HugePageArena, huge_pages_available, in_file_mapping, on_huge_pages
from tests.helpers.memory_maps import vm_flags

needs_huge_pages = pytest.mark.skipif(not huge_pages_available(),
                                      reason="no transparent huge pages to ask for here (not Linux, or `never`)")


@needs_huge_pages
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int8])
def test_a_copy_has_the_same_values_and_lies_in_memory_advised_onto_huge_pages(dtype):
    source = (torch.randn(512, 768) * 100).to(dtype)
    moved = on_huge_pages(source)
    assert moved is not source and moved.dtype == dtype and moved.shape == source.shape and moved.is_contiguous()
    assert torch.equal(moved, source)
    assert moved.data_ptr() % ALIGN == 0
    assert "hg" in vm_flags(moved.data_ptr()), "the mapping is not advised MADV_HUGEPAGE"
    assert on_huge_pages(moved) is moved, "moved twice"
    assert on_huge_pages(moved[7:]).data_ptr() == moved[7:].data_ptr(), "a view of a moved tensor moved again"


def test_small_tensors_and_a_turned_off_setting_keep_the_tensor_itself(monkeypatch):
    small = torch.randn(64, 64)
    assert on_huge_pages(small) is small
    monkeypatch.setenv("DECODEKIT_HUGE_PAGES", "0")
    huge_pages.huge_pages_available.cache_clear()
    try:
        large = torch.randn(512, 512)
        assert on_huge_pages(large) is large
    finally:
        monkeypatch.undo()
        huge_pages.huge_pages_available.cache_clear()


@needs_huge_pages
def test_the_arena_hands_out_disjoint_page_aligned_tensors_and_maps_a_larger_one_whole():
    arena = HugePageArena(chunk_bytes=8 * 2**20)
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([1000, 300_000, 5, 1_500_000, 3_000_000])]
    copies = [arena.copy(t) for t in tensors]  # the last two are past the chunk's room, the last past a chunk
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.data_ptr() % ALIGN == 0
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), "two tensors overlap"
    del arena  # the tensors keep their chunks alive
    assert [float(c[0]) for c in copies] == [float(i) for i in range(len(copies))]


@needs_huge_pages
def test_a_tensor_in_a_memory_mapped_file_stays_there_when_asked(tmp_path):
    path = tmp_path / "weights.bin"
    torch.randn(512, 512).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=True, size=512 * 512).view(512, 512)
    assert in_file_mapping(mapped) and not in_file_mapping(torch.randn(512, 512))
    assert on_huge_pages(mapped, unless_file_mapped=True) is mapped
    moved = on_huge_pages(mapped)
    assert moved is not mapped and torch.equal(moved, mapped)


@needs_huge_pages
def test_a_chunk_unmapped_with_its_last_tensor_is_forgotten_so_a_later_mapping_there_is_not_taken_for_the_arena():
    arena = HugePageArena(chunk_bytes=2**20)
    first = arena.copy(torch.randn(200_000))
    address = first.data_ptr()
    # larger than a whole chunk (its 1 MiB and the 2 MiB kept to align its start): the arena maps a second chunk
    kept = arena.copy(torch.randn(800_000))
    assert arena.holds_address(address) and arena.holds(kept)
    del first  # the first chunk's last tensor: the chunk is unmapped, and its addresses are free for any mapping
    assert not arena.holds_address(address), "an unmapped chunk's addresses still count as the arena's"
    assert arena.holds(kept)


@needs_huge_pages
def test_a_dead_tensors_pages_go_back_to_the_kernel_and_a_live_neighbours_and_views_keep_theirs():
    arena = HugePageArena(chunk_bytes=8 * 2**20)
    dropped = arena.copy(torch.full((300_000,), 7.0))
    neighbour = arena.copy(torch.full((300_000,), 3.0))
    viewed = arena.copy(torch.full((300_000,), 5.0))
    assert arena._chunk is not None
    chunk = arena._chunk  # the mapping all three lie in
    base = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
    at = dropped.data_ptr() - base
    tail = viewed[1000:]  # a view keeps its tensor's pages even after the tensor itself is gone
    del dropped, viewed
    gc.collect()
    assert chunk[at:at + 8] == bytes(8), "the dead tensor's pages were not given back (read again: zeros)"
    assert bool((neighbour == 3.0).all()) and bool((tail == 5.0).all())
