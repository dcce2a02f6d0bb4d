"""The native products of GGUF quantized weights (`kernels.quant`, `GgufMatrix`): on every code path this CPU has
(AVX-512, AVX2 + FMA, portable C), each format's blocks dequantize to exactly gguf-py's float32 weights, and the
product of 1 to N rows (native up to GGUF_NATIVE_MAX_ROWS, dequantized blocks and BLAS beyond) is the float product
of those weights up to summation order (on the AVX2 path Q4_0, Q4_1 and Q8_0, on the AVX-512 path Q4_0 and Q4_1, also
within the rounding of the activations to 16-bit fixed point per block, exactly that scheme, and AVX-512's the same
bits as AVX2's); bad operands and unknown paths are refused naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.api.models import StoredWeight
from decodekit.execution.fused.stored_matrices import (
    GGUF_NATIVE_MAX_ROWS,
    INTERLEAVE_VARIABLE,
    GgufMatrix,
    laid_out_for,
)
from decodekit.execution.kernels.native import load_kernels
from decodekit.execution.kernels.quant import (
    ACTIVATIONS_VARIABLE,
    FILE_FORMATS,
    FIXED_POINT_FORMATS,
    GGUF_FORMATS,
    GROUPED,
    INTERLEAVED_Q4_1,
    ISA_VARIABLE,
    group_blocks,
    interleave_q4_1,
    row_bytes,
)
from tests.helpers.gguf_blocks import gguf_dequantize, random_blocks

kernels = load_kernels()
needs_kernels = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")
ISAS = () if isinstance(kernels, str) else kernels.quant.available
FORMATS = sorted(FILE_FORMATS)
"""The formats a GGUF file holds; `Q4_1x8` (Q4_1 interleaved by 8 rows), `Q4_0g` and `Q4_1g` (grouped blocks) are
decodekit's own layouts."""


def _stored(fmt: str, rows: int, width: int, seed: int) -> tuple[StoredWeight, torch.Tensor]:
    """Random blocks of `fmt` (for `Q4_1x8`: random Q4_1 blocks of `rows`, a multiple of 8, interleaved) and the
    float32 weights gguf-py dequantizes them to."""
    blocks = random_blocks("Q4_1" if fmt == INTERLEAVED_Q4_1 else fmt, rows, width, seed)
    want = gguf_dequantize(blocks, "Q4_1" if fmt == INTERLEAVED_Q4_1 else fmt, width)
    data = torch.from_numpy(blocks)
    return StoredWeight(fmt, interleave_q4_1(data) if fmt == INTERLEAVED_Q4_1 else data, (rows, width)), want


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 summation-order error of `x @ weight.T`: a few ulps of the sum of the products' magnitudes."""
    return (x.abs().double() @ weight.abs().double().t()) * 2e-6 + 1e-30


FIXED_POINT_PATHS = tuple(isa for isa in FIXED_POINT_FORMATS if isa in ISAS)
"""This CPU's paths that multiply some formats by activations rounded to 16-bit fixed point per block of 32."""
FIXED_POINT_CASES = [(isa, fmt) for isa in FIXED_POINT_PATHS for fmt in FIXED_POINT_FORMATS[isa]]


def _fixed_point(fmt: str, isa: str) -> bool:
    return fmt in FIXED_POINT_FORMATS.get(isa, ())


def _block_scales(x: torch.Tensor) -> torch.Tensor:
    """Each value's 16-bit fixed-point step: its block of 32's largest |value| / 32767, in float32 as the kernel
    computes it."""
    largest = x.abs().reshape(x.shape[0], -1, 32).amax(dim=2)
    return (largest / 32767.0).repeat_interleave(32, dim=1)


def _rounding_bound(x: torch.Tensor, scaled_quants: torch.Tensor) -> torch.Tensor:
    """The most that rounding the activations to 16-bit fixed point per block (half a step each) moves the product's
    sum over the scaled quants `d q` (the weights less their block mins: the mins multiply the block sums of the
    unrounded activations)."""
    return (_block_scales(x).double() * 0.5 * 1.001) @ scaled_quants.abs().double().t()


def _split_bound(x: torch.Tensor, weight: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Float32 summation-order error of the fixed-point product's two sums, (d q) . x and m . (block sums of x),
    each of which can exceed the output they add up to (Q4_1's mins cancel much of the scaled quants' sum)."""
    magnitudes = x.abs().double() @ ((weight.double() - mins).abs() + mins.abs()).t()
    return magnitudes * 2e-6 + _rounding_bound(x, weight.double() - mins)


def _block_mins(stored: StoredWeight) -> torch.Tensor:
    """Each weight's block min m (Q4_0: -8d; Q8_0: none, 0) as float64 `[rows, width]`: the weight is d q + m."""
    rows, width = stored.shape
    if stored.format == "Q8_0":
        return torch.zeros(rows, width, dtype=torch.float64)
    size = GGUF_FORMATS[stored.format][2]
    blocks = stored.data.reshape(rows, width // 32, size)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16)[:, :, 0].double()
    m = blocks[:, :, 2:4].contiguous().view(torch.float16)[:, :, 0].double() if stored.format == "Q4_1" else -8 * d
    return m.repeat_interleave(32, dim=1)


def _assert_the_float_product(fmt: str, part_rows: list[int], width: int, isa: str, rows: int, bias: bool,
                              residual: bool, seed: int) -> None:
    """A `GgufMatrix` of random `fmt` parts (`part_rows` rows each, stacked) times random rows (with a random bias,
    and a random residual) is the float64 product of the dequantized weight up to float32 summation order, and its
    `dequantized()` is that weight exactly."""
    parts = [_stored(fmt, n, width, seed + i) for i, n in enumerate(part_rows)]
    weight = torch.cat([w for _, w in parts])
    mins = torch.cat([_block_mins(s) for s, _ in parts]) if _fixed_point(fmt, isa) else None
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(weight.shape[0], generator=g) if bias else None
    matrix = GgufMatrix([s for s, _ in parts], b, kernels, isa)
    x = torch.randn(rows, weight.shape[1], generator=g)
    res = torch.randn(rows, weight.shape[0], generator=g) if residual else None
    want = x.double() @ weight.double().t()
    bound = _bound(x, weight) + 1e-6 * want.abs()
    if mins is not None:
        bound += _split_bound(x, weight, mins)
    # each float32 add of the bias and the residual rounds once, at the magnitude of what it adds up
    if b is not None:
        want += b.double()
        bound += 1.2e-7 * (want.abs() + b.double().abs())
    if res is not None:
        want += res.double()
        bound += 1.2e-7 * (want.abs() + res.double().abs())
    assert torch.all((matrix(x, res).double() - want).abs() <= bound)
    assert torch.equal(matrix.dequantized(), weight)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_dequantizes_to_exactly_gguf_py_weights_on_every_path(fmt, isa):
    per_block = GGUF_FORMATS[fmt][1]
    stored, want = _stored(fmt, 7, 2 * per_block, seed=3)
    assert torch.equal(kernels.quant.dequantize(stored.data, fmt, 2 * per_block, isa), want)


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(fmt=st.sampled_from(FORMATS), isa=st.sampled_from(ISAS),
       rows=st.one_of(st.integers(1, 40), st.integers(GGUF_NATIVE_MAX_ROWS - 2, GGUF_NATIVE_MAX_ROWS + 3)),
       blocks=st.integers(1, 3), out=st.lists(st.integers(1, 9), min_size=1, max_size=3), bias=st.booleans(),
       residual=st.booleans(), seed=st.integers(0, 2**16))
def test_the_product_of_random_blocks_is_the_float_product_of_their_dequantized_weights(
        fmt, isa, rows, blocks, out, bias, residual, seed):
    """Random quants and scales, 1 to 3 blocks per row, one to three stacked parts (output counts that are not a
    multiple of the kernel's 4-row groups), rows on both sides of GGUF_NATIVE_MAX_ROWS."""
    _assert_the_float_product(fmt, out, blocks * GGUF_FORMATS[fmt][1], isa, rows, bias, residual, seed)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_product_does_not_depend_on_the_rows_multiplied_with_it(isa, fmt):
    """The native tiles (one weight row by 1-4 activation rows in registers, 1-8 on AVX-512, two by 3-5; AVX2's wide
    tiles of a group's last 5-6 rows, one vector dequantized at a time; 2x4 and 1x1-1x4 on a dequantized panel from
    16 rows, 21 on AVX-512) sum each output in one order, so a row alone, in a few rows and in a batch that takes
    the panels agree bit for bit (a request's tokens do not depend on its batch)."""
    per_block = GGUF_FORMATS[fmt][1]
    stored, _ = _stored(fmt, 37, 2 * per_block, seed=1)
    matrix = GgufMatrix([stored], None, kernels, isa)
    x = torch.randn(41, 2 * per_block)
    together = matrix(x)
    for rows in (1, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 17, 20, 21, 24):
        for start in range(0, x.shape[0] - rows + 1, 7):
            assert torch.equal(matrix(x[start:start + rows]), together[start:start + rows])


@needs_kernels
@pytest.mark.skipif(not FIXED_POINT_PATHS, reason="no fixed-point path (AVX2, AVX-512) on this CPU")
@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(FIXED_POINT_CASES or [("", "")]), rows=st.sampled_from([1, 2, 3, 5, 8, 9, 17, 40]),
       blocks=st.integers(1, 19), seed=st.integers(0, 2**16), spread=st.sampled_from([1.0, 1e-3, 1e3]))
def test_fixed_point_products_are_the_file_weights_times_activations_in_16_bit_fixed_point(
        case, rows, blocks, seed, spread):
    """AVX2's Q4_0, Q4_1 and Q8_0 products and AVX-512's Q4_0 and Q4_1 round each activation to 16-bit fixed point
    per block of 32 (x = sx * round(x / sx), sx = max|x| / 32767) and nothing else: the output is sum_k (d q_k) *
    rounded(x_k) + m * sum_k x_k with the file's own d, m (Q4_0: -8d, Q8_0: 0) and quants, up to float32 summation
    order (a last run of fewer than 8 blocks, or an odd last block, is filled with zeros; rows with an outlier 1000x
    their others keep their small values' share within the rounding)."""
    isa, fmt = case
    width = blocks * 32
    stored, weight = _stored(fmt, 11, width, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * spread
    x[:, 0] *= 1000.0  # an outlier in each row's first block
    largest = x.abs().reshape(rows, blocks, 32).amax(dim=2).repeat_interleave(32, dim=1)
    # 32767 / largest correctly rounded (numpy's float32 division: torch's may multiply by a reciprocal, a step off
    # at some values), then x times it in float32 to the nearest integer (ties to even), as the kernel rounds
    inverse = torch.from_numpy(np.float32(32767.0) / largest.numpy())
    rounded = torch.round(x * inverse)
    m = _block_mins(stored)
    want = (rounded.double() * _block_scales(x).double()) @ (weight.double() - m).t() + x.double() @ m.t()
    got = GgufMatrix([stored], None, kernels, isa)(x).double()
    order = _split_bound(x, weight, m) - _rounding_bound(x, weight.double() - m)
    assert torch.all((got - want).abs() <= order + 1e-6 * want.abs()), (got - want).abs().max()
    exact = x.double() @ weight.double().t()
    assert torch.all((got - exact).abs() <= _split_bound(x, weight, m) + 1e-6 * exact.abs())


@needs_kernels
@pytest.mark.skipif(not FIXED_POINT_PATHS, reason="no fixed-point path (AVX2, AVX-512) on this CPU")
@pytest.mark.parametrize("case", FIXED_POINT_CASES)
def test_float32_activations_keep_the_fixed_point_products_within_float_summation_order(case, monkeypatch):
    """Under DECODEKIT_GGUF_ACTIVATIONS=float32 the AVX2 and AVX-512 paths multiply the activations as they are:
    within float32 summation order of the exact product where an outlier makes the fixed-point rounding of the other
    values (a step of max|x| / 32767) move the output far beyond it."""
    isa, fmt = case
    stored, weight = _stored(fmt, 9, 96, seed=5)
    x = torch.randn(4, 96)
    x[:, 0] = 3e4
    exact = x.double() @ weight.double().t()
    fixed = GgufMatrix([stored], None, kernels, isa)(x).double()
    monkeypatch.setenv("DECODEKIT_GGUF_ACTIVATIONS", "float32")
    matrix = GgufMatrix([stored], None, kernels, isa)
    assert matrix.float_activations
    got = matrix(x).double()
    assert torch.all((got - exact).abs() <= _bound(x, weight) + 1e-6 * exact.abs())
    assert not torch.all((fixed - exact).abs() <= _bound(x, weight) + 1e-6 * exact.abs())
    gate_up, _ = kernels.quant.gated(x, (stored.data, fmt), (stored.data, fmt), isa, float_activations=True)
    assert torch.equal(gate_up[:, :9], got.float())


@needs_kernels
@pytest.mark.skipif(not {"avx2", "avx512"} <= set(ISAS), reason="needs the AVX2 and AVX-512 paths (an AVX-512 CPU)")
@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(GROUPED)), blocks=st.integers(1, 27), out_rows=st.integers(1, 21),
       rows=st.sampled_from([2, 3, 4, 5, 7, 8, 9, 16, 23]), bias=st.booleans(), residual=st.booleans(),
       seed=st.integers(0, 2**16))
def test_avx512_fixed_point_q4_rows_are_batch_invariant_and_avx2s_up_to_summation_order(
        fmt, blocks, out_rows, rows, bias, residual, seed):
    """AVX-512's Q4_0 and Q4_1 products (512-bit integer tiles over quads of blocks, `vpdpwssd` where the CPU has
    VNNI) sum AVX2's fixed-point terms in an order of their own, the same in every tile: each row alone gives the
    bits it gives in the batch (whole runs of 8 blocks and a shorter last run of 1-7: a masked load, a half-empty
    quad; 1-4 activation rows by 2 weight rows, up to 8 by 1, an odd last weight row; stacked parts and the gate/up
    product), and every output is AVX2's within float32 summation order of the two sums; an activation block holding
    an infinity or a NaN makes the outputs it reaches NaN (or infinite) on both paths."""
    width = 32 * blocks
    stored, weight = _stored(fmt, out_rows, width, seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * torch.rand(rows, 1, generator=generator) * 10
    poisoned = seed % 5 == 0
    if poisoned:
        x[rows // 2, (seed // 5) % width] = float("inf") if seed % 2 else float("nan")
    b = torch.randn(out_rows, generator=generator) if bias else None
    res = torch.randn(rows, out_rows, generator=generator) if residual else None
    outputs = {}
    for isa in ("avx2", "avx512"):
        matrix = GgufMatrix([stored, stored], None if b is None else torch.cat([b, b]), kernels, isa)
        assert matrix.formats == (GROUPED[fmt], GROUPED[fmt])
        blocks_laid_out = matrix.parts[0][2]
        pair = (blocks_laid_out, GROUPED[fmt])
        gate_up, _ = kernels.quant.gated(x, pair, pair, isa)
        out = torch.empty(rows, out_rows)
        kernels.quant.linear(x, blocks_laid_out, GROUPED[fmt], out, 0, b, res, isa)
        outputs[isa] = (matrix(x), gate_up, out)
        for row in range(rows):
            alone = torch.empty(1, out_rows)
            kernels.quant.linear(x[row:row + 1], blocks_laid_out, GROUPED[fmt], alone, 0, b,
                                 None if res is None else res[row:row + 1], isa)
            assert torch.equal(alone.nan_to_num(1.5, 2.5, -2.5), out[row:row + 1].nan_to_num(1.5, 2.5, -2.5)), isa
        gate, up = (half.nan_to_num(1.5, 2.5, -2.5) for half in gate_up.split(out_rows, dim=1))
        assert torch.equal(gate, up)
    mins = _block_mins(stored)
    bound = 2 * _split_bound(x, weight, mins) - 2 * _rounding_bound(x, weight.double() - mins) + 1e-30
    stacked = torch.cat([bound, bound], dim=1)
    for avx2, avx512, allowed in zip(outputs["avx2"], outputs["avx512"], (stacked, stacked, bound), strict=True):
        finite = avx2.isfinite()
        assert torch.equal(finite, avx512.isfinite()) and torch.equal(avx2.isnan(), avx512.isnan())
        extra = 0 if b is None and res is None else 1e-6 * avx2.abs()[finite].double()
        assert torch.all((avx2 - avx512).abs()[finite].double() <= allowed.expand_as(avx2)[finite] + extra)


@needs_kernels
def test_the_paths_agree_up_to_summation_order():
    stored, weight = _stored("Q6_K", 9, 512, seed=2)
    x = torch.randn(3, 512)
    results = [GgufMatrix([stored], None, kernels, isa)(x) for isa in ISAS]
    for result in results[1:]:
        assert torch.all((result - results[0]).abs().double() <= 2 * _bound(x, weight))


def test_a_row_that_is_not_whole_blocks_or_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match="'Q5_0'"):
        row_bytes("Q5_0", 64)


@needs_kernels
def test_operands_that_do_not_fit_are_refused_before_the_kernel_reads_them():
    stored, _ = _stored("Q8_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.quant.linear(torch.randn(2, 32), stored.data, "Q8_0", torch.empty(2, 4))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.quant.linear(torch.randn(2, 64), stored.data, "Q8_0", torch.empty(2, 4), start=1)
    with pytest.raises(ValueError, match="share their input width"):
        GgufMatrix([stored, _stored("Q8_0", 4, 32, seed=0)[0]], None, kernels)
    seven = torch.from_numpy(random_blocks("Q4_1", 7, 32, 0))  # interleaved rows come in whole groups of 8
    with pytest.raises(ValueError, match="does not fit"):
        kernels.quant.linear(torch.randn(2, 32), seven, INTERLEAVED_Q4_1, torch.empty(2, 7))
    with pytest.raises(ValueError, match="not 7 Q4_1x8 rows"):
        kernels.quant.gated(torch.randn(2, 32), (seven, INTERLEAVED_Q4_1), (seven, INTERLEAVED_Q4_1))


@needs_kernels
def test_an_unknown_or_missing_code_path_is_refused_naming_where_it_was_asked(monkeypatch):
    monkeypatch.setenv(ISA_VARIABLE, "neon")
    with pytest.raises(ValueError, match=f"{ISA_VARIABLE}='neon'"):
        kernels.quant.isa()
    with pytest.raises(ValueError, match="isa='sve'"):
        kernels.quant.isa("sve")
    monkeypatch.setenv(ISA_VARIABLE, "portable")
    assert kernels.quant.isa() == "portable"


@needs_kernels
def test_the_variable_forces_a_lower_path_for_matrices_built_after_it(monkeypatch):
    monkeypatch.setenv(ISA_VARIABLE, "portable")
    stored, _ = _stored("Q4_0", 4, 32, seed=0)
    assert GgufMatrix([stored], None, kernels).isa == "portable"
    assert row_bytes("Q4_0", 32) == stored.data.shape[1]


@needs_kernels
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 9), inter=st.sampled_from([8, 96, 520, 1536]), formats=st.tuples(
    st.sampled_from([*FORMATS, INTERLEAVED_Q4_1]), st.sampled_from([*FORMATS, INTERLEAVED_Q4_1])),
    seed=st.integers(0, 2**16))
def test_the_gated_gate_up_product_equals_the_product_then_silu_gating_bit_for_bit(rows, inter, formats, seed):
    # each thread multiplies the same rows of the gate and the up parts and gates them itself (the layer stack's
    # GGUF path): the values of the parts' products, then dk_silu_mul; 1536 rows split over both threads
    assert not isinstance(kernels, str)
    width = 256
    (gate, _), (up, _) = _stored(formats[0], inter, width, seed), _stored(formats[1], inter, width, seed + 1)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    for isa in ISAS:
        want = torch.empty(rows, 2 * inter)
        kernels.quant.linear(x, gate.data, formats[0], want, 0, isa=isa)
        kernels.quant.linear(x, up.data, formats[1], want, inter, isa=isa)
        gate_up, gated = kernels.quant.gated(x, (gate.data, formats[0]), (up.data, formats[1]), isa=isa)
        assert torch.equal(gate_up, want), isa
        assert torch.equal(gated, kernels.silu_mul(want)), isa


# ---- Q4_1 interleaved by 8 rows (`Q4_1x8`: the AVX2 path's opt-in layout for batch-1 decoding) ----------------------


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_interleaved_q4_1_blocks_dequantize_to_exactly_the_q4_1_weights_they_regroup_on_every_path(isa):
    for rows, width in ((8, 32), (24, 96), (16, 1536)):
        stored, want = _stored(INTERLEAVED_Q4_1, rows, width, seed=rows)
        assert torch.equal(kernels.quant.dequantize(stored.data, INTERLEAVED_Q4_1, width, isa), want)
    with pytest.raises(ValueError, match="whole groups of 8"):
        interleave_q4_1(torch.from_numpy(random_blocks("Q4_1", 7, 32, 0)))


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(isa=st.sampled_from(ISAS),
       rows=st.one_of(st.integers(1, 20), st.integers(GGUF_NATIVE_MAX_ROWS - 1, GGUF_NATIVE_MAX_ROWS + 2)),
       blocks=st.integers(1, 3), groups=st.lists(st.integers(1, 3), min_size=1, max_size=3), bias=st.booleans(),
       residual=st.booleans(), seed=st.integers(0, 2**16))
def test_the_interleaved_product_is_the_float_product_of_the_q4_1_weights(isa, rows, blocks, groups, bias, residual,
                                                                          seed):
    """One to three stacked parts of 8-24 rows, 1 to 3 blocks a row, rows on both sides of GGUF_NATIVE_MAX_ROWS."""
    _assert_the_float_product(INTERLEAVED_Q4_1, [8 * n for n in groups], 32 * blocks, isa, rows, bias, residual, seed)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_an_interleaved_rows_product_does_not_depend_on_the_rows_multiplied_with_it(isa):
    """One activation row, two in a tile and an odd one after them sum each output in one order: a row alone and in
    any batch agree bit for bit (speculative verification gives decoding's logits)."""
    stored, _ = _stored(INTERLEAVED_Q4_1, 40, 96, seed=5)
    matrix = GgufMatrix([stored], None, kernels, isa)
    x = torch.randn(41, 96)
    together = matrix(x)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        for start in range(0, x.shape[0] - rows + 1, 7):
            assert torch.equal(matrix(x[start:start + rows]), together[start:start + rows])


@needs_kernels
def test_q4_1_is_interleaved_only_when_asked_on_the_avx2_path_and_for_whole_groups_of_8(monkeypatch):
    eight, _ = _stored("Q4_1", 16, 64, seed=1)
    seven, _ = _stored("Q4_1", 7, 64, seed=1)
    q8, _ = _stored("Q8_0", 16, 64, seed=1)
    assert laid_out_for(eight, "avx2")[0] == GROUPED["Q4_1"]  # off by default: grouped instead
    monkeypatch.setenv(INTERLEAVE_VARIABLE, "on")
    fmt, blocks = laid_out_for(eight, "avx2")
    assert fmt == INTERLEAVED_Q4_1 and torch.equal(blocks, interleave_q4_1(eight.data))
    assert eight.format == "Q4_1" and not torch.equal(blocks, eight.data)  # a copy: the stored weight is untouched
    assert laid_out_for(eight, "portable")[0] == "Q4_1" and laid_out_for(eight, "avx512")[0] == GROUPED["Q4_1"]
    assert laid_out_for(seven, "avx2")[0] == GROUPED["Q4_1"] and laid_out_for(q8, "avx2")[0] == "Q8_0"


# ---- Q4_0 and Q4_1 grouped by runs of 8 blocks (`Q4_0g`, `Q4_1g`: the fixed-point products' layout) -----------------


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(sorted(GROUPED)), blocks=st.integers(1, 19), out_rows=st.integers(1, 40),
       rows=st.integers(1, 20), bias=st.booleans(), residual=st.booleans(), float_activations=st.booleans(),
       seed=st.integers(0, 2**16))
def test_grouped_blocks_multiply_and_dequantize_to_the_stored_blocks_bits_on_every_path(
        fmt, blocks, out_rows, rows, bias, residual, float_activations, seed):
    """Whole runs of 8 blocks and a shorter last run (odd or even), every row count of the tiles (1 activation row by
    2 weight rows, up to 8 by 1), both activations: the grouped layout's outputs are the stored layout's bit for bit
    (the AVX2 fixed-point tiles read the same values into the same registers; every other path multiplies each row
    back in the file's layout)."""
    assert not isinstance(kernels, str)
    width = 32 * blocks
    stored, want = _stored(fmt, out_rows, width, seed)
    grouped = group_blocks(stored.data, fmt)
    assert grouped.shape == stored.data.shape and (blocks == 1 or not torch.equal(grouped, stored.data))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    bias_row = torch.randn(out_rows, generator=generator) if bias else None
    residual_rows = torch.randn(rows, out_rows, generator=generator) if residual else None
    for isa in ISAS:
        assert torch.equal(kernels.quant.dequantize(grouped, GROUPED[fmt], width, isa), want), isa
        outputs = []
        for blocks_laid_out, laid_out_fmt in ((stored.data, fmt), (grouped, GROUPED[fmt])):
            out = torch.empty(rows, out_rows)
            kernels.quant.linear(x, blocks_laid_out, laid_out_fmt, out, 0, bias_row, residual_rows, isa,
                                 float_activations)
            outputs.append(out)
        assert torch.equal(outputs[0], outputs[1]), (isa, float_activations)
    gate_up, gated = kernels.quant.gated(x, (grouped, GROUPED[fmt]), (stored.data, fmt))
    want_up = torch.empty(rows, 2 * out_rows)
    kernels.quant.linear(x, stored.data, fmt, want_up, 0)
    kernels.quant.linear(x, stored.data, fmt, want_up, out_rows)
    assert torch.equal(gate_up, want_up) and torch.equal(gated, kernels.silu_mul(want_up))


@needs_kernels
def test_q4_rows_are_grouped_only_for_the_fixed_point_products(monkeypatch):
    q4_0, _ = _stored("Q4_0", 4, 96, seed=2)
    q4_1, _ = _stored("Q4_1", 4, 96, seed=2)
    q8, _ = _stored("Q8_0", 4, 96, seed=2)
    fmt, blocks = laid_out_for(q4_1, "avx2")
    assert fmt == "Q4_1g" and torch.equal(blocks, group_blocks(q4_1.data, "Q4_1"))
    assert laid_out_for(q4_0, "avx2")[0] == "Q4_0g" and laid_out_for(q8, "avx2")[0] == "Q8_0"
    assert q4_1.format == "Q4_1" and not torch.equal(blocks, q4_1.data)  # a copy: the stored weight is untouched
    assert laid_out_for(q4_1, "portable")[0] == "Q4_1" and laid_out_for(q4_1, "avx512")[0] == "Q4_1g"
    monkeypatch.setenv(ACTIVATIONS_VARIABLE, "float32")
    assert laid_out_for(q4_1, "avx2")[0] == laid_out_for(q4_1, "avx512")[0] == "Q4_1"
    with pytest.raises(ValueError, match="only Q4_0 and Q4_1 rows are grouped"):
        group_blocks(q8.data, "Q8_0")


def test_grouping_a_q4_1_row_puts_each_8_blocks_scales_then_mins_before_their_quants():
    blocks = 11  # a run of 8, then a run of 3
    row = torch.arange(20 * blocks, dtype=torch.int32).reshape(1, -1)  # block b's bytes: 20 b .. 20 b + 19
    grouped = group_blocks((row % 256).to(torch.uint8), "Q4_1")[0].tolist()
    want: list[int] = []
    for first, n in ((0, 8), (8, 3)):
        run = range(first, first + n)
        want += [v for b in run for v in (20 * b, 20 * b + 1)]  # the run's fp16 scales
        want += [v for b in run for v in (20 * b + 2, 20 * b + 3)]  # then its fp16 mins
        want += [v for b in run for v in range(20 * b + 4, 20 * b + 20)]  # then its blocks' 16 quant bytes each
    assert grouped == [v % 256 for v in want]
    q4_0 = group_blocks(torch.arange(36, dtype=torch.uint8).reshape(1, 36), "Q4_0")[0].tolist()
    assert q4_0 == [0, 1, 18, 19, *range(2, 18), *range(20, 36)]
