"""This CPU's feature flags, and the cap `DECODEKIT_CPU_ISA` puts on them.

decodekit chooses its CPU code paths at run time from the flags /proc/cpuinfo lists: the native kernels are compiled
for them (`execution.kernels.native`), `dtype=auto` and the batched bf16 products follow AVX512-BF16 or AMX, and the
packed float32 products size their panels by the vector width. `DECODEKIT_CPU_ISA=avx2` (or `portable`) makes an
AVX-512 machine take the paths an AVX2-only (or a plain x86-64) CPU takes: the flags above the cap are hidden, the
kernels are compiled without them, and torch and oneDNN are capped too (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`, set by `cap_torch_isa` when `decodekit` is imported before torch). That is how the AVX2 path is
tested and measured on a machine that has more; a real AVX2-only CPU still differs in its caches and clocks.

Only the standard library is imported here, so every layer (and the command line before torch) can ask.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

CPU_ISA_VARIABLE = "DECODEKIT_CPU_ISA"

CPU_ISA_CAPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None, str | None]] = {
    "native": ((), (), None, None),
    "avx2": (("avx512", "amx"), ("-mno-avx512f", "-mno-amx-tile"), "avx2", "AVX2"),
    "portable": (("avx", "fma", "f16c", "amx"), ("-march=x86-64",), "default", "SSE41"),
}
"""cap -> (flag prefixes hidden, extra compiler flags for the native kernels, `ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`). `-mno-avx512f` turns off every AVX-512 subset (BF16 and VNNI included); the kernels use no
AVX-VNNI, so an AVX2 build here is the build an AVX2-only CPU gets."""


def cpu_isa_cap() -> str:
    """The cap asked for by `$DECODEKIT_CPU_ISA` (`native`, the default: no cap).

    Raises:
        ValueError: the variable names no known cap (the message lists them).
    """
    cap = os.environ.get(CPU_ISA_VARIABLE, "").strip().lower() or "native"
    if cap not in CPU_ISA_CAPS:
        raise ValueError(f"{CPU_ISA_VARIABLE}={cap!r}: the known caps are {', '.join(CPU_ISA_CAPS)}")
    return cap


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The value of /proc/cpuinfo's first `name` line (its first processor's), or "" where there is none."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(name)), "")


@functools.cache
def hardware_cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo lists (empty where there is none, or it has no x86 flags), whatever the cap."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's `vendor_id` (`AuthenticAMD`, `GenuineIntel`), or "" where there is none."""
    return _cpuinfo_field("vendor_id")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as decodekit's path choices see them: `hardware_cpu_flags` less those above
    `cpu_isa_cap()`."""
    hidden = CPU_ISA_CAPS[cpu_isa_cap()][0]
    return frozenset(flag for flag in hardware_cpu_flags() if not flag.startswith(hidden))


def kernel_compile_flags() -> tuple[str, ...]:
    """The compiler flags added after `-march=native` when the native kernels are built: the cap's, and where one
    vendor's cores measured a choice the other's did not, that choice (`-DDK_SPLAT_FROM_REGISTERS` on AMD: a GGUF
    block's fp16 scales widened and broadcast in registers, a Q4_1 one-row product 1.13-1.20x from memory on a
    Zen 5; Intel's keep the broadcast from memory, 1.07x there: `head_splat_avx512` in native/quant.c)."""
    vendor = ("-DDK_SPLAT_FROM_REGISTERS",) if cpu_vendor() == "AuthenticAMD" else ()
    return (*CPU_ISA_CAPS[cpu_isa_cap()][1], *vendor)


def cap_torch_isa() -> None:
    """Cap torch's and oneDNN's kernels to `cpu_isa_cap()` (a no-op uncapped).

    Their variables are read once, when torch is imported and when oneDNN runs its first product, so they are set
    here (unless the user set them) only while torch is not yet imported; child processes (the peers of `decodekit
    bench`) inherit them. Imported later, torch keeps its own dispatch, and a warning says so.
    """
    cap = cpu_isa_cap()
    _, _, aten, onednn = CPU_ISA_CAPS[cap]
    if aten is None or onednn is None:
        return
    if "torch" in sys.modules:
        import torch

        if torch.backends.cpu.get_cpu_capability().lower() not in (aten, "default"):
            warnings.warn(f"{CPU_ISA_VARIABLE}={cap}: torch was imported before decodekit, so its own kernels "
                          f"stay {torch.backends.cpu.get_cpu_capability()}; set ATEN_CPU_CAPABILITY={aten} and "
                          f"ONEDNN_MAX_CPU_ISA={onednn} too", stacklevel=2)
        return
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
