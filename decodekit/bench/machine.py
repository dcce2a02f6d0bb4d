"""The machine a benchmark ran on, recorded with every `decodekit bench` result: the CPU and the vector extensions
its figures depend on, the dtype actually used, the torch threads, the library versions and the commit.

`machine_line` turns that into the one line each table prints under it (and its JSON carries as `machine`), so
a figure is never separated from the kind of machine that made it: an AVX2-only CPU and an AVX-512 BF16/AMX one
run the same figures at different speeds, and run bfloat16 natively only on the second.
"""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from decodekit.api.cpu import cpu_flags, cpu_isa_cap, hardware_cpu_flags

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
"""The /proc/cpuinfo flags that matter for these figures: fp32 vector width and fused multiply-add (avx2, fma,
avx512f), native bf16 and int8 dot products (avx512_bf16, avx512_vnni), and the AMX tile units (amx_bf16,
amx_tile). (`dtype=auto` is bfloat16 on a CPU with avx512_bf16 or amx_bf16, float32 elsewhere; bfloat16 runs
natively only with avx512_bf16 or amx_bf16.)"""


def cpu_description() -> dict[str, Any]:
    """The CPU's model name, which of `CPU_FLAGS` it has (`cpu_flags`) and which it lacks (`cpu_flags_absent`), as
    decodekit's paths see them: under `DECODEKIT_CPU_ISA` the hardware's flags above the cap count as absent, and
    `cpu_isa_cap` and `cpu_flags_hidden` say so.

    Read from /proc/cpuinfo; elsewhere the name is `platform.processor()` and both flag lists are empty.
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.processor() or None, "cpu_flags": [], "cpu_flags_absent": []}
    lines = info.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    flags = cpu_flags()
    if not flags:  # not an x86 /proc/cpuinfo (an ARM one says "Features"): nothing to say about these flags
        return {"cpu": name or platform.processor() or None, "cpu_flags": [], "cpu_flags_absent": []}
    description: dict[str, Any] = {"cpu": name, "cpu_flags": [f for f in CPU_FLAGS if f in flags],
                                   "cpu_flags_absent": [f for f in CPU_FLAGS if f not in flags]}
    if cpu_isa_cap() != "native":  # the flags above are the capped ones: say which the hardware has beyond them
        hidden = hardware_cpu_flags() - flags
        description["cpu_isa_cap"] = cpu_isa_cap()
        description["cpu_flags_hidden"] = [f for f in CPU_FLAGS if f in hidden]
    return description


def read_bandwidth() -> float:
    """Bytes per second a `torch.sum` over 512 MB reads on torch's threads (median of 5): the memory bound the
    bandwidth benchmarks (`benchmarks/attention_bound.py`, `benchmarks/quant_products.py`) set their rates against."""
    import statistics
    import time

    import torch

    data = torch.ones(128 << 20)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def git_commit() -> str | None:
    """`git describe --always --dirty` of the checkout this code runs from (None outside one)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=os.path.dirname(__file__),
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """The code, the machine and the settings as a run starts: versions, torch's threads (`torch_threads`) and
    the CPU kernels it dispatches to (`torch_cpu_capability`), the CPU (`cpu_description`), a GPU if torch sees
    one, the commit and the date (UTC)."""
    import torch
    import transformers

    env: dict[str, Any] = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "machine": platform.machine(), **cpu_description(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "git_commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def machine_line(env: dict[str, Any], dtype: str | None = None, *, device: str | None = None,
                 dtype_requested: str | None = None, threads: Any = None) -> str:
    """One line saying what a result was measured on, e.g.

    `AMD EPYC, 2 cores (avx2 fma; no avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile; torch kernels AVX2) |
    dtype float32 (asked auto) | 1 torch thread | torch 2.13.0, transformers 5.23.0 | commit 2e15561`

    Args:
        env: what `environment()` returned (missing keys are left out of the line).
        dtype: the dtype actually used (after `auto` is resolved); several, comma-separated, for a matrix.
        device: the device the model ran on ("cpu", "cuda:0"); a GPU's name is added for a CUDA device.
        dtype_requested: what was asked for, shown when it differs (`auto`).
        threads: the torch threads to show, when not `env["torch_threads"]` (a server's, say).

    `env["peers"]` (peer name -> its version and thread binding), when present, ends the line.
    """
    cpu = env.get("cpu") or "unknown CPU"
    if env.get("cpu_count"):
        cpu += f", {env['cpu_count']} cores"
    detail = []
    if env.get("cpu_flags"):
        detail.append(" ".join(env["cpu_flags"]))
    if env.get("cpu_flags_absent"):
        detail.append("no " + " ".join(env["cpu_flags_absent"]))
    if env.get("torch_cpu_capability"):
        detail.append(f"torch kernels {env['torch_cpu_capability']}")
    if env.get("cpu_isa_cap"):
        detail.append(f"capped to {env['cpu_isa_cap']} by DECODEKIT_CPU_ISA, hiding "
                      f"{' '.join(env.get('cpu_flags_hidden') or []) or 'nothing listed'}")
    parts = [cpu + (f" ({'; '.join(detail)})" if detail else "")]
    if device and device.startswith("cuda") and env.get("gpu"):
        parts.append(f"GPU {env['gpu']}")
    if dtype:
        asked = f" (asked {dtype_requested})" if dtype_requested and dtype_requested != dtype else ""
        parts.append(f"dtype {dtype}{asked}")
    count = env.get("torch_threads") if threads is None else threads
    if isinstance(count, int):
        parts.append(f"{count} torch thread{'' if count == 1 else 's'}")
    elif count is not None:
        parts.append(f"torch threads: {count}")
    versions = ", ".join(f"{lib} {env[lib]}" for lib in ("torch", "transformers") if env.get(lib))
    if versions:
        parts.append(versions)
    if env.get("git_commit"):
        parts.append(f"commit {env['git_commit']}")
    if env.get("peers"):  # each peer's version and thread binding (`decodekit bench --peer`)
        parts.append("peers: " + "; ".join(f"{name} ({text})" for name, text in env["peers"].items()))
    return " | ".join(parts)


__all__ = ["CPU_FLAGS", "cpu_description", "environment", "git_commit", "machine_line"]
