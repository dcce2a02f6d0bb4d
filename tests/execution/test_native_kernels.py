"""The native kernels: same results as the torch ops they replace, cached builds that cannot be planted, and a clean
fallback."""

from __future__ import annotations

import copy
import hashlib
import os
import random
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.execution.fused.decoder import _rms_norm, _rotate
from decodekit.execution.kernels import native as native_kernels
from decodekit.execution.kernels.native import (
    DecodeAttentionPlan,
    NativeKernels,
    build_library,
    find_compiler,
    library_path,
    load_kernels,
)
from tests.helpers.reference import hf_greedy, random_prompts

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler (cc, gcc or clang) on PATH")


@pytest.fixture
def fresh_load():
    """`load_kernels` forgets its per-process answer before and after the test."""
    native_kernels.load_kernels.cache_clear()
    yield
    native_kernels.load_kernels.cache_clear()


@pytest.fixture
def broken_cc(tmp_path, monkeypatch):
    """A `$CC` that always fails: a reason naming it proves the build was tried, one without it that it was not."""
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'kernels.c: error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    return str(broken)


def _compile(folder: Path, name: str, code: str) -> Path:
    """A shared library built from C `code` with the machine's compiler."""
    source, library = folder / f"{name}.c", folder / f"{name}.so"
    source.write_text(code)
    subprocess.run([find_compiler(), "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                   capture_output=True)
    return library


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def native():
    loaded = load_kernels()
    assert not isinstance(loaded, str), f"the native kernels must build on this machine: {loaded}"
    return loaded


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), width=st.sampled_from([7, 64, 576, 1000]), scale=st.floats(1e-3, 1e3),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
def test_native_rms_norm_matches_transformers_to_the_last_bits(native, rows, width, scale, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, width, generator=g) * scale, torch.randn(width, generator=g)
    # The mean of squares is summed in another order than torch's; the two roundings after it can carry that
    # to a few ulps (float32 ulps are 6e-8 to 1.2e-7 relative).
    torch.testing.assert_close(native.rms_norm(x, weight, eps), _rms_norm(x, weight, eps), rtol=5e-7, atol=0)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 80), width=st.sampled_from([3, 64, 576]), inter=st.sampled_from([5, 64, 1536]),
       bias=st.booleans(), residual=st.booleans(), special=st.booleans(), seed=st.integers(0, 2**16))
def test_the_bf16_step_kernels_round_and_widen_exactly_as_the_separate_conversions_do(native, rows, width, inter,
                                                                                    bias, residual, special, seed):
    # A step on bf16 products rounds the norms' and the gating's outputs to bf16 and widens the products' outputs
    # inside those kernels: bit for bit what converting with torch before and after them gives, ties, infinities and
    # NaNs included (`special`), at any row count (the gating splits rows over threads from 64K elements).
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, width, generator=g) * 3, torch.randn(width, generator=g)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    if special:  # a bf16 tie (1 + 2^-8 rounds to even), and an infinity and a NaN in the last row
        x[0, 0], x[-1, 0], x[-1, -1] = 1.0 + 2**-8, float("inf"), float("nan")
        weight[0] = 1.0
        gate_up[0, 0], gate_up[-1, -1] = float("nan"), float("inf")

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:  # bit for bit, any NaN standing for any NaN
        return got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))

    assert same(native.rms_norm(x, weight, 1e-5, bf16_out=True), native.rms_norm(x, weight, 1e-5).to(torch.bfloat16))
    assert same(native.silu_mul(gate_up), native.silu_mul(gate_up.to(torch.float32)).to(torch.bfloat16))
    product = (torch.randn(rows, width, generator=g) * 5).to(torch.bfloat16)
    b = torch.randn(width, generator=g) if bias else None
    r = torch.randn(rows, width, generator=g) if residual else None
    want_sum = product.to(torch.float32)
    if b is not None:
        want_sum = want_sum + b
    if r is not None:
        want_sum = want_sum + r
    assert torch.equal(native.widen_add(product, b, r).view(torch.int32), want_sum.view(torch.int32))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), inter=st.sampled_from([5, 64, 1536]), seed=st.integers(0, 2**16))
def test_native_silu_gating_matches_torch(native, rows, inter, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(native.silu_mul(gate_up), want, rtol=1e-6, atol=1e-7)


def _reference_attention(queries, keys, values, scale, softcap=None, bf16_dot=False):
    """softmax(q k^T * scale) v in float64 for one query head over its keys (scores soft-capped by `softcap`); with
    `bf16_dot`, the query and the probabilities rounded to bf16 first, as the bf16 dot-product path rounds them."""
    if bf16_dot:
        queries = queries.to(torch.bfloat16)
    scores = (queries.double() @ keys.double().T) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores, dim=-1)
    if bf16_dot:
        probs = probs.float().to(torch.bfloat16)
    return (probs.double() @ values.double()).float()


@pytest.fixture(scope="module")
def attention_builds(native, tmp_path_factory):
    """The library as each kind of CPU this one can stand for compiles it: this CPU's build, and on an x86-64 CPU with
    AVX-512 also the AVX2 + FMA build (8-key tiles) and the build without either (key by key only), so every
    attention path is tested on whichever machine runs the suite."""
    import platform

    builds = [native]
    compiler = find_compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64") or native.attention_tile != 16:
        return builds
    folder = tmp_path_factory.mktemp("builds")
    for name, flags in (("avx2", ["-march=native", "-mno-avx512f"]), ("scalar", ["-mno-avx2", "-mno-fma"])):
        library = folder / f"{name}.so"
        subprocess.run([compiler, "-O2", *flags, "-ffp-contract=off", "-fPIC", "-shared", "-std=c11", "-fopenmp",
                        "-o", str(library), *map(str, native_kernels.SOURCES), "-lm"], check=True, capture_output=True)
        builds.append(NativeKernels(library))
    assert [b.attention_tile for b in builds] == [16, 8, 0]
    return builds


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3]),
       dim=st.sampled_from([8, 64, 72, 128]), query_lens=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       contexts=st.lists(st.integers(0, 40), min_size=4, max_size=4), max_query=st.sampled_from([2, 16]),
       kv_dtype=st.sampled_from([torch.float32, torch.bfloat16]), window=st.sampled_from([None, 1, 3, 17]),
       softcap=st.sampled_from([None, 0.5, 5.0]), tiled=st.booleans(), build=st.integers(0, 2),
       bf16_dot=st.booleans(), chunk_max_keys=st.sampled_from([0, 8, 30, 1 << 20]), seed=st.integers(0, 2**16))
def test_native_rope_write_and_attention_match_torch_for_any_paged_layout(attention_builds, block_size, kv_heads, group,
                                                                          dim, query_lens, contexts, max_query,
                                                                          kv_dtype, window, softcap, tiled, build,
                                                                          bf16_dot, chunk_max_keys, seed):
    # Sequences with more than `max_query` new tokens stand for prefill chunks: those of more than `chunk_max_keys`
    # keys in all are rotated and stored, not attended (SDPA's); shorter ones are attended like any query.
    # A bfloat16 pool (`kv_cache_dtype`) must hold exactly torch's rounding of the keys and values, and attention
    # must be the float32 attention over those stored values; with a sliding `window`, over the last `window` keys;
    # with a `softcap` (Gemma 2), of capped scores. Every attention path: tiles of 16 keys (AVX-512) or 8 (AVX2 + FMA)
    # for head sizes that are a multiple of the tile, and key by key (every CPU), in each build this CPU can run.
    _check_attention(attention_builds[build % len(attention_builds)], block_size, kv_heads, group, dim, query_lens,
                     contexts, max_query, kv_dtype, window, softcap, tiled, bf16_dot, seed, chunk_max_keys)


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([1, 16]), kv_heads=st.sampled_from([1, 3]), group=st.sampled_from([1, 2, 3, 4, 5, 8]),
       dim=st.sampled_from([32, 64, 128]), query_lens=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       contexts=st.lists(st.integers(0, 70), min_size=4, max_size=4), window=st.sampled_from([None, 5, 33]),
       softcap=st.sampled_from([None, 5.0]), seed=st.integers(0, 2**16))
def test_bf16_dot_attention_is_the_attention_of_bf16_rounded_queries_and_probabilities(
        native, block_size, kv_heads, group, dim, query_lens, contexts, window, softcap, seed):
    # On an AVX512-BF16 CPU (vdpbf16ps) a bf16 pool under bf16 arithmetic is attended on bf16 dot products: each
    # output is the attention of the bf16-rounded query and bf16-rounded probabilities over the stored keys and
    # values, for any group size (query heads per kv head, taken four at a time), odd key counts and windows.
    if not native.dot_attention_max_dim:
        pytest.skip("this CPU has no bf16 dot products (AVX512-BF16): the path is not built")
    _check_attention(native, block_size, kv_heads, group, dim, query_lens, contexts, 16, torch.bfloat16, window,
                     softcap, True, True, seed)


def _check_attention(native, block_size, kv_heads, group, dim, query_lens, contexts, max_query, kv_dtype, window,
                     softcap, tiled, bf16_dot, seed, chunk_max_keys=0):
    """Run `rope_cache_attend` on a random paged layout; hold its writes, rotated queries and attention to torch.

    `bf16_dot` on a bf16 pool, in a build for AVX512-BF16, on the tiled path, for head sizes that are a multiple of
    32: the attention of the query and probabilities rounded to bf16 (products summed in float32); everywhere else
    the flag changes nothing."""
    dot = (bf16_dot and kv_dtype == torch.bfloat16 and tiled and dim % 32 == 0
           and dim <= native.dot_attention_max_dim)
    heads = kv_heads * group
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    contexts = contexts[: len(query_lens)]
    need = [-(-(c + q) // block_size) for c, q in zip(contexts, query_lens)]
    block_ids = rng.sample(range(sum(need) + 8), sum(need))  # scattered, non-consecutive blocks
    tables, start = [], 0
    for n in need:
        tables.append(block_ids[start:start + n])
        start += n
    num_slots = (sum(need) + 8) * block_size
    key_pool, value_pool = (torch.randn(num_slots, kv_heads, dim, generator=g).to(kv_dtype) for _ in range(2))
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, q in zip(tables, contexts, query_lens) for p in range(c, c + q)]
    tokens = len(slots)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g)

    # torch: RoPE exactly as the fused decoder does it, then the write
    qk, value = qkv.view(tokens, -1, dim).split([heads + kv_heads, kv_heads], dim=1)
    query, key = _rotate(qk, cos[:, None], sin[:, None]).split([heads, kv_heads], dim=1)
    want_keys, want_values = key_pool.clone(), value_pool.clone()
    want_keys[slots], want_values[slots] = key.to(kv_dtype), value.to(kv_dtype)

    plan = DecodeAttentionPlan(torch.tensor(slots), query_lens, contexts, tables, block_size, max_query=max_query,
                               chunk_max_keys=chunk_max_keys)
    left = [q > max_query and c + q > chunk_max_keys for c, q in zip(contexts, query_lens)]
    firsts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    assert plan.chunks_left == {first for first, out in zip(firsts, left) if out}
    assert plan.has_chunks == any(left)
    plan.set_rope(cos, sin)
    rotated = qkv.clone()
    out = native.rope_cache_attend(rotated, heads, kv_heads, key_pool, value_pool, plan, 0.3, window, softcap, tiled,
                                   bf16_dot)

    assert torch.equal(key_pool, want_keys), "rotated keys must land bit-exactly at their slots"
    assert torch.equal(value_pool, want_values)
    assert torch.equal(rotated.view(tokens, -1, dim)[:, :heads], query), "queries are rotated in place, bit-exactly"
    out = out.view(tokens, heads, dim)
    token = 0
    for table, ctx, q_len, out_of_plan in zip(tables, contexts, query_lens, left):
        order = [table[p // block_size] * block_size + p % block_size for p in range(ctx + q_len)]
        if out_of_plan:
            token += q_len
            continue
        for j in range(q_len):
            seen = order[: ctx + j + 1]  # causal: its own context plus this step's earlier tokens
            seen = seen[-window:] if window else seen
            for h in range(heads):
                want = _reference_attention(query[token, h][None], want_keys[seen, h // group].float(),
                                            want_values[seen, h // group].float(), 0.3, softcap, dot)[0]
                # the dot path: a probability within float32 rounding of a bf16 tie may round the other way (one
                # bf16 step, 2^-8 of it)
                tolerance = 4e-3 if dot else 1e-5
                torch.testing.assert_close(out[token, h], want, rtol=tolerance, atol=tolerance)
            token += 1


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 120), out=st.integers(1, 700), rows=st.integers(1, 28),
       bias=st.booleans(), residual=st.booleans(), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_the_few_row_product_is_float32_accurate_and_the_same_on_any_thread_count_and_batch(
        native, width, out, rows, bias, residual, threads, seed):
    """`dk_gemv` on a row-major `[out, in]` weight, up to its build's rows (24 built for AVX2, 8 for AVX-512; more
    are refused): widths off the 32- and 16-wide steps (scalar tails), output counts that split unevenly over
    threads; every output summed in the same order whichever thread owns it and whichever rows it is multiplied with
    (groups of rows beyond the registers included, and AVX2's tiles of 3 weight rows by 4 activation rows from 13
    rows, each output's two chains one after the other)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=g)
    x = torch.randn(rows, width, generator=g)
    if rows > native.gemv_max_rows:
        with pytest.raises(ValueError, match=f"gemv takes 1-{native.gemv_max_rows} rows"):
            native.gemv(x, weight)
        return
    b = torch.randn(out, generator=g) if bias else None
    res = torch.randn(rows, out, generator=g) if residual else None
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = native.gemv(x, weight, b, res)
        torch.set_num_threads(1)
        alone = torch.cat([native.gemv(x[m:m + 1], weight, b, None if res is None else res[m:m + 1])
                           for m in range(rows)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, alone), "each row as computed alone, on one thread"
    want = x.double() @ weight.double().t()
    scale = x.abs().double() @ weight.abs().double().t() + 1.0
    if bias:
        want += b.double()
        scale += b.abs().double()
    if residual:
        want += res.double()
        scale += res.abs().double()
    assert torch.all((got.double() - want).abs() <= 2 * (width + 2) * 2**-24 * scale)


def test_the_few_row_product_refuses_what_its_layout_does_not_take(native):
    with pytest.raises(ValueError, match="contiguous \\[out, in\\] weight"):
        native.gemv(torch.randn(1, 8), torch.randn(6, 16)[:, ::2])  # strided
    most = native.gemv_max_rows
    with pytest.raises(ValueError, match=f"1-{most} rows of 8 floats"):
        native.gemv(torch.randn(most + 1, 8), torch.randn(5, 8))
    with pytest.raises(ValueError, match=f"1-{most} rows of 5 floats"):
        native.gemv(torch.randn(2, 8), torch.randn(8, 5))  # the weight's inputs must match the rows' width


def test_a_bf16_pool_stores_ties_infinities_and_nans_as_torch_rounds_them(native):
    """Values are written unrotated, so their bits can be chosen: ties to even (up and down), the largest floats
    (rounding to infinity or not), infinities, NaNs and subnormals, next to random floats: every bit as torch's
    rounding, except a NaN's payload."""
    dim, kv_heads, heads = 16, 1, 1
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF, 0x7F800000,
            0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001, 0x80008000, 0x00018000, 0x00000000]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    values = torch.stack([special, torch.randn(dim) * 1e3])
    qkv = torch.zeros(2, (heads + 2 * kv_heads) * dim)
    qkv[:, (heads + kv_heads) * dim:] = values
    pools = [torch.zeros(8, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    plan = DecodeAttentionPlan(torch.tensor([3, 6]), [1, 1], [0, 0], [[0, 1], [1, 2]], 4, max_query=0)
    plan.set_rope(torch.ones(2, dim), torch.zeros(2, dim))
    native.rope_cache_attend(qkv, heads, kv_heads, *pools, plan, 1.0)
    stored, want = pools[1][[3, 6], 0], values.to(torch.bfloat16)
    nan = want.isnan()
    assert int(nan.sum()) == 3 and torch.equal(stored.isnan(), nan)  # NaN stays NaN (torch's payload bits vary by path)
    assert torch.equal(stored[~nan].view(torch.int16), want[~nan].view(torch.int16))


@settings(max_examples=15, deadline=None)
@given(contexts=st.lists(st.integers(0, 300), min_size=1, max_size=9), query_len=st.sampled_from([1, 2, 4]),
       threads=st.sampled_from([2, 3]), kv_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       tiled=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_split_over_threads_is_bit_identical_to_one_thread(native, contexts, query_len, threads, kv_dtype,
                                                                     tiled, seed):
    """Whatever the split of (token, kv head) items over threads, every output bit is what one thread computes."""
    block_size, kv_heads, group, dim = 16, 3, 3, 64
    heads = kv_heads * group
    g = torch.Generator().manual_seed(seed)
    tables, next_block = [], 0
    for ctx in contexts:
        need = -(-(ctx + query_len) // block_size)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    slots = [t[p // block_size] * block_size + p % block_size for t, c in zip(tables, contexts)
             for p in range(c, c + query_len)]
    pools = [torch.randn(next_block * block_size, kv_heads, dim, generator=g).to(kv_dtype) for _ in range(2)]
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(len(slots), dim, generator=g), torch.randn(len(slots), dim, generator=g)

    def attend(min_keys: int, torch_threads: int) -> torch.Tensor:
        plan = DecodeAttentionPlan(torch.tensor(slots), [query_len] * len(contexts), contexts, tables, block_size)
        plan.set_rope(cos, sin)
        previous = torch.get_num_threads(), native_kernels.PARALLEL_MIN_KEYS
        torch.set_num_threads(torch_threads)
        native_kernels.PARALLEL_MIN_KEYS = min_keys
        try:
            return native.rope_cache_attend(qkv.clone(), heads, kv_heads, *(p.clone() for p in pools), plan, 0.125,
                                            tiled=tiled)
        finally:
            torch.set_num_threads(previous[0])
            native_kernels.PARALLEL_MIN_KEYS = previous[1]

    assert torch.equal(attend(0, threads), attend(2**62, 1))


def test_the_kernels_are_built_with_openmp_where_the_compiler_has_it(native):
    """Attention runs on torch's threads only if the library was built with OpenMP: gcc and clang have it here."""
    assert native.parallel


def unoptimised_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds in this test at -O0: what is tested is where the library is cached and which one is loaded, not its
    speed, and quant.c takes ~40 s at -O3 on a 2-core Zen 3 against ~13 s at -O0 (five such builds in this file)."""
    monkeypatch.setattr(native_kernels, "CFLAGS", ["-O0" if flag == "-O3" else flag for flag in native_kernels.CFLAGS])


def test_the_library_is_built_once_with_its_hash_recorded_privately_and_reused(native, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    unoptimised_builds(monkeypatch)
    compiler = find_compiler()
    assert compiler is not None
    first = build_library(compiler)
    stamp = first.stat().st_mtime_ns
    assert build_library(compiler) == first and first.stat().st_mtime_ns == stamp
    sidecar = first.with_name(first.name + ".sha256")
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, sidecar.name], "no partial build is left"
    assert sidecar.read_text().strip() == _sha256(first)
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(first.stat().st_mode) == 0o700 and stat.S_IMODE(sidecar.stat().st_mode) == 0o600


PLANTS = {
    "no recorded hash": lambda lib, sidecar: None,
    "a wrong recorded hash": lambda lib, sidecar: sidecar.write_text("0" * 64 + "\n"),
    "a world-writable library": lambda lib, sidecar: (sidecar.write_text(_sha256(lib)), lib.chmod(0o777)),
    "a group-writable hash": lambda lib, sidecar: (sidecar.write_text(_sha256(lib)), sidecar.chmod(0o664)),
}


@needs_compiler
@pytest.mark.parametrize("plant", [
    # each rebuilds the library (~13 s on 2 cores): two refusal paths in the default run, all four with -m slow
    pytest.param(name, marks=pytest.mark.slow) if name in ("no recorded hash", "a group-writable hash") else name
    for name in PLANTS])
def test_a_planted_library_is_never_loaded_and_the_genuine_one_is_rebuilt_and_used(plant, tmp_path, monkeypatch,
                                                                                    fresh_load):
    marker = tmp_path / "planted-constructor-ran"
    planted = _compile(tmp_path, "planted", f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
            FILE *f = fopen("{marker}", "w");
            if (f) fclose(f);
        }}
        {" ".join(f"int {name}(void) {{{{ return 0; }}}}" for name in native_kernels.SYMBOLS)}
    """)
    NativeKernels(planted)
    assert marker.exists(), "the plant is live: loading it runs its constructor"
    marker.unlink()

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    unoptimised_builds(monkeypatch)
    target = library_path(find_compiler())
    target.parent.mkdir(parents=True, mode=0o700)
    shutil.copyfile(planted, target)  # a new inode at a new path: loading it would run the constructor again
    sidecar = target.with_name(target.name + ".sha256")
    PLANTS[plant](target, sidecar)

    loaded = load_kernels()
    assert isinstance(loaded, NativeKernels) and loaded.path == target
    assert not marker.exists(), "the planted library's constructor ran"
    assert target.read_bytes() != planted.read_bytes() and sidecar.read_text().strip() == _sha256(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700 and stat.S_IMODE(sidecar.stat().st_mode) == 0o600
    x, weight = torch.randn(3, 64), torch.randn(64)
    torch.testing.assert_close(loaded.rms_norm(x, weight, 1e-6), _rms_norm(x, weight, 1e-6), rtol=5e-7, atol=0)


def test_the_cache_folder_is_created_private_even_under_an_open_umask(broken_cc, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    old = os.umask(0)
    try:
        with pytest.raises(RuntimeError, match="this compiler is broken"):
            build_library(broken_cc)
    finally:
        os.umask(old)
    folder = tmp_path / "cache" / "native"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert list(folder.iterdir()) == [], "a failed build leaves nothing behind"


def test_a_loose_cache_folder_of_ours_is_tightened_to_0700(broken_cc, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    folder = tmp_path / "native"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(RuntimeError, match="this compiler is broken"):
        build_library(broken_cc)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("why", ["owned by another user", "world-writable and cannot be tightened"])
def test_a_cache_folder_others_own_or_can_write_is_refused_and_nothing_in_it_is_loaded(why, broken_cc, tmp_path,
                                                                                        monkeypatch, fresh_load):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    target = library_path(broken_cc)
    target.parent.mkdir()
    target.write_bytes(b"not a library")  # were it loaded, ctypes would report a bad ELF header instead
    target.with_name(target.name + ".sha256").write_text(_sha256(target))
    if why == "owned by another user":
        real_uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    else:
        target.parent.chmod(0o777)

        def cannot_chmod(path, mode):
            raise PermissionError(1, "Operation not permitted", str(path))

        monkeypatch.setattr(os, "chmod", cannot_chmod)
    reason = load_kernels()
    assert isinstance(reason, str) and reason.startswith(f"refusing the kernel cache {target.parent}"), reason
    assert target.read_bytes() == b"not a library", "nothing was built into the refused folder"


@needs_compiler
def test_a_library_missing_kernel_entry_points_falls_back_with_a_reason(llama, tokenizer, tmp_path, monkeypatch,
                                                                         fresh_load):
    partial = _compile(tmp_path, "partial", "void dk_rms_norm(void) {}\n")
    missing = ("lacks the kernel entry points dk_silu_mul, dk_rope_cache_attend, dk_parallel, dk_tiled_attention, "
               "dk_dot_attention, dk_linear_i8, dk_linear_bf16, dk_gemv, dk_rms_norm_bf16, dk_silu_mul_bf16, "
               "dk_widen_add, dk_quant_linear, dk_quant_dequantize, dk_quant_isa, dk_layer_stack, dk_stack_timing, "
               "dk_stack_product_seconds, dk_stack_seconds, dk_decode_run, dk_quant_gated, dk_gemv_set_prefetch, "
               "dk_gemv_max_rows, dk_draw_row")
    with pytest.raises(RuntimeError, match=missing):
        NativeKernels(partial)  # not ctypes' AttributeError
    monkeypatch.setattr(native_kernels, "build_library", lambda compiler: partial)
    assert load_kernels() == f"partial.so {missing}"
    with pytest.raises(ConfigError, match=r"native_kernels: partial\.so lacks the kernel entry points"):
        LLM(copy.deepcopy(llama), tokenizer, device="cpu", fused_decoder=True, native_kernels=True)
    llm = LLM(copy.deepcopy(llama), tokenizer, device="cpu", fused_decoder=True)
    assert llm.engine.model.runner.fused.native is None
    prompt = random_prompts(1, 5, 20, seed=6)[0]
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].token_ids == hf_greedy(llama,
                                                                                                         prompt, 8)


def test_a_failing_compiler_is_reported_and_the_engine_keeps_torch_ops(llama, tokenizer, tmp_path, monkeypatch):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'kernels.c: error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    native_kernels.load_kernels.cache_clear()
    try:
        reason = load_kernels()
        assert isinstance(reason, str) and "this compiler is broken" in reason
        with pytest.raises(ConfigError, match=r"(?s)native_kernels: .*failed to build kernels\.c.*compiler is broken"):
            LLM(copy.deepcopy(llama), tokenizer, device="cpu", fused_decoder=True, native_kernels=True)
        llm = LLM(copy.deepcopy(llama), tokenizer, device="cpu", fused_decoder=True)
        assert llm.engine.model.runner.fused.native is None
        prompt = random_prompts(1, 5, 20, seed=5)[0]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
        assert out.token_ids == hf_greedy(llama, prompt, 10)
    finally:
        native_kernels.load_kernels.cache_clear()


def test_native_kernels_can_be_switched_off_by_environment(llama, tokenizer, monkeypatch):
    monkeypatch.setenv("DECODEKIT_NATIVE_KERNELS", "0")
    native_kernels.load_kernels.cache_clear()
    try:
        assert load_kernels() == "DECODEKIT_NATIVE_KERNELS=0"
        llm = LLM(copy.deepcopy(llama), tokenizer, device="cpu", fused_decoder=True)
        assert llm.engine.model.runner.fused.native is None
    finally:
        native_kernels.load_kernels.cache_clear()


def test_a_plan_refuses_a_block_table_too_short_for_its_tokens():
    with pytest.raises(ValueError, match="a block table of 2 blocks cannot hold 9 tokens"):
        DecodeAttentionPlan(torch.tensor([8]), [1], [8], [[0, 1]], block_size=4)


def test_native_kernels_without_the_fused_decoder_run_the_models_own_re_laid_linears(llama, tokenizer):
    """A model object passed in is not fused by default; `native_kernels: true` then re-lays its linear layers
    (tests/execution/test_relaid_linears.py) rather than refusing."""
    model = copy.deepcopy(llama)
    llm = LLM(model, tokenizer, device="cpu", native_kernels=True, kv_cache_memory="4MiB")
    assert llm.engine.model.runner.fused is None and "linear layers re-laid" in llm.engine.model.forward_name
    prompt = [5, 9, 13, 21]
    assert llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].token_ids == \
        hf_greedy(llama, prompt, 6)


def test_native_kernels_refuse_float16_with_a_reason(llama, tokenizer):
    """(A bfloat16 model runs them, as bf16 weights: tests/execution/test_bf16_weights.py.)"""
    with pytest.raises(ConfigError, match=r"native_kernels: they run float32 on a CPU, not torch\.float16"):
        LLM(copy.deepcopy(llama), tokenizer, device="cpu", dtype="float16", fused_decoder=True,
            native_kernels=True)
    llm = LLM(copy.deepcopy(llama), tokenizer, device="cpu", dtype="float16", fused_decoder=True)
    assert llm.engine.model.runner.fused.native is None
