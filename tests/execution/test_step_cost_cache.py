"""The cached step-cost curve (`execution.step_cost`) is valid only for what it was measured with: a curve measured
with other native kernels (an upgrade, an edited kernel source) is not reused, and a curve is measured once and then
read back."""

from __future__ import annotations

from pathlib import Path

import pytest

import decodekit.execution.step_cost as step_cost
from decodekit import LLM
from decodekit.execution import cached_step_cost
from decodekit.models.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def executor():
    return LLM(tiny_model(), tiny_tokenizer(), device="cpu").engine.model


class _OtherKernels:
    """Stands for a kernel library built from another source: only its file name differs."""

    path = Path("/nowhere/decodekit_kernels_0123456789abcdef.so")


def test_a_curve_measured_with_other_native_kernels_is_not_the_one_looked_up(executor, monkeypatch):
    mine = step_cost.cache_key(executor, "target")
    monkeypatch.setattr(step_cost, "load_kernels", lambda: _OtherKernels())
    assert step_cost.cache_key(executor, "target") != mine
    monkeypatch.setattr(step_cost, "load_kernels", lambda: "the native kernels are off (DECODEKIT_NATIVE_KERNELS=0)")
    assert step_cost.cache_key(executor, "target") not in (mine, step_cost.cache_key(executor, "draft"))


def test_a_curve_is_measured_once_then_read_back(executor, monkeypatch, tmp_path):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    measured = []
    real = step_cost.measure_step_cost
    monkeypatch.setattr(step_cost, "measure_step_cost", lambda ex: measured.append(1) or real(ex))
    first = cached_step_cost(executor, "target")
    second = cached_step_cost(executor, "target")
    assert first is not None and second == first and measured == [1]
    assert len(list((tmp_path / "step_cost").glob("*.json"))) == 1
