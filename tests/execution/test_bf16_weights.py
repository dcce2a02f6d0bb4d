"""bf16 weights in the fused decoder (`quantization="bf16"`): the product is the float32 product of the bf16-rounded
weight, a bf16 target is transformers on the bf16-rounded float32 model token for token, a bf16 copy of the target
drafts losslessly, and asking for it where it cannot run is refused with the option named."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.execution.fused.weight_matrices import (
    BF16_GEMM_MIN_ROWS,
    BF16_NATIVE_MAX_ROWS,
    Bf16Matrix,
    onednn_bf16_available,
)
from decodekit.execution.kernels.native import (
    PANEL,
    DecodeAttentionPlan,
    load_kernels,
    pack_bf16_panels,
    pack_int8_panels,
)
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import hf_greedy, hf_greedy_bf16_cache, random_prompts

kernels = load_kernels()
needs_kernels = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")


def _rounded(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.bfloat16).to(torch.float32)


def test_panels_hold_each_output_rows_bf16_weights_input_by_input_with_zero_rows_past_the_end():
    weight = torch.randn(37, 11)
    panels = pack_bf16_panels(weight)
    assert panels.shape == (3, 11, PANEL) and panels.dtype == torch.bfloat16 and panels.is_contiguous()
    for row in (0, 15, 16, 36):
        assert torch.equal(panels[row // PANEL, :, row % PANEL], weight[row].to(torch.bfloat16))
    assert not panels[2, :, 5:].any()  # rows 37..47 do not exist


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 2 * BF16_NATIVE_MAX_ROWS + 3), width=st.integers(1, 70), out=st.integers(1, 70),
       bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_product_is_the_float32_product_of_the_bf16_rounded_weight(rows, width, out, bias, residual, seed):
    """Native rows (up to BF16_NATIVE_MAX_ROWS: tiles of 4 panels x 1 row, 2 x 2, 1 x 1-4) and the blockwise BLAS
    path beyond; output counts that are not a multiple of 16 end in a padded panel. Widening bf16 is exact, so the
    only error is float32 summation order."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=g)
    matrix = Bf16Matrix(weight, torch.randn(out, generator=g) if bias else None, kernels)
    x = torch.randn(rows, width, generator=g)
    res = torch.randn(rows, out, generator=g) if residual else None
    want = x.double() @ _rounded(weight).double().t()
    if bias:
        want += matrix.bias.double()
    if residual:
        want += res.double()
    # the magnitudes summed, which bound each rounding: the products, and the bias and residual added to them
    scale = x.abs().double() @ _rounded(weight).abs().double().t() + 1.0
    if bias:
        scale += matrix.bias.abs().double()
    if residual:
        scale += res.abs().double()
    error = (matrix(x, res).double() - want).abs()
    assert torch.all(error <= 2 * (width + 2) * 2**-24 * scale), float((error / scale).max())


def _round_model_in_place(model) -> None:
    """Every linear weight (LM head included) rounded to bf16: the float32 model a bf16 engine is meant to equal."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_rounded(module.weight))


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 6])
def test_a_bf16_target_generates_what_transformers_generates_on_the_bf16_rounded_model(arch, batch, tokenizer):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    _round_model_in_place(reference)
    llm = LLM(model, tokenizer, quantization="bf16", kv_cache_memory="16MiB", block_size=4)
    assert llm.engine.model.forward_name == "fused (bf16 weights)"
    prompts = random_prompts(batch, 3, 40, seed=11 + batch)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]


@needs_kernels
@pytest.mark.parametrize("batch", [1, 5])
def test_a_bfloat16_model_on_a_cpu_runs_as_bf16_weights_in_float32_and_matches_transformers_float32(batch,
                                                                                                   tokenizer):
    """`dtype="bfloat16"` on a CPU in float32 arithmetic: the weights and the KV cache stay bf16, the activations are
    float32, so the tokens are transformers' float32 greedy tokens on the same (bf16-valued) weights with a cache
    that rounds to bf16; with `kv_cache_dtype="float32"`, its plain float32 tokens. torch's bf16 path is one option
    away. (On a CPU with bf16 dot products `bf16_arithmetic: auto` rounds the activations of products of several
    rows to bf16 instead: see the tests of `bf16_arithmetic` below.)"""
    model = tiny_model("llama").to(torch.bfloat16)
    reference = copy.deepcopy(model).to(torch.float32)  # widening is exact: the same weights
    prompts = random_prompts(batch, 3, 40, seed=7 + batch)
    for kv, want in (("auto", hf_greedy_bf16_cache), ("float32", hf_greedy)):
        llm = LLM(copy.deepcopy(model), tokenizer, dtype="bfloat16", device="cpu", kv_cache_memory="16MiB",
                  block_size=4, kv_cache_dtype=kv, bf16_arithmetic="float32")
        assert llm.engine.model.forward_name == "fused (bf16 weights)" and llm.engine.config.quantization == "bf16"
        assert llm.engine.kv_cache.pool.dtype == (torch.bfloat16 if kv == "auto" else torch.float32)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
        assert [o.token_ids for o in outs] == [want(reference, p, 16) for p in prompts], kv
    torch_path = LLM(copy.deepcopy(model), tokenizer, dtype="bfloat16", device="cpu", native_kernels=False,
                     kv_cache_memory="16MiB")
    assert torch_path.engine.config.quantization is None and torch_path.engine.kv_cache.pool.dtype == torch.bfloat16
    # torch's bf16 products on the fused decoder's column-major weights ran 10x slower than transformers' own
    # forward on a CPU, so a bf16 model without its copies keeps its own forward unless the fused decoder is asked
    assert torch_path.engine.model.forward_name == "transformers"
    asked = LLM(copy.deepcopy(model), tokenizer, dtype="bfloat16", device="cpu", native_kernels=False,
                fused_decoder=True, kv_cache_memory="16MiB")
    assert asked.engine.model.forward_name == "fused"


@needs_kernels
@pytest.mark.parametrize("batch", [1, 8])
def test_a_bf16_self_draft_gives_the_float_targets_greedy_output(batch, tokenizer):
    model = tiny_model("llama")
    llm = LLM(model, tokenizer, draft="target", draft_quantization="bf16", kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(batch, 3, 30, seed=batch)
    spec_params = SamplingParams(strategy={"speculative": {"proposer": "draft", "num_speculative_tokens": 3}},
                                 max_tokens=20, temperature=0, ignore_eos=True)
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, spec_params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in spec) > drafted * 3 // 4
    assert llm.engine.components.get("proposers", "draft").model.forward_name == "fused (bf16 weights)"


@needs_kernels
def test_asking_for_bf16_weights_where_they_cannot_run_is_refused_with_the_option_named(tokenizer):
    with pytest.raises(ConfigError, match=r"quantization 'bf16' multiplies on the native kernels"):
        LLM(tiny_model("llama"), tokenizer, quantization="bf16", native_kernels=False, kv_cache_memory="16MiB")


@needs_kernels
def test_the_portable_build_without_avx2_gives_the_same_products_and_bf16_cache_attention(tmp_path):
    """CPUs without AVX2 and FMA (or other architectures) compile the scalar tiles and generic vectors: built here
    with AVX2 and FMA switched off, they must give the vectorized build's bf16, int8 and single-row float32 products
    up to float32 summation order, and its attention over a bf16 KV pool."""
    import platform
    import subprocess

    from decodekit.execution.kernels.native import SOURCES, NativeKernels, find_compiler

    compiler = find_compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler on x86-64")
    library = tmp_path / "portable.so"
    subprocess.run([compiler, "-O2", "-mno-avx2", "-mno-fma", "-fPIC", "-shared", "-std=c11", "-Wno-unknown-pragmas",
                    "-o", str(library), *map(str, SOURCES), "-lm"], check=True, capture_output=True)
    portable = NativeKernels(library)
    g = torch.Generator().manual_seed(5)
    weight, x, bias = torch.randn(45, 70, generator=g), torch.randn(7, 70, generator=g), torch.randn(45, generator=g)
    for rows in (1, 2, 3, 7):
        panels = pack_bf16_panels(weight)
        torch.testing.assert_close(portable.linear_bf16(x[:rows], panels, 45, bias),
                                   kernels.linear_bf16(x[:rows], panels, 45, bias), rtol=1e-5, atol=1e-5)
    int8 = torch.randint(-127, 128, (45, 70), generator=g, dtype=torch.int8)
    scale = torch.rand(45, generator=g)
    for rows in (1, 2, 7):
        torch.testing.assert_close(portable.linear_i8(x[:rows], pack_int8_panels(int8), scale),
                                   x[:rows] @ (int8.float() * scale[:, None]).t(), rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 3, 7):  # one register group of rows, and several
        torch.testing.assert_close(portable.gemv(x[:rows], weight, bias), x[:rows] @ weight.t() + bias,
                                   rtol=1e-5, atol=1e-5)
    # one sequence of 2 new tokens after 9 cached ones, 2 kv heads of 2 query heads, blocks of 4, a bf16 pool
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(2, dim, generator=g), torch.randn(2, dim, generator=g)
    pool = torch.randn(2, 16, kv_heads, dim, generator=g).to(torch.bfloat16)
    results = []
    for library in (portable, kernels):
        plan = DecodeAttentionPlan(torch.tensor([9, 10]), [2], [9], [[0, 1, 2]], 4)
        plan.set_rope(cos, sin)
        keys, values = pool.clone()
        results.append((library.rope_cache_attend(qkv.clone(), heads, kv_heads, keys, values, plan, 0.25), keys))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][1], results[1][1])  # the same rounded keys stored


@needs_kernels
def test_bfloat16_on_a_cpu_is_closer_to_float32_than_transformers_own_bf16_forward(tokenizer):
    """The stated tolerance against transformers' bf16: on the same bf16 weights, decodekit's prompt log-probabilities
    in float32 arithmetic are closer to transformers' float32 forward than transformers' bf16 forward (which rounds
    every activation to bf16) is, and within float32 rounding (1e-4) of it with a float32 KV cache."""
    model = tiny_model("llama").to(torch.bfloat16)
    prompt = random_prompts(1, 40, 41, seed=4)[0]
    logprobs = {}
    for kv in ("auto", "float32"):
        llm = LLM(copy.deepcopy(model), tokenizer, dtype="bfloat16", device="cpu", kv_cache_memory="16MiB",
                  kv_cache_dtype=kv, bf16_arithmetic="float32")
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        rows = (out.prompt_logprobs or [])[1:]
        logprobs[kv] = torch.tensor([row[token].logprob for token, row in zip(prompt[1:], rows)])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        targets = torch.tensor(prompt[1:])[:, None]
        float32 = torch.log_softmax(model.float()(ids).logits[0, :-1].float(), -1).gather(1, targets)[:, 0]
        bf16 = torch.log_softmax(model.to(torch.bfloat16)(ids).logits[0, :-1].float(), -1).gather(1, targets)[:, 0]
    bf16_cache_error, float32_cache_error = (float((logprobs[kv] - float32).abs().max())
                                             for kv in ("auto", "float32"))
    bf16_error = float((bf16 - float32).abs().max())
    assert float32_cache_error < 1e-4, float32_cache_error
    assert bf16_cache_error < bf16_error / 2, (bf16_cache_error, bf16_error)


@needs_kernels
def test_a_bfloat16_draft_runs_as_bf16_weights_unless_the_engine_turns_the_fused_decoder_off(tokenizer):
    target = tiny_model("llama").to(torch.bfloat16)
    draft = tiny_model("llama", seed=1).to(torch.bfloat16)
    llm = LLM(copy.deepcopy(target), tokenizer, draft=copy.deepcopy(draft), dtype="bfloat16", device="cpu",
              kv_cache_memory="16MiB")
    assert llm.engine.draft_config is not None and llm.engine.draft_config.quantization == "bf16"
    plain = LLM(copy.deepcopy(target), tokenizer, draft=copy.deepcopy(draft), dtype="bfloat16", device="cpu",
                kv_cache_memory="16MiB", fused_decoder=False)
    assert plain.engine.config.quantization is None
    assert plain.engine.draft_config is not None and plain.engine.draft_config.quantization is None


needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_available(), reason="torch's oneDNN has no bf16 products here")


@needs_kernels
@needs_onednn_bf16
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), width=st.integers(1, 90), out=st.integers(1, 70), bias=st.booleans(),
       residual=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_products_round_the_activations_to_bf16_from_eight_rows_and_keep_float32_below(rows, width, out, bias,
                                                                                           residual, seed):
    """`Bf16Matrix(bf16_gemm=True)`: from `BF16_GEMM_MIN_ROWS` rows, the product of the bf16-rounded activations and
    weights (float32 sums), rounded to bf16 once, then bias and residual added in float32; below, exactly the panels'
    float32-arithmetic product."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=g)
    x = torch.randn(rows, width, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    res = torch.randn(rows, out, generator=g) if residual else None
    assert not isinstance(kernels, str)
    got = Bf16Matrix(weight, b, kernels, bf16_gemm=True)(x, res)
    if rows < BF16_GEMM_MIN_ROWS:
        assert torch.equal(got, Bf16Matrix(weight, b, kernels)(x, res))
        return
    exact = _rounded(x).double() @ _rounded(weight).double().t()
    rounding = exact.abs() * 2**-8 + (x.abs().double() @ weight.abs().double().t()) * (width + 2) * 2**-24
    extra = (b.double() if bias else 0.0) + (res.double() if residual else 0.0)
    assert torch.all((got.double() - extra - exact).abs() <= rounding + 1e-6)


@needs_kernels
@needs_onednn_bf16
@pytest.mark.parametrize("cpu_has_bf16", [True, False])
def test_bf16_arithmetic_auto_is_bf16_only_for_a_bfloat16_model_on_a_cpu_with_bf16_dot_products(cpu_has_bf16,
                                                                                               monkeypatch, tokenizer):
    """The one choice (`execution.plan`), on either kind of CPU (the flag is what /proc/cpuinfo says):
    `auto` follows the model's dtype and the CPU, `float32` never, `bf16` always, with a warning where emulated."""
    from decodekit.execution import plan

    monkeypatch.setattr(plan, "cpu_has_bf16_dot_products", lambda: cpu_has_bf16)
    bf16_model = tiny_model("llama").to(torch.bfloat16)

    def products(model: torch.nn.Module, **options: object) -> str:
        llm = LLM(copy.deepcopy(model), tokenizer, device="cpu", kv_cache_memory="16MiB", **options)
        return llm.engine.model.forward_name

    with_gemm, without = "fused (bf16 weights, bf16 products)", "fused (bf16 weights)"
    assert products(bf16_model, dtype="bfloat16") == (with_gemm if cpu_has_bf16 else without)
    assert products(bf16_model, dtype="bfloat16", bf16_arithmetic="float32") == without
    assert products(tiny_model("llama"), quantization="bf16") == without  # weight-only bf16 of a float32 model
    assert products(tiny_model("llama"), quantization="bf16", bf16_arithmetic="bf16") == with_gemm


@needs_kernels
@needs_onednn_bf16
def test_bf16_arithmetic_is_closer_to_float32_than_transformers_own_bf16_forward(tokenizer):
    """The stated tolerance of bf16 products: rounding only the products' inputs and outputs to bf16 (norms, the
    residual stream, attention and softmax stay float32) keeps prompt log-probabilities closer to transformers'
    float32 forward on the same weights than transformers' own bf16 forward, which rounds every activation."""
    model = tiny_model("llama").to(torch.bfloat16)
    prompt = random_prompts(1, 40, 41, seed=4)[0]
    llm = LLM(copy.deepcopy(model), tokenizer, dtype="bfloat16", device="cpu", kv_cache_memory="16MiB",
              bf16_arithmetic="bf16")
    assert llm.engine.model.forward_name == "fused (bf16 weights, bf16 products)"
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    rows = (out.prompt_logprobs or [])[1:]
    ours = torch.tensor([row[token].logprob for token, row in zip(prompt[1:], rows)])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        targets = torch.tensor(prompt[1:])[:, None]
        float32 = torch.log_softmax(model.float()(ids).logits[0, :-1].float(), -1).gather(1, targets)[:, 0]
        bf16 = torch.log_softmax(model.to(torch.bfloat16)(ids).logits[0, :-1].float(), -1).gather(1, targets)[:, 0]
    error, bf16_error = float((ours - float32).abs().max()), float((bf16 - float32).abs().max())
    assert 0 < error < bf16_error, (error, bf16_error)


@needs_kernels
@needs_onednn_bf16
def test_batched_bf16_steps_attend_on_bf16_dot_products_and_stay_closer_to_float32_than_transformers_bf16(
        tokenizer, monkeypatch):
    """A bfloat16 model under `bf16_arithmetic: bf16`: a decode step of eight or more sequences multiplies on the
    bf16 GEMM and, on a CPU with AVX512-BF16, attends its bf16 pool on bf16 dot products (query and probabilities
    rounded to bf16). The chosen tokens' log-probabilities of such steps stay closer to transformers' float32 forward
    on the same weights than transformers' own bf16 forward is; and the engine does ask the attention for dot
    products on exactly those steps (fewer rows keep float32 attention, as they keep float32 products)."""
    from decodekit.execution.kernels import native as native_module

    asked: list[tuple[int, bool]] = []
    attend = native_module.NativeKernels.rope_cache_attend

    def spy(self, qkv, *args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append((qkv.shape[0], bool(kwargs.get("bf16_dot"))))
        return attend(self, qkv, *args, **kwargs)

    monkeypatch.setattr(native_module.NativeKernels, "rope_cache_attend", spy)
    # head size 64 (SmolLM2's), a multiple of 32: the dot path's head sizes
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=256).to(torch.bfloat16)
    prompts = random_prompts(BF16_GEMM_MIN_ROWS + 1, 20, 40, seed=9)
    llm = LLM(copy.deepcopy(model), tokenizer, dtype="bfloat16", device="cpu", kv_cache_memory="16MiB",
              bf16_arithmetic="bf16")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    assert all(dot == (rows >= BF16_GEMM_MIN_ROWS) for rows, dot in asked if rows > 1)
    assert any(dot for _, dot in asked)
    ours, float32, bf16 = [], [], []
    as_float32, as_bf16 = copy.deepcopy(model).float(), model  # `.float()` converts in place
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        ours += [row[token].logprob for token, row in zip(tokens, out.outputs[0].logprobs or [])]
        ids = torch.tensor([prompt + tokens[:-1]])
        targets = torch.tensor(tokens)[:, None]
        with torch.no_grad():
            for reference, into in ((as_float32, float32), (as_bf16, bf16)):
                logits = reference(ids).logits[0, len(prompt) - 1:].float()
                into += torch.log_softmax(logits, -1).gather(1, targets)[:, 0].tolist()
    error = (torch.tensor(ours) - torch.tensor(float32)).abs().mean()
    bf16_error = (torch.tensor(bf16) - torch.tensor(float32)).abs().mean()
    assert 0 < error < bf16_error, (error, bf16_error)
