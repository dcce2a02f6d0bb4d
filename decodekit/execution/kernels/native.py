"""Native CPU kernels for the fused decoder's small float32 ops and its int8- and bf16-weight products, compiled at
first use and loaded with ctypes.

`load_kernels()` returns the loaded `NativeKernels`, or the reason they cannot run (no C compiler, a failed build,
or `DECODEKIT_NATIVE_KERNELS=0`); callers then keep their torch ops. The shared library is cached under
`$DECODEKIT_CACHE/native` (default `~/.cache/decodekit/native`, beside the converted models), keyed by the source,
the compiler command and this CPU's model and flags, because it is built with `-march=native`. The key is
predictable and loading a library runs its constructors, so the cache is trusted only as far as it is private: the
folder is kept 0700, and a cached library is loaded only if it and its `.sha256` sidecar (the hash recorded when it
was built) are regular files owned by this user that nobody else can write, and its content still has that hash.
Anything else is rebuilt over; a folder that cannot be made private is not used at all.

The kernels (see `native/kernels.c`) do RMSNorm, SiLU-gating, and RoPE + KV write + attention for the sequences
of a step that score a few tokens each (long prefill chunks are rotated and stored, and attended by the caller),
the products of int8 and bf16 weights (`quantization: int8 | bf16`), packed in panels of 16 output rows
(`pack_int8_panels`, `pack_bf16_panels`), and (`native/quant.c`, bound in `kernels.quant`) the products of GGUF
quantized weights as the file stores them.
They take raw pointers: every tensor passed must be float32 (int64 for the index arrays, int8 or bf16 for packed
weights), contiguous, and on the CPU. The wrappers below make inputs contiguous and check the attention's and the
panels' shapes; dtype and device are checked once, when the fused decoder is built with them (`FusedDecoder`,
`execution.plan`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from decodekit.api.cpu import kernel_compile_flags
from decodekit.api.sampling import DrawRule
from decodekit.execution.attention.kv_cache import BATCHED_MAX_QUERY
from decodekit.execution.kernels.gemv_prefetch import GemvPrefetchChoice, apply_gemv_prefetch
from decodekit.execution.kernels.quant import QuantKernels
from decodekit.models.loader import cache_dir

SOURCE = Path(__file__).with_name("native") / "kernels.c"
# The library's sources: the small ops, attention, float/bf16/int8 products; the GGUF quantized products
# (`kernels.quant` binds those); the fused decoder's layer stack in one call (`fused.layer_stack` describes it).
SOURCES: tuple[Path, ...] = (SOURCE, SOURCE.with_name("quant.c"), SOURCE.with_name("layers.c"),
                             SOURCE.with_name("draws.c"))
# -ffp-contract=off: no fused multiply-adds, so elementwise math rounds exactly as torch's does (RoPE stays
# bit-identical to transformers); -march=native: the library is built on, and cached for, this CPU only.
# `DECODEKIT_CPU_ISA` appends its flags (`api.cpu.kernel_compile_flags`: an AVX2 build on an AVX-512 CPU), and so
# does a CPU vendor whose cores measured a choice of their own.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
# OpenMP when the compiler has it: the library then links libgomp.so.1, which resolves to the copy torch has
# already loaded, so attention runs on torch's own thread pool (no second pool spinning against it: a pool of
# Python threads calling the kernel measured slower than one thread) and follows `torch.set_num_threads`.
# Without it the same source builds serial.
OPENMP_FLAGS = ["-fopenmp"]
SERIAL_FLAGS = ["-Wno-unknown-pragmas"]
# A layer's attention is split over threads from this many keys read (summed over query tokens and kv heads): below
# it a layer's attention takes a few tens of microseconds and the fork and join (a few each, on torch's hot pool)
# are a visible share. On SmolLM2, 2 cores, splitting measured no slower from 300 keys up (batch 1 to 8, within the
# noise) and 1.5-2x faster attention at batch 16, context 250 (docs/history/benchmarks-2026-11.md, "Serving").
PARALLEL_MIN_KEYS = 512
# Seconds a build of the library may take, its sources compiled in parallel (quant.c, the longest, 38.5 s on a 2-core
# Zen 3: 126 s before each weight type's tiles were instantiated once a path, past the 120 s limit then; a hung
# compiler must not hang the engine's start for ever).
BUILD_TIMEOUT_S = 600
# SiLU-gating of more rows than this stays in torch. Set when the native gating was a scalar `expf` per element;
# it now takes 8 at a time (exp8) and splits rows over threads from 64K elements, so the limit is due a re-measure.
NATIVE_GATING_MAX_ROWS = 64
# The parts of a step the layer stack times (`NativeKernels.stack_seconds`), in layers.c's DK_TIME_* order.
STACK_PARTS = ("products", "attention", "norms", "gating", "run")
# The KV pool elements the native attention reads and writes (`kv_cache_dtype`).
KV_DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger("decodekit.runner")

# The entry points `NativeKernels` binds; all are looked up when a library is loaded, so one lacking any is refused
# there (a reason for the torch fallback) rather than failing later.
SYMBOLS = ("dk_rms_norm", "dk_silu_mul", "dk_rope_cache_attend", "dk_parallel", "dk_tiled_attention",
           "dk_dot_attention", "dk_linear_i8", "dk_linear_bf16", "dk_gemv", "dk_rms_norm_bf16", "dk_silu_mul_bf16",
           "dk_widen_add", "dk_quant_linear", "dk_quant_dequantize", "dk_quant_isa", "dk_layer_stack",
           "dk_stack_timing", "dk_stack_product_seconds", "dk_stack_seconds", "dk_decode_run", "dk_quant_gated",
           "dk_gemv_set_prefetch", "dk_gemv_max_rows", "dk_draw_row")

_p = ctypes.c_void_p
_i = ctypes.c_int64
_f = ctypes.c_float


def _cpu_identity() -> str:
    """This CPU's model name and feature flags (the library is compiled for exactly them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def compile_flags() -> list[str]:
    """The flags the library is built with: `CFLAGS`, then the cap's (`DECODEKIT_CPU_ISA`)."""
    return [*CFLAGS, *kernel_compile_flags()]


def find_compiler() -> str | None:
    """The C compiler to build with: `$CC`, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def library_path(compiler: str) -> Path:
    """Where the library built by `compiler` for this source and CPU is cached (its hash sits at `<path>.sha256`)."""
    source = b"".join(path.read_bytes() for path in SOURCES)
    flags = [compiler, *compile_flags(), *OPENMP_FLAGS, *SERIAL_FLAGS]
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_identity().encode()).hexdigest()
    return cache_dir() / "native" / f"decodekit_kernels_{key[:16]}.so"


def _mine_and_unwritable(info: os.stat_result) -> bool:
    """Owned by this user and writable by nobody else: only this user can have put (or can swap) its content."""
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir(folder: Path) -> None:
    """Create `folder` 0700, or tighten it to 0700 if this user owns it.

    Raises:
        RuntimeError: it is not a directory, or someone else owns or can write it (anyone could plant a library).
    """
    os.makedirs(folder, mode=0o700, exist_ok=True)  # the mode applies to a new folder only, under the umask
    info = os.stat(folder)
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o700:
        with contextlib.suppress(OSError):  # if it stays loose, it is refused below
            os.chmod(folder, 0o700)
        info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode) or not _mine_and_unwritable(info):
        raise RuntimeError(f"refusing the kernel cache {folder}: it is not a directory of yours that only you can "
                           "write, so a library in it could have been planted")


def _sha256(path: Path | str) -> str:
    """The hex SHA-256 of the file at `path` (a library is tens of kilobytes: read whole)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _distrust(target: Path) -> str | None:
    """Why the cached `target` must not be loaded, or None when it may be."""
    sidecar = Path(f"{target}.sha256")
    try:
        for path in (target, sidecar):
            info = os.lstat(path)  # lstat: a symlink is not trusted, whatever it points to
            if not stat.S_ISREG(info.st_mode) or not _mine_and_unwritable(info):
                return f"{path.name} is not a regular file of yours that only you can write"
        if sidecar.read_bytes().strip() != _sha256(target).encode():
            return f"{target.name} does not have the SHA-256 recorded when it was built"
    except OSError as error:  # missing or unreadable: rebuilding replaces it
        return f"{Path(str(error.filename)).name} cannot be checked ({error.strerror})"
    return None


def _compile_library(compiler: str, extra: list[str], output: str) -> str | None:
    """Compile every source to an object at once (one compiler a source, in parallel), then link them into `output`.

    In parallel, because quant.c takes most of a minute at -O3 on a 2-core machine (its tiles for every block
    format on each path) and the others a few seconds: the build takes about as long as quant.c alone.

    Returns:
        None when the library was built, else the failing compiler's error output.

    Raises:
        subprocess.TimeoutExpired: the build ran past BUILD_TIMEOUT_S (the compilers still running are killed).
    """
    flags = [flag for flag in compile_flags() if flag != "-shared"]
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(dir=Path(output).parent) as work:
        objects = [str(Path(work) / f"{source.stem}.o") for source in SOURCES]
        compiles = [subprocess.Popen([compiler, *flags, *extra, "-c", "-o", obj, str(source)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True) for obj, source in zip(objects, SOURCES)]
        try:
            outputs = [proc.communicate(timeout=max(deadline - time.monotonic(), 0))[0] for proc in compiles]
        finally:
            for proc in compiles:  # a timeout leaves the others running
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        failed = [out for proc, out in zip(compiles, outputs) if proc.returncode != 0]
        if failed:
            return "\n".join(failed)
        link = subprocess.run([compiler, *compile_flags(), *extra, "-o", output, *objects, "-lm"],
                              capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 1))
        return None if link.returncode == 0 else link.stderr


def build_library(compiler: str) -> Path:
    """Compile the sources for this CPU (or reuse a trusted cached build) and return the library's path.

    Raises:
        RuntimeError: the cache folder is not private, or the compiler failed (its output is in the message).
    """
    target = library_path(compiler)
    _private_dir(target.parent)
    distrust = _distrust(target)
    if distrust is None:
        return target
    if os.path.lexists(target):
        log.warning("rebuilding the cached native kernels: %s", distrust)
    # Build beside the target and rename, the hash sidecar likewise: concurrent processes (pytest workers, a server
    # and a CLI) never load a half-written library, and at worst see a library and hash that disagree and rebuild.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, partial_hash = tempfile.mkstemp(suffix=".sha256", dir=target.parent)  # mkstemp makes it 0600
    os.close(fd)
    try:
        failure = _compile_library(compiler, OPENMP_FLAGS, partial)
        if failure is not None:  # no OpenMP with this compiler: the serial build
            log.info("native kernels built without OpenMP (%s): attention runs on one thread",
                     failure.strip().splitlines()[-1:] or failure)
            failure = _compile_library(compiler, SERIAL_FLAGS, partial)
        if failure is not None:
            names = ", ".join(path.name for path in SOURCES)
            raise RuntimeError(f"{compiler} failed to build {names}:\n{failure.strip()}")
        os.chmod(partial, 0o700)  # the linker created it anew, under the umask
        Path(partial_hash).write_text(_sha256(partial) + "\n")
        os.replace(partial, target)
        os.replace(partial_hash, f"{target}.sha256")
    finally:
        for path in (partial, partial_hash):
            if os.path.exists(path):
                os.unlink(path)
    return target


class DrawRuleFields(ctypes.Structure):
    """`dk_draw_rule` (draws.c): how a run draws its tokens (`DrawRule`; temperature 0: the argmax)."""

    _fields_ = [("temperature", _f), ("top_k", _i), ("top_p", _f), ("min_p", _f)]

    def set(self, rule: DrawRule | None) -> None:
        """Take `rule`'s values (None: each token the argmax)."""
        self.temperature = 0.0 if rule is None else rule.temperature
        self.top_k = 0 if rule is None else rule.top_k
        self.top_p = 1.0 if rule is None else rule.top_p
        self.min_p = 0.0 if rule is None else rule.min_p


class NativeKernels:
    """The loaded kernels, with thin typed wrappers over their C entry points."""

    def __init__(self, path: Path) -> None:
        """Load the library at `path` and bind every entry point now.

        Raises:
            OSError: it cannot be loaded.
            RuntimeError: it lacks one of `SYMBOLS` (ctypes' AttributeError would otherwise escape `LLM()`).
        """
        lib = ctypes.CDLL(str(path))
        self.path = path
        missing = [name for name in SYMBOLS if not hasattr(lib, name)]
        if missing:
            raise RuntimeError(f"{path.name} lacks the kernel entry points {', '.join(missing)}")
        self._rms_norm = lib.dk_rms_norm
        self._rms_norm.argtypes = [_p, _p, _p, _i, _i, _f]
        self._rms_norm.restype = None
        self._silu_mul = lib.dk_silu_mul
        self._silu_mul.argtypes = [_p, _p, _i, _i]
        self._silu_mul.restype = None
        self._rms_norm_bf16 = lib.dk_rms_norm_bf16
        self._rms_norm_bf16.argtypes = [_p, _p, _p, _i, _i, _f]
        self._rms_norm_bf16.restype = ctypes.c_int
        self._silu_mul_bf16 = lib.dk_silu_mul_bf16
        self._silu_mul_bf16.argtypes = [_p, _p, _i, _i]
        self._silu_mul_bf16.restype = ctypes.c_int
        self._widen_add = lib.dk_widen_add
        self._widen_add.argtypes = [_p, _p, _p, _p, _i, _i]
        self._widen_add.restype = None
        self._attend = lib.dk_rope_cache_attend
        self._attend.argtypes = [_p, _i, _i, _i, _i, _p, _p, _p, _p, _p, _p, _p, _p, _i, _f, _i, _i, _f, _i, _i, _p]
        self._attend.restype = ctypes.c_int
        self._linear_i8 = lib.dk_linear_i8
        self._linear_i8.argtypes = [_p, _i, _i, _p, _p, _p, _p, _p, _i]
        self._linear_i8.restype = None
        self._linear_bf16 = lib.dk_linear_bf16
        self._linear_bf16.argtypes = [_p, _i, _i, _p, _p, _p, _p, _i]
        self._linear_bf16.restype = None
        self._gemv = lib.dk_gemv
        self._gemv.argtypes = [_p, _i, _p, _i, _i, _p, _p, _p]
        self._gemv.restype = ctypes.c_int
        self._gemv_set_prefetch = lib.dk_gemv_set_prefetch
        self._gemv_set_prefetch.argtypes = [_i]
        self._gemv_set_prefetch.restype = _i
        lib.dk_gemv_max_rows.restype = ctypes.c_int
        self.gemv_max_rows = int(lib.dk_gemv_max_rows())
        """The most float32 rows `gemv` takes (kernels.c's GEMV_MAX_ROWS: 24 built for AVX2, 8 for AVX-512); more
        rows run on torch's products."""
        # the whole layer stack of a step in one call: (layers, count, tokens, hidden_dim, hidden, out, key_pools,
        # value_pools, attention, scratch) -> status, the structures `fused.layer_stack` fills (see `layers.c`)
        self.layer_stack = lib.dk_layer_stack
        self.layer_stack.argtypes = [_p, _i, _i, _i, _p, _p, _p, _p, _p, _p]
        self.layer_stack.restype = ctypes.c_int
        # (layers, count, hidden_dim, key_pools, value_pools, attention, scratch, model, rows, token, position,
        # steps, out_tokens) -> tokens produced or an error (-1..-3): greedy runs (`fused.layer_stack.DecodeRun`)
        self.decode_run = lib.dk_decode_run
        self.decode_run.argtypes = [_p, _i, _i, _p, _p, _p, _p, _p, _p, _i, _i, _i, _p]
        self.decode_run.restype = ctypes.c_int64
        # (logits, vocab, rule, u, probs) -> token, or -2 (no memory): one row's draw (`draw_row`)
        self._draw_row = lib.dk_draw_row
        self._draw_row.argtypes = [_p, _i, _p, ctypes.c_double, _p]
        self._draw_row.restype = ctypes.c_int64
        # (on) -> None and () -> seconds: the layer stack's weight products timed (`time_stack_products`)
        self._stack_timing = lib.dk_stack_timing
        self._stack_timing.argtypes = [_i]
        self._stack_timing.restype = None
        self._stack_product_seconds = lib.dk_stack_product_seconds
        self._stack_product_seconds.argtypes = []
        self._stack_product_seconds.restype = ctypes.c_double
        self._stack_seconds = lib.dk_stack_seconds
        self._stack_seconds.argtypes = [_i]
        self._stack_seconds.restype = ctypes.c_double
        self.quant = QuantKernels(lib)  # GGUF quantized weights multiplied as stored
        # how far `gemv` prefetches, once `load_kernels` has chosen it for this machine
        self.gemv_prefetch: GemvPrefetchChoice | None = None
        self.parallel = bool(lib.dk_parallel())  # attention on torch's threads (built with OpenMP)
        # keys per tile of the tiled attention (16 built for AVX-512, 8 for AVX2 + FMA; 0: key by key only), for head
        # sizes that are a multiple of it
        self.attention_tile = int(lib.dk_tiled_attention())
        self.tiled_attention = self.attention_tile > 0
        # the largest head size (a multiple of 32) attended on bf16 dot products (built for AVX512-BF16; 0: none)
        self.dot_attention_max_dim = int(lib.dk_dot_attention())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, bf16_out: bool = False) -> torch.Tensor:
        """transformers' RMSNorm of float32 rows `x` `[rows, dim]` with `weight` `[dim]`; with `bf16_out`, rounded
        to bfloat16 as `.to(torch.bfloat16)` rounds it (the input of a bf16 product), in the same pass."""
        x = x.contiguous()
        if not bf16_out:
            out = torch.empty_like(x)
            self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
            return out
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        if self._rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps) != 0:
            raise MemoryError("native RMSNorm could not allocate its scratch memory")
        return out

    def draw_row(self, logits: torch.Tensor, rule: DrawRule, u: float) -> tuple[int, torch.Tensor]:
        """The token a decode run draws by `rule` from one row of float32 `logits` at the uniform `u` (in [0, 1)),
        and the distribution it drew from (float32, 0 where the rule's truncation dropped a token)."""
        row = logits.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        probs = torch.empty_like(row)
        fields = DrawRuleFields()
        fields.set(rule)
        token = self._draw_row(row.data_ptr(), row.numel(), ctypes.addressof(fields), float(u), probs.data_ptr())
        if token == -2:
            raise MemoryError("a native draw could not allocate its scratch memory")
        return int(token), probs

    def time_stack_products(self, on: bool) -> None:
        """Start (and zero) or stop timing the layer stack's weight products and the parts outside them
        (`stack_product_seconds`, `stack_seconds`). For benchmarks: the tally is process-wide, for one stack running
        at a time, and costs two clock reads a part while on."""
        self._stack_timing(int(on))

    def stack_product_seconds(self) -> float | None:
        """Wall seconds the layer stack's products took since `time_stack_products(True)`; None while off."""
        seconds = float(self._stack_product_seconds())
        return None if seconds < 0 else seconds

    def stack_seconds(self) -> dict[str, float] | None:
        """Wall seconds of each timed part of the layer stack and its decode runs since `time_stack_products(True)`,
        by `STACK_PARTS` name (the products, GGUF layers' gating included; RoPE + KV write + attention; the
        RMSNorms; a separate SiLU-gating pass; a run's embedding rows and argmaxes); None while off."""
        seconds = {name: float(self._stack_seconds(index)) for index, name in enumerate(STACK_PARTS)}
        return None if any(value < 0 for value in seconds.values()) else seconds

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` for `[rows, 2 * inter]` rows holding gate then up: float32 in and out, or bfloat16 in
        and out (widened, gated in float32, rounded: a bf16 product's output to the next one's input)."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        if gate_up.dtype != torch.bfloat16:
            self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        elif self._silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), rows, width // 2) != 0:
            raise MemoryError("native SiLU-gating could not allocate its scratch memory")
        return out

    def widen_add(self, product: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
        """`product.float() (+ bias) (+ residual)` in float32 for a bfloat16 product's output `[rows, out]`, in one
        pass (bias `[out]`, residual `[rows, out]`, float32), added in that order."""
        product = product.contiguous()
        rows, cols = product.shape
        out = torch.empty(rows, cols, dtype=torch.float32)
        residual = None if residual is None else residual.contiguous()
        self._widen_add(product.data_ptr(), None if bias is None else bias.data_ptr(),
                        None if residual is None else residual.data_ptr(), out.data_ptr(), rows, cols)
        return out

    @staticmethod
    def _product_operands(x: torch.Tensor, panels: torch.Tensor, packed_shape: tuple[int, ...], dtype: torch.dtype,
                          out_dim: int, residual: torch.Tensor | None, packer: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`x` and `residual` made contiguous and the output `[rows, out_dim]` allocated, once `panels` is checked to
        be the contiguous `packed_shape` of `dtype` that `packer` makes for a `[out_dim, in]` weight.

        Raises:
            ValueError: the panels do not pack such a weight (the kernel would read out of bounds).
        """
        if panels.shape != packed_shape or panels.dtype != dtype or not panels.is_contiguous():
            raise ValueError(f"the panels {panels.dtype} {tuple(panels.shape)} do not pack a [{out_dim}, "
                             f"{x.shape[1]}] weight (see {packer})")
        return x.contiguous(), x.new_empty(x.shape[0], out_dim), None if residual is None else residual.contiguous()

    def linear_i8(self, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ (W * scale[:, None]).T (+ bias) (+ residual)` for float32 rows `x` `[rows, in]`, an int8 weight `W`
        `[out, in]` packed by `pack_int8_panels` and float32 `scale` `[out]`; returns `[rows, out]` (see
        `dk_linear_i8`)."""
        out_dim = scale.shape[0]
        x, out, residual = self._product_operands(x, panels, (-(-out_dim // PANEL), -(-x.shape[1] // 2), PANEL, 2),
                                                  torch.int8, out_dim, residual, "pack_int8_panels")
        self._linear_i8(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), scale.data_ptr(),
                        None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
                        out.data_ptr(), out_dim)
        return out

    def linear_bf16(self, x: torch.Tensor, panels: torch.Tensor, out_dim: int, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T (+ bias) (+ residual)` for float32 rows `x` `[rows, in]` and a bfloat16 weight `W` `[out_dim, in]`
        packed by `pack_bf16_panels`, in float32 arithmetic; returns float32 `[rows, out_dim]` (see
        `dk_linear_bf16`)."""
        x, out, residual = self._product_operands(x, panels, (-(-out_dim // PANEL), x.shape[1], PANEL),
                                                  torch.bfloat16, out_dim, residual, "pack_bf16_panels")
        self._linear_bf16(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(),
                          None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
                          out.data_ptr(), out_dim)
        return out

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight^T (+ residual) (+ bias)` for 1 to `gemv_max_rows` float32 rows `x` `[rows, in]` and a contiguous
        float32 `weight` `[out, in]`, on torch's threads; returns `[rows, out]` (see `dk_gemv`). A row's result does
        not depend on the other rows multiplied with it, nor on the thread count.

        Raises:
            ValueError: `x` does not fit `weight`, `weight` is not contiguous, or there are too many rows.
        """
        out_dim, width = weight.shape
        rows = x.shape[0]
        if x.dim() != 2 or x.shape[1] != width or not weight.is_contiguous() or not 1 <= rows <= self.gemv_max_rows:
            raise ValueError(f"gemv takes 1-{self.gemv_max_rows} rows of {width} floats and a contiguous [out, in] "
                             f"weight, not {tuple(x.shape)} and strides {weight.stride()}")
        x = x.contiguous()
        out = x.new_empty(rows, out_dim)
        residual = None if residual is None else residual.contiguous()
        status = self._gemv(x.data_ptr(), rows, weight.data_ptr(), width, out_dim,
                            None if bias is None else bias.data_ptr(),
                            None if residual is None else residual.data_ptr(), out.data_ptr())
        assert status == 0, "dk_gemv refused the rows checked above"
        return out

    def set_gemv_prefetch(self, floats: int | None) -> int:
        """How far ahead `gemv` prefetches its weight stream, in floats per activation row, for the whole process
        (0: no software prefetch; None: the library's default); returns the setting before. Speed only: no result
        changes (`kernels.gemv_prefetch` chooses it per machine)."""
        return int(self._gemv_set_prefetch(-1 if floats is None else floats))

    def rope_cache_attend(self, qkv: torch.Tensor, heads: int, kv_heads: int, key_slots: torch.Tensor,
                          value_slots: torch.Tensor, plan: DecodeAttentionPlan, scaling: float,
                          window: int | None = None, softcap: float | None = None, tiled: bool = True,
                          bf16_dot: bool = False) -> torch.Tensor:
        """RoPE on `qkv`'s query and key heads (in place), KV write to the pool, attention; returns `[T, H * D]`.

        `qkv` is `[T, (heads + 2 * kv_heads) * D]` float32, contiguous; `key_slots`/`value_slots` are one layer's
        `[slots, kv_heads, D]` pool views, float32 or bfloat16 (keys and values are then stored rounded to nearest
        even, as `.to(torch.bfloat16)` does, and widened as they are read: the arithmetic stays float32); `plan`
        (with `set_rope` called) says where each query's keys are; with a `window`, each query attends only the last
        `window` of them (transformers' `sliding_window`); with a `softcap`, scores are capped to
        `softcap * tanh(score / softcap)` (Gemma 2). The
        rows of tokens the plan leaves out (key length 0) are not written: the caller attends them. From
        `PARALLEL_MIN_KEYS` keys read, the attention is split over torch's threads (when built with OpenMP); every
        (token, kv head) item is computed as on one thread, so the result does not depend on the split.

        Where the library has `tiled_attention` (built for AVX-512: 16 keys a tile; AVX2 + FMA: 8) and the head size
        is a multiple of its `attention_tile`, keys are attended a tile at a time; `tiled=False` takes the key-by-key
        path every CPU has (the two agree to float32 rounding).

        With `bf16_dot` and a bfloat16 pool, on a library built for AVX512-BF16 (`dot_attention_max_dim`) and a head
        size that is a multiple of 32 up to it, the tiled path multiplies on the CPU's bf16 dot products instead:
        queries and the softmax's probabilities rounded to bf16 (as a bf16 model's attention holds them), products
        summed in float32. For a model whose other products are bf16 (`bf16_arithmetic`); elsewhere the flag is
        ignored and the arithmetic stays float32.
        """
        dim = key_slots.shape[-1]
        if qkv.shape != (plan.tokens, (heads + 2 * kv_heads) * dim) or not qkv.is_contiguous():
            raise ValueError(f"qkv {tuple(qkv.shape)} does not match the plan's {plan.tokens} tokens")
        if key_slots.dtype not in KV_DTYPES or value_slots.dtype != key_slots.dtype:
            raise ValueError(f"the native attention reads float32 or bfloat16 pools, not {key_slots.dtype} / "
                             f"{value_slots.dtype}")
        # 0: float32 pool; 1: bf16 pool widened to float32; 2: bf16 pool on bf16 dot products (the C side falls back
        # to 1 where it cannot)
        kv_mode = 0 if key_slots.dtype != torch.bfloat16 else (2 if bf16_dot else 1)
        out = qkv.new_empty(plan.tokens, heads * dim)
        cos, sin, slots, tables, table_start, key_len = plan.pointers
        status = self._attend(qkv.data_ptr(), plan.tokens, heads, kv_heads, dim, cos, sin, key_slots.data_ptr(),
                              value_slots.data_ptr(), slots, tables, table_start, key_len, plan.block_size, scaling,
                              PARALLEL_MIN_KEYS, window or 0, softcap or 0.0, kv_mode, int(tiled), out.data_ptr())
        if status != 0:
            raise MemoryError("native attention could not allocate its scratch memory")
        return out


# Output rows per panel of a packed weight (`PANEL` in kernels.c).
PANEL = 16


def _padded_rows(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` with zero rows appended up to a multiple of `PANEL`."""
    out_dim, width = weight.shape
    extra = -out_dim % PANEL
    return torch.cat([weight, weight.new_zeros(extra, width)]) if extra else weight


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight `[out, in]` as the bfloat16 panels `dk_linear_bf16` reads: `[ceil(out / 16), in, 16]` contiguous,
    panel p holding output rows 16p..16p+15 input by input (zero rows past `out`). Rounds to bf16 if needed."""
    rows = _padded_rows(weight.detach().to(torch.bfloat16))
    return rows.view(-1, PANEL, rows.shape[1]).transpose(1, 2).contiguous()


def pack_int8_panels(weight: torch.Tensor) -> torch.Tensor:
    """An int8 weight `[out, in]` as the panels `dk_linear_i8` reads: `[ceil(out / 16), ceil(in / 2), 16, 2]`
    contiguous, panel p holding output rows 16p..16p+15 by pairs of inputs (zeros past `out` and an odd `in`)."""
    rows = _padded_rows(weight.detach())
    if rows.shape[1] % 2:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 1)], dim=1)
    return rows.view(-1, PANEL, rows.shape[1] // 2, 2).transpose(1, 2).contiguous()


def unpack_int8_panels(panels: torch.Tensor, out_dim: int, width: int) -> torch.Tensor:
    """The int8 weight `[out_dim, width]` that `pack_int8_panels` packed (a copy)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1] * 2)[:out_dim, :width].contiguous()


class DecodeAttentionPlan:
    """Where each query token of a step reads its keys, as int64 arrays the native attention takes.

    Built once per step by the runner (shared by every layer). The native attention serves sequences scoring at
    most `max_query` tokens (decodes, verification, beams), and prefill chunks of sequences of at most
    `chunk_max_keys` keys in all: it attends query by query, which beats SDPA's setup there and loses to its blocked
    products on long prefill chunks. A longer sequence's tokens get key length 0 (the kernel still rotates and
    stores them), `has_chunks` tells the caller to attend them itself, and `chunks_left` says which (the first
    token of each, as in `AttentionLayout.chunks`).

    Args:
        slots: `[T]` int64 pool slot each token's key/value is written to.
        query_lens, context_lens, block_tables: per sequence, as in `kv_cache.build_layout`.
        block_size: tokens per block.
        max_query: the longest query the native attention takes whatever its context.
        chunk_max_keys: the most keys (context and chunk) of a longer query it takes (0: none;
            `FusedDecoder.native_chunk_keys`).

    Raises:
        ValueError: a block table is too short for its sequence's tokens.
    """

    def __init__(self, slots: torch.Tensor, query_lens: list[int], context_lens: list[int],
                 block_tables: list[list[int]], block_size: int, max_query: int = BATCHED_MAX_QUERY,
                 chunk_max_keys: int = 0) -> None:
        tables: list[int] = []
        table_start: list[int] = []
        key_len: list[int] = []
        self.chunks_left: set[int] = set()
        for q_len, ctx_len, table in zip(query_lens, context_lens, block_tables):
            if q_len > max_query and ctx_len + q_len > chunk_max_keys:
                self.chunks_left.add(len(key_len))
                table_start.extend([0] * q_len)
                key_len.extend([0] * q_len)
                continue
            start = len(tables)
            needed = -(-(ctx_len + q_len) // block_size)
            if len(table) < needed:  # the kernel would read past the table: refuse before it runs
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {ctx_len + q_len} tokens")
            tables.extend(table[:needed])
            table_start.extend([start] * q_len)
            key_len.extend(range(ctx_len + 1, ctx_len + q_len + 1))
        self.has_chunks = bool(self.chunks_left)
        self.slots = slots
        self.tables = torch.tensor(tables or [0], dtype=torch.long)
        self.table_start = torch.tensor(table_start, dtype=torch.long)
        self.key_len = torch.tensor(key_len, dtype=torch.long)
        self.block_size = block_size
        self.tokens = len(key_len)
        self.cos: torch.Tensor | None = None
        self.signed_sin: torch.Tensor | None = None
        self.pointers: tuple[int, ...] = ()

    def set_rope(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """This step's rotary tables, `[T, head_dim]` each (kept alive here while the kernels read them)."""
        self.cos, self.signed_sin = cos.contiguous(), signed_sin.contiguous()
        # The pointers every layer passes, read once per step instead of once per layer.
        self.pointers = (self.cos.data_ptr(), self.signed_sin.data_ptr(), self.slots.data_ptr(),
                         self.tables.data_ptr(), self.table_start.data_ptr(), self.key_len.data_ptr())


@functools.cache
def load_kernels() -> NativeKernels | str:
    """The native kernels for this machine, built once per process (and cached on disk), or why they are off."""
    setting = os.environ.get("DECODEKIT_NATIVE_KERNELS", "1")
    if setting.lower() in ("0", "false", "no", "off"):
        return f"DECODEKIT_NATIVE_KERNELS={setting}"
    compiler = find_compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    try:
        kernels = NativeKernels(build_library(compiler))
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return str(error)
    apply_gemv_prefetch(kernels)  # times the kernels just loaded, once per machine and library
    return kernels
