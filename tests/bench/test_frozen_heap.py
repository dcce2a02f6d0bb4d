"""`frozen_heap`, around `decodekit bench`'s timed rounds: the heap frozen out of the collector for the block and
given back after, left alone where something froze it before or `DECODEKIT_GC_FREEZE=0` says no."""

from __future__ import annotations

import gc
import weakref

import pytest

from decodekit.api.startup_heap import frozen_heap


class _Cycle:
    """One half of a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.other: _Cycle | None = None


def _garbage_cycle() -> weakref.ref:
    """Make a cycle, drop it, and return a weak reference to one half (alive until a collection)."""
    a, b = _Cycle(), _Cycle()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def freezing(monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv("DECODEKIT_GC_FREEZE", "1")
    yield
    gc.unfreeze()


def test_a_frozen_block_skips_old_objects_and_gives_them_back_after(freezing):
    """Inside, a collection no longer frees a cycle that was alive before the block (it is frozen); after the
    block the next collection frees it, so nothing frozen is kept for good."""
    holder = [_Cycle()]
    holder[0].other = holder[0]
    alive = weakref.ref(holder[0])
    with frozen_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        holder.clear()
        gc.collect()
        assert alive() is not None, "a frozen cycle is not collected"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_new_garbage_inside_the_block_is_still_collected(freezing):
    with frozen_heap():
        alive = _garbage_cycle()
        gc.collect()
        assert alive() is None


def test_a_heap_frozen_before_stays_frozen_and_the_variable_turns_freezing_off(freezing, monkeypatch):
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_heap() as frozen:
        assert frozen == 0
    # undone, the count would be 0; frozen objects whose last reference goes meanwhile (other threads, the
    # interpreter's own caches) lower it by a few, so equality would be flaky
    assert gc.get_freeze_count() > before // 2, "someone else's freeze is not undone"
    gc.unfreeze()
    monkeypatch.setenv("DECODEKIT_GC_FREEZE", "off")
    with frozen_heap() as frozen:
        assert frozen == 0 and gc.get_freeze_count() == 0
