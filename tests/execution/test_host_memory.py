"""The engine's allocator settings: a step's large tensors, freed, are reused without new page faults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# Each run is a fresh process: the settings are process-wide and permanent once made.
_PROBE = """
import json, resource, torch
from decodekit.execution.host_memory import retain_freed_memory
applied = retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step(k):
    # a step's large activations, sized by its rows (steps differ), freed at its end
    rows = (960, 512, 768, 256)[k % 4]
    held = [torch.ones(rows, n) for n in (3072, 1536, 2304, 576)]
    del held
first = faults(); step(0); first = faults() - first
for k in range(1, 8):
    step(k)
again = faults()
for k in range(8):
    step(k)
print(json.dumps({"applied": applied, "first": first, "again": faults() - again}))
"""


def _probe(env: dict[str, str]) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


_GLIBC = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@_GLIBC
def test_later_steps_reuse_freed_memory_without_page_faults() -> None:
    result = _probe({"DECODEKIT_RETAIN_FREED_MEMORY": "1"})
    assert result["applied"]
    # the first step touches ~28 MB of new pages (~7,000 faults); eight more steps of the same sizes reuse them
    assert result["first"] > 5000
    assert result["again"] < result["first"] // 10


def test_the_environment_can_keep_the_c_librarys_defaults() -> None:
    # (whether glibc's own thresholds then fault a step's tensors in anew depends on the order of its frees and
    # trims: measured in a prefill step, not asserted here)
    assert not _probe({"DECODEKIT_RETAIN_FREED_MEMORY": "0"})["applied"]
