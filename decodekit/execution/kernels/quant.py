"""The native products of GGUF quantized weights (`native/quant.c`), bound from the kernels' library.

A GGUF weight `[out, in]` is kept as the file stores it: `out` rows of blocks (`uint8 [out, row_bytes]`), Q4_0,
Q4_1, Q8_0 (blocks of 32 weights) or Q4_K, Q6_K (super-blocks of 256). `QuantKernels.linear` multiplies float32
rows by it, dequantizing each block in registers (the AVX2 path's Q4_0, Q4_1 and Q8_0, the AVX-512 path's Q4_0 and
Q4_1: their quants times the activations rounded to 16-bit fixed point per block of 32, integers summed exactly,
`FIXED_POINT_FORMATS`), and `dequantize` writes float32
rows of it (for the GEMM of many rows). Both compute each weight exactly as gguf-py's `dequantize` does (the
float32 weights transformers loads).
`Q4_1x8` is decodekit's own layout of Q4_1 (`interleave_q4_1`: each 8 rows' blocks regrouped so a vector's lanes are
8 output rows), which the AVX2 path multiplies faster for one or two activation rows and slower for more (opt-in:
`stored_matrices.laid_out_for`). `Q4_0g` and `Q4_1g` are Q4_0 and Q4_1 rows with each 8 blocks' scales (and mins)
first (`group_blocks`), which the fixed-point products read with fewer instructions, to the same bits.

Three code paths: AVX-512, AVX2 + FMA and portable C, chosen at run time: the best the library was compiled with
for this CPU, or a lower one named by `DECODEKIT_QUANT_ISA` (portable, avx2, avx512) or by the `isa` argument (tests
run every path a CPU has).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

INTERLEAVED_Q4_1 = "Q4_1x8"
"""The format name of Q4_1 blocks interleaved by 8 rows (`interleave_q4_1`)."""
GROUPED = {"Q4_0": "Q4_0g", "Q4_1": "Q4_1g"}
"""A format -> the name of its rows laid out by runs of blocks (`group_blocks`)."""
GROUP_BLOCKS = 8
"""Blocks a run of `group_blocks`' layout holds (a row's last run: what is left); `native/quant.c`'s GROUP_BLOCKS,
which reads the runs, must be the same."""

# ggml's type ids (`gguf.GGMLQuantizationType`) of the formats the kernels take, with (weights, bytes) per block.
GGUF_FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
    INTERLEAVED_Q4_1: (103, 32, 20),
    GROUPED["Q4_0"]: (104, 32, 18),
    GROUPED["Q4_1"]: (105, 32, 20),
}
"""format name -> (ggml type id, weights per block, bytes per block); `Q4_1x8`, `Q4_0g` and `Q4_1g` are decodekit's
own layouts (`interleave_q4_1`, `group_blocks`; ids past ggml's), not a file's."""

FILE_FORMATS = tuple(fmt for fmt in GGUF_FORMATS if fmt != INTERLEAVED_Q4_1 and fmt not in GROUPED.values())
"""The formats a GGUF file holds (the others are decodekit's layouts of them)."""


def file_format(fmt: str) -> str:
    """The format a GGUF file stores for blocks laid out as `fmt` (`Q4_1x8` and `Q4_1g`: Q4_1; `Q4_0g`: Q4_0)."""
    if fmt == INTERLEAVED_Q4_1:
        return "Q4_1"
    return next((stored for stored, grouped in GROUPED.items() if grouped == fmt), fmt)

INTERLEAVED_ROWS = 8
"""Rows whose blocks `interleave_q4_1` lays out together."""

ISAS = ("portable", "avx2", "avx512")
"""The code paths, lowest first (`dk_quant_isa` returns the index of the best one compiled)."""

ISA_VARIABLE = "DECODEKIT_QUANT_ISA"

ACTIVATIONS_VARIABLE = "DECODEKIT_GGUF_ACTIVATIONS"
"""`fixed16` (the default): the AVX2 path's Q4_0, Q4_1 and Q8_0 products and the AVX-512 path's Q4_0 and Q4_1
(`FIXED_POINT_FORMATS`) round the activations to 16-bit fixed point per block of 32 (integer sums, half the vector
operations); `float32`: float32 activations on every path (the dequantized model's outputs up to summation order
alone)."""
ACTIVATIONS = ("fixed16", "float32")

_FLOAT_ACTIVATIONS = 8  # or'd into a product's path (`native/quant.c`'s DK_QUANT_FLOAT_ACTIVATIONS)

_p = ctypes.c_void_p
_i = ctypes.c_int64


def row_bytes(fmt: str, width: int) -> int:
    """Bytes of one row of `width` weights in `fmt`.

    Raises:
        ValueError: `fmt` is not one of `GGUF_FORMATS`, or `width` is not a whole number of its blocks.
    """
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"format {fmt!r}: the native quantized products take {', '.join(GGUF_FORMATS)}")
    _, per_block, size = GGUF_FORMATS[fmt]
    if width <= 0 or width % per_block:
        raise ValueError(f"a {fmt} row holds whole blocks of {per_block} weights, not {width}")
    return width // per_block * size


def interleave_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks `[n, row_bytes]` (n a multiple of 8) laid out as `Q4_1x8`: the same bytes, each 8 rows' chunk by
    chunk (160 bytes a chunk): the 8 fp16 scales, the 8 fp16 mins, then four times 32 bytes, 4 quant bytes of each
    row (`native/quant.c`, DK_Q4_1X8). Rows [8g, 8g + 8) of the result hold group g, so slicing whole groups keeps
    it valid.

    Raises:
        ValueError: the rows are not whole groups of 8, or not Q4_1 rows.
    """
    n, width_bytes = blocks.shape
    if n % INTERLEAVED_ROWS or width_bytes % 20 or blocks.dtype != torch.uint8:
        raise ValueError(f"{tuple(blocks.shape)} {blocks.dtype} blocks are not whole groups of 8 Q4_1 rows")
    chunks = width_bytes // 20
    groups = blocks.reshape(n // INTERLEAVED_ROWS, INTERLEAVED_ROWS, chunks, 20).permute(0, 2, 1, 3)
    scales, mins = groups[..., 0:2].flatten(2), groups[..., 2:4].flatten(2)
    quants = groups[..., 4:20].unflatten(3, (4, 4)).permute(0, 1, 3, 2, 4).flatten(2)
    return torch.cat([scales, mins, quants], dim=2).reshape(n, width_bytes).contiguous()


def group_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """Q4_0 or Q4_1 rows `[n, row_bytes]` laid out by runs of 8 blocks (`GROUPED[fmt]`): the same bytes a row, each
    run (the last one 1-8 blocks) as its blocks' fp16 scales, then (Q4_1) their fp16 mins, then their 16-byte quants
    one after another (`native/quant.c`, DK_Q4_0G and DK_Q4_1G). A copy.

    Raises:
        ValueError: `fmt` is neither, or the rows are not whole blocks of it.
    """
    if fmt not in GROUPED or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"{tuple(blocks.shape)} {blocks.dtype} {fmt} blocks: only Q4_0 and Q4_1 rows are grouped")
    size = GGUF_FORMATS[fmt][2]
    n, width_bytes = blocks.shape
    if width_bytes % size:
        raise ValueError(f"{width_bytes} bytes a row are not whole {fmt} blocks of {size}")
    count = width_bytes // size
    whole = count // GROUP_BLOCKS * GROUP_BLOCKS

    def runs(part: torch.Tensor, run: int) -> torch.Tensor:
        """`part`'s blocks, `run` a run, laid out run by run: scales, (mins,) quants."""
        if part.shape[1] == 0:
            return part
        grouped = part.reshape(n, -1, run, size)
        fields = [grouped[..., 0:2]] + ([grouped[..., 2:4]] if size == 20 else []) + [grouped[..., size - 16:]]
        return torch.cat([field.flatten(2) for field in fields], dim=2).flatten(1)

    return torch.cat([runs(blocks[:, :whole * size], GROUP_BLOCKS),
                      runs(blocks[:, whole * size:], count - whole)], dim=1).contiguous()


def float_activations_asked() -> bool:
    """Whether `$DECODEKIT_GGUF_ACTIVATIONS` asks for float32 activations (`float32`; `fixed16` or unset: no).

    Raises:
        ValueError: the variable holds neither (the message names it and the choices).
    """
    asked = os.environ.get(ACTIVATIONS_VARIABLE, "").strip().lower() or ACTIVATIONS[0]
    if asked not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_VARIABLE}={asked!r}: the choices are {', '.join(ACTIVATIONS)}")
    return asked == "float32"


FIXED_POINT_FORMATS: dict[str, tuple[str, ...]] = {"avx2": ("Q4_0", "Q4_1", "Q8_0"), "avx512": ("Q4_0", "Q4_1")}
"""path -> the formats whose products on it round the activations to 16-bit fixed point per block of 32 (AVX-512's
Q4_0 and Q4_1 products are AVX2's arithmetic on 512-bit integer tiles, summed in an order of their own; its float
Q8_0 product reads at the bandwidth already and multiplies several rows faster than the fixed-point one)."""


def fixed_point_formats(isa: str) -> tuple[str, ...]:
    """The file formats whose products on path `isa` round the activations to 16-bit fixed point
    (`FIXED_POINT_FORMATS`); none under `$DECODEKIT_GGUF_ACTIVATIONS=float32`.

    Raises:
        ValueError: the variable holds neither choice.
    """
    float_activations = float_activations_asked()  # checked on every path: a bad value is refused everywhere
    return () if float_activations else FIXED_POINT_FORMATS.get(isa, ())


def rounds_activations(isa: str) -> bool:
    """Whether any product on path `isa` rounds the activations to 16-bit fixed point (`fixed_point_formats`): the
    AVX2 and AVX-512 paths, unless `$DECODEKIT_GGUF_ACTIVATIONS=float32`.

    Raises:
        ValueError: the variable holds neither choice.
    """
    return bool(fixed_point_formats(isa))


def path_code(isa: str, float_activations: bool = False) -> int:
    """The `isa` argument of the native products: the path's index, with the float-activations flag."""
    return ISAS.index(isa) | (_FLOAT_ACTIVATIONS if float_activations else 0)


class QuantKernels:
    """The quantized products of one loaded kernels library (`NativeKernels.quant`)."""

    def __init__(self, lib: Any) -> None:
        self._linear = lib.dk_quant_linear
        self._linear.argtypes = [_i, _p, _i, _i, _p, _i, _p, _p, _p, _i, _i]
        self._linear.restype = ctypes.c_int
        self._gated = lib.dk_quant_gated
        self._gated.argtypes = [_p, _p, _i, _p, _i, _i, _p, _p, _i]
        self._gated.restype = ctypes.c_int
        self._dequantize = lib.dk_quant_dequantize
        self._dequantize.argtypes = [_i, _p, _i, _i, _p, _i]
        self._dequantize.restype = ctypes.c_int
        self.best_isa = ISAS[int(lib.dk_quant_isa())]
        """The widest path compiled for this CPU."""

    @property
    def available(self) -> tuple[str, ...]:
        """The paths this library can run, lowest first."""
        return ISAS[: ISAS.index(self.best_isa) + 1]

    def isa(self, name: str | None = None) -> str:
        """The path to run: `name`, else `$DECODEKIT_QUANT_ISA`, else the best compiled.

        Raises:
            ValueError: the path named is unknown or not compiled here (the message names where it was asked).
        """
        where = "isa"
        if name is None:
            name, where = os.environ.get(ISA_VARIABLE) or self.best_isa, ISA_VARIABLE
        if name not in self.available:
            raise ValueError(f"{where}={name!r}: this CPU's kernels run {', '.join(self.available)}")
        return name

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, fmt: str, out: torch.Tensor, start: int = 0,
               bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, isa: str | None = None,
               float_activations: bool = False) -> None:
        """`out[:, start:start + n] = x @ W.T (+ bias[start:start + n]) (+ residual[:, start:start + n])` for float32
        rows `x` `[rows, in]` (contiguous) and the `fmt` weight `W` `[n, in]` held as its blocks `blocks` (`uint8
        [n, row_bytes]`, contiguous); `out` and `residual` are contiguous `[rows, out_dim]` float32, `bias` `[out_dim]`.
        `float_activations` keeps float32 activations where the AVX2 and AVX-512 paths would round them to 16-bit
        fixed point.

        Raises:
            ValueError: the operands do not fit each other (the kernel would read out of bounds).
        """
        rows, width = x.shape
        n = blocks.shape[0]
        if (blocks.dtype != torch.uint8 or (fmt == INTERLEAVED_Q4_1 and n % INTERLEAVED_ROWS) or blocks.dim() != 2
                or blocks.shape[1] != row_bytes(fmt, width)
                or not blocks.is_contiguous() or not x.is_contiguous() or x.dtype != torch.float32
                or out.shape[0] != rows or not 0 <= start <= out.shape[1] - n or not out.is_contiguous()
                or (residual is not None and (residual.shape != out.shape or not residual.is_contiguous()))
                or (bias is not None and bias.shape != (out.shape[1],))):
            raise ValueError(f"a {fmt} product of {tuple(x.shape)} rows, {tuple(blocks.shape)} blocks into columns "
                             f"{start}:{start + n} of {tuple(out.shape)} does not fit")
        step = out.element_size() * start
        status = self._linear(GGUF_FORMATS[fmt][0], x.data_ptr(), rows, width, blocks.data_ptr(), n,
                              None if bias is None else bias.data_ptr() + step,
                              None if residual is None else residual.data_ptr() + step, out.data_ptr() + step,
                              out.shape[1], path_code(self.isa(isa), float_activations))
        assert status == 0, "dk_quant_linear refused operands the wrapper checked"

    def gated(self, x: torch.Tensor, gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str],
              isa: str | None = None, float_activations: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate/up product of float32 rows `x` `[rows, in]` with the gate's and the up's `(blocks, fmt)` (`inter`
        rows each) and its SiLU-gating, in one parallel region (what the layer stack runs for GGUF layers): returns
        `(gate_up [rows, 2 inter], silu(gate) * up [rows, inter])`, the values `linear` of both parts then
        `NativeKernels.silu_mul` give.

        Raises:
            ValueError: the operands do not fit each other.
        """
        rows, width = x.shape
        (gate_blocks, gate_fmt), (up_blocks, up_fmt) = gate, up
        inter = gate_blocks.shape[0]
        for blocks, fmt in (gate, up):
            if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape != (inter, row_bytes(fmt, width))
                    or not blocks.is_contiguous() or (fmt == INTERLEAVED_Q4_1 and inter % INTERLEAVED_ROWS)):
                raise ValueError(f"{tuple(blocks.shape)} {blocks.dtype} blocks are not {inter} {fmt} rows of {width}")
        if not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError("the rows must be contiguous float32")
        kinds = (ctypes.c_int64 * 2)(GGUF_FORMATS[gate_fmt][0], GGUF_FORMATS[up_fmt][0])
        pointers = (ctypes.c_void_p * 2)(gate_blocks.data_ptr(), up_blocks.data_ptr())
        gate_up, gated = x.new_empty(rows, 2 * inter), x.new_empty(rows, inter)
        status = self._gated(kinds, pointers, inter, x.data_ptr(), rows, width, gate_up.data_ptr(), gated.data_ptr(),
                             path_code(self.isa(isa), float_activations))
        assert status == 0, "dk_quant_gated refused operands the wrapper checked"
        return gate_up, gated

    def dequantize(self, blocks: torch.Tensor, fmt: str, width: int, isa: str | None = None) -> torch.Tensor:
        """The float32 weight `[n, width]` that `fmt` blocks `[n, row_bytes]` hold (gguf-py's `dequantize`, exactly).

        Raises:
            ValueError: `blocks` are not `fmt` rows of `width` weights.
        """
        blocks = blocks.contiguous()
        if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(fmt, width)
                or (fmt == INTERLEAVED_Q4_1 and blocks.shape[0] % INTERLEAVED_ROWS)):
            raise ValueError(f"{tuple(blocks.shape)} {blocks.dtype} blocks are not {fmt} rows of {width} weights")
        out = torch.empty(blocks.shape[0], width)
        status = self._dequantize(GGUF_FORMATS[fmt][0], blocks.data_ptr(), blocks.shape[0], width, out.data_ptr(),
                                  ISAS.index(self.isa(isa)))
        assert status == 0, "dk_quant_dequantize refused operands the wrapper checked"
        return out
