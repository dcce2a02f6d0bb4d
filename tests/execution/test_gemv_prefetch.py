"""The float32 product's software prefetch: chosen per machine by timing, cached, overridable, and never a value."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.execution.kernels import gemv_prefetch
from decodekit.execution.kernels.gemv_prefetch import GemvPrefetchChoice, apply_gemv_prefetch, choice_path
from decodekit.execution.kernels.native import load_kernels

kernels = load_kernels()
pytestmark = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")


@pytest.fixture(scope="module")
def native():
    """The loaded kernels, their prefetch setting restored after the module."""
    assert not isinstance(kernels, str)
    before = kernels.set_gemv_prefetch(None)
    kernels.set_gemv_prefetch(before)
    yield kernels
    kernels.set_gemv_prefetch(before)


@dataclasses.dataclass
class LibraryAt:
    """A stand-in for the loaded kernels with its library at a temporary path: the cache goes there."""

    real: object
    path: object
    gemv_prefetch: GemvPrefetchChoice | None = None

    def set_gemv_prefetch(self, floats):
        return self.real.set_gemv_prefetch(floats)

    def gemv(self, x, weight, bias=None, residual=None):
        return self.real.gemv(x, weight, bias, residual)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 8), width=st.sampled_from([8, 40, 576, 1536]), out=st.integers(1, 300),
       ahead=st.sampled_from([0, 16, 1024, 65536]), seed=st.integers(0, 2**16))
def test_the_gemv_prefetch_distance_changes_no_output_bit(native, rows, width, out, ahead, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, width, generator=g), torch.randn(out, width, generator=g)
    native.set_gemv_prefetch(None)
    default = native.gemv(x, weight)
    native.set_gemv_prefetch(ahead)
    assert torch.equal(native.gemv(x, weight), default)


def test_the_choice_is_measured_once_per_library_then_read_from_beside_it(native, tmp_path, monkeypatch):
    monkeypatch.delenv(gemv_prefetch.ENV, raising=False)
    timed = []
    real_measure = gemv_prefetch.measure_gemv_prefetch

    def counting(k, trials=gemv_prefetch.TRIALS):
        timed.append(k)
        return dataclasses.replace(real_measure(k, trials=2), decided=True)  # this machine's result, taken as clear

    monkeypatch.setattr(gemv_prefetch, "measure_gemv_prefetch", counting)
    library = LibraryAt(native, tmp_path / "lib.so")
    first = apply_gemv_prefetch(library)
    assert first.source == "measured" and first.floats in (None, 0) and len(timed) == 1
    assert first.with_prefetch_ms > 0 and first.without_ms > 0
    assert json.loads(choice_path(library).read_text())["floats"] == first.floats
    again = apply_gemv_prefetch(LibraryAt(native, tmp_path / "lib.so"))
    assert len(timed) == 1, "the cached choice is read, not timed again"
    assert (again.source, again.floats) == ("cached", first.floats)
    native.set_gemv_prefetch(None)


def test_the_prefetch_goes_off_only_where_its_absence_is_clearly_faster(native, monkeypatch):
    clock = iter(range(10**6))
    pace = {None: 100, 0: 98}  # ms a product: 2% faster without, inside the margin

    def fake_gemv(x, weight, bias=None, residual=None):
        step = pace[current[0]]
        for _ in range(step):
            next(clock)
        return x

    current = [None]
    library = LibraryAt(native, "unused")
    monkeypatch.setattr(library, "gemv", fake_gemv)
    monkeypatch.setattr(library, "set_gemv_prefetch", lambda floats: current.__setitem__(0, floats) or 0)
    monkeypatch.setattr(gemv_prefetch.time, "perf_counter", lambda: next(clock) / 1000)
    close = gemv_prefetch.measure_gemv_prefetch(library, trials=3)
    assert close.floats is None and not close.decided
    pace[0] = 80  # 20% faster without
    clear = gemv_prefetch.measure_gemv_prefetch(library, trials=3)
    assert clear.floats == 0 and clear.decided
    pace[0] = 125  # 20% slower without
    kept = gemv_prefetch.measure_gemv_prefetch(library, trials=3)
    assert kept.floats is None and kept.decided


def test_a_measurement_too_close_to_call_is_not_cached_and_is_taken_again_next_time(native, tmp_path, monkeypatch):
    monkeypatch.delenv(gemv_prefetch.ENV, raising=False)
    results = iter([GemvPrefetchChoice(None, 16.0, 15.99, decided=False), GemvPrefetchChoice(0, 6.5, 5.9)])
    timed = []

    def measure(k, trials=gemv_prefetch.TRIALS):
        timed.append(k)
        return next(results)

    monkeypatch.setattr(gemv_prefetch, "measure_gemv_prefetch", measure)
    first = apply_gemv_prefetch(LibraryAt(native, tmp_path / "lib.so"))
    assert first.floats is None and not choice_path(LibraryAt(native, tmp_path / "lib.so")).exists()
    second = apply_gemv_prefetch(LibraryAt(native, tmp_path / "lib.so"))
    assert len(timed) == 2 and (second.source, second.floats) == ("measured", 0)
    assert json.loads(choice_path(LibraryAt(native, tmp_path / "lib.so")).read_text()) == {
        "floats": 0, "with_prefetch_ms": 6.5, "without_ms": 5.9}
    native.set_gemv_prefetch(None)


@pytest.mark.parametrize(("setting", "floats"), [("off", 0), ("0", 0), ("on", None), ("2048", 2048),
                                                 ("sideways", None)])
def test_DECODEKIT_GEMV_PREFETCH_overrides_the_measurement_and_a_bad_value_keeps_the_default(
        native, tmp_path, monkeypatch, setting, floats):
    monkeypatch.setenv(gemv_prefetch.ENV, setting)
    monkeypatch.setattr(gemv_prefetch, "measure_gemv_prefetch", lambda *a, **k: pytest.fail("timed despite the env"))
    choice = apply_gemv_prefetch(LibraryAt(native, tmp_path / "lib.so"))
    assert (choice.floats, choice.source) == (floats, gemv_prefetch.ENV)
    assert native.set_gemv_prefetch(None) == (1024 if floats is None else floats)
    assert not choice_path(LibraryAt(native, tmp_path / "lib.so")).exists(), "an override is not cached"


def test_a_garbled_cache_is_measured_over(native, tmp_path, monkeypatch):
    monkeypatch.delenv(gemv_prefetch.ENV, raising=False)
    library = LibraryAt(native, tmp_path / "lib.so")
    choice_path(library).write_text('{"floats": "fast"')
    monkeypatch.setattr(gemv_prefetch, "measure_gemv_prefetch", lambda k: GemvPrefetchChoice(0, 2.0, 1.0))
    assert apply_gemv_prefetch(library).floats == 0
    assert json.loads(choice_path(library).read_text()) == {"floats": 0, "with_prefetch_ms": 2.0, "without_ms": 1.0}


def test_a_failed_timing_keeps_the_default_prefetch_and_caches_nothing(native, tmp_path, monkeypatch):
    monkeypatch.delenv(gemv_prefetch.ENV, raising=False)

    def out_of_memory(k):
        raise MemoryError("no 100 MB to spare")

    monkeypatch.setattr(gemv_prefetch, "measure_gemv_prefetch", out_of_memory)
    library = LibraryAt(native, tmp_path / "lib.so")
    choice = apply_gemv_prefetch(library)
    assert (choice.floats, choice.source) == (None, "default")
    assert native.set_gemv_prefetch(None) == 1024 and not choice_path(library).exists()
