"""How the GPU layer's kernels are launched (`gpu_layer._launch`): programmatic dependent launches where the device
takes them, and a plain launch for good once one fails. Runs without a GPU or Triton (a stand-in kernel)."""

from __future__ import annotations

import logging

import pytest
import torch

from decodekit.execution.kernels import gpu_layer


class _Kernel:
    """Records each launch's grid and keywords, like `kernel[grid](*args, **kwargs)`; refuses `launch_pdl` if
    told to, as an older driver or Triton would."""

    def __init__(self, refuse_pdl: bool) -> None:
        self.refuse_pdl = refuse_pdl
        self.launches: list[tuple[tuple[int, ...], dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs.get("launch_pdl") and self.refuse_pdl:
                raise RuntimeError("launch_pdl is not a valid option")
            self.launches.append((grid, kwargs))
        return launch


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(gpu_layer, "_pdl_failed", False)
    monkeypatch.setattr(gpu_layer, "_capability", lambda device: (9, 0))


def test_a_hopper_launch_is_programmatic_and_the_kernel_told_so(hopper):
    kernel = _Kernel(refuse_pdl=False)
    gpu_layer._launch(kernel, (3,), torch.device("cuda"), 1, 2, ROWS=1)
    assert kernel.launches == [((3,), {"ROWS": 1, "PDL": True, "launch_pdl": True})]


def test_a_cpu_an_older_gpu_or_the_switch_off_launch_plainly(hopper, monkeypatch):
    kernel = _Kernel(refuse_pdl=False)
    gpu_layer._launch(kernel, (1,), torch.device("cpu"), ROWS=1)  # Triton's interpreter
    monkeypatch.setattr(gpu_layer, "_capability", lambda device: (8, 0))
    gpu_layer._launch(kernel, (1,), torch.device("cuda"), ROWS=1)
    monkeypatch.setattr(gpu_layer, "_capability", lambda device: (9, 0))
    monkeypatch.setenv("DECODEKIT_GPU_PDL", "0")
    gpu_layer._launch(kernel, (1,), torch.device("cuda"), ROWS=1)
    assert [kwargs for _, kwargs in kernel.launches] == [{"ROWS": 1, "PDL": False}] * 3


def test_a_refused_programmatic_launch_runs_plainly_and_turns_them_off_for_good(hopper, caplog):
    kernel = _Kernel(refuse_pdl=True)
    with caplog.at_level(logging.WARNING):
        gpu_layer._launch(kernel, (2,), torch.device("cuda"), ROWS=1)
    assert kernel.launches == [((2,), {"ROWS": 1, "PDL": False})]  # the step still ran its kernel
    assert "programmatic dependent launches failed" in caplog.text
    assert not gpu_layer.programmatic_launches(torch.device("cuda"))
    gpu_layer._launch(kernel, (2,), torch.device("cuda"), ROWS=1)
    assert len(kernel.launches) == 2
