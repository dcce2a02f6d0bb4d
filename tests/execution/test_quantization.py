"""int8 weights in the fused decoder: the product is the dequantized float product, an int8 target is transformers
on the dequantized model, an int8 copy of the target drafts losslessly (greedy and sampled), and every way to ask
for int8 where it cannot run is refused with a message that names the option."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.cpu import cpu_flags
from decodekit.api.errors import ConfigError, RecipeError
from decodekit.execution.fused.weight_matrices import INT8_NATIVE_MAX_ROWS, Bf16Matrix, Int8Matrix
from decodekit.execution.kernels.native import load_kernels, pack_int8_panels
from decodekit.models.tiny import tiny_model
from decodekit.recipe import recipe_from_data
from tests.helpers.reference import hf_greedy, random_prompts

kernels = load_kernels()
needs_kernels = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")


def _dequantized(matrix: Int8Matrix) -> torch.Tensor:
    return matrix.weight.float() * matrix.scale[:, None]


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 2 * INT8_NATIVE_MAX_ROWS + 3), width=st.integers(1, 70), out=st.integers(1, 13),
       bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_product_is_the_float_product_of_the_dequantized_weight(rows, width, out, bias, residual, seed):
    """Native rows (up to INT8_NATIVE_MAX_ROWS) and the blockwise BLAS path beyond: odd widths hit the kernel's
    scalar tails, odd output counts its single-row tiles. The native kernel rounds each activation row to int16
    (max|x| -> 32767), so it may be off by half an activation step times the weight row's absolute sum."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=g)
    matrix = Int8Matrix(weight, torch.randn(out, generator=g) if bias else None, kernels)
    x = torch.randn(rows, width, generator=g)
    res = torch.randn(rows, out, generator=g) if residual else None
    want = x @ _dequantized(matrix).t()
    if bias:
        want += matrix.bias
    if residual:
        want += res
    dequantized = _dequantized(matrix)
    bound = (x.abs().amax(dim=1, keepdim=True) / 65534) * dequantized.abs().sum(dim=1)[None]
    if rows > INT8_NATIVE_MAX_ROWS:
        bound = torch.zeros_like(bound)  # BLAS on the dequantized weight: float rounding only
    error = (matrix(x, res) - want).abs()
    assert torch.all(error <= bound * 1.001 + 1e-5 * (1 + want.abs())), float((error - bound).max())


def _int8_product_by_its_definition(x: torch.Tensor, int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`dk_linear_i8`'s result computed from its definition, in float32 where it rounds: each row rounded to int16 with
    its own step max|x| / 32767 (halves to even), each output's products summed exactly over chunks of 512 inputs,
    each chunk's sum rounded to float32 and added to the output's float32 total in order, then times the row's
    step and the output's scale."""
    out = torch.empty(x.shape[0], int8.shape[0])
    for m, row in enumerate(x):
        peak = row.abs().max()
        step = peak / 32767 if peak > 0 else torch.tensor(1.0)
        quantized = torch.round(row * (torch.tensor(1.0) / step)).long()
        total = torch.zeros(int8.shape[0])
        for begin in range(0, x.shape[1], 512):  # I8_PAIRS_CHUNK pairs of inputs
            exact = (int8[:, begin:begin + 512].long() * quantized[begin:begin + 512]).sum(dim=1)
            total = total + exact.float()
        out[m] = total * step * scale
    return out


@needs_kernels
@pytest.mark.skipif("avx2" not in cpu_flags(), reason="the int16 path needs AVX2 (elsewhere the float path runs)")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), width=st.integers(1, 1100), out=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_the_native_int8_product_is_its_definition_bit_for_bit(rows, width, out, seed):
    """The rounding of each activation row to int16 (eight at a time on AVX2, one by one in the tails), the exact
    integer sums over pairs (two pairs a turn, an odd count's last alone) and their flushes to float every 512 inputs
    agree with the definition to the last bit, across row counts (one to two tiles) and widths (tails, a second
    chunk)."""
    g = torch.Generator().manual_seed(seed)
    int8 = torch.randint(-127, 128, (out, width), generator=g, dtype=torch.int8)
    scale = torch.rand(out, generator=g) * 0.01
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 10
    got = kernels.linear_i8(x, pack_int8_panels(int8), scale)
    assert torch.equal(got, _int8_product_by_its_definition(x, int8, scale))


@needs_kernels
@pytest.mark.parametrize("matrix_type", [Int8Matrix, Bf16Matrix])
@settings(max_examples=20, deadline=None)
@given(width=st.integers(1, 90), out=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_a_rows_int8_or_bf16_product_does_not_depend_on_the_rows_multiplied_with_it(matrix_type, width, out, seed):
    """Panel blocks of 1-4 rows (1-8 on AVX-512) sum each output in one order (int8: each row rounded to int16 with
    its own scale): a row alone and in 2-17 rows (every block size, and blocks after a full one) agree bit for bit
    (a request's tokens do not depend on its batch)."""
    g = torch.Generator().manual_seed(seed)
    matrix = matrix_type(torch.randn(out, width, generator=g), None, kernels)
    x = torch.randn(17, width, generator=g)
    alone = torch.cat([matrix(x[m:m + 1]) for m in range(17)])
    for rows in range(2, 18):
        assert torch.equal(matrix(x[:rows]), alone[:rows]), f"{rows} rows"


@needs_kernels
@pytest.mark.parametrize("matrix_type", [Int8Matrix, Bf16Matrix])
def test_quantized_products_propagate_nan_and_infinity_like_float32(matrix_type):
    """20 outputs: a full panel and a padded one; the int8 call with a non-finite row takes the float path."""
    weight = torch.randn(20, 40)
    matrix = matrix_type(weight, None, kernels)
    x = torch.randn(3, 40)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    out = matrix(x)
    assert torch.isnan(out[1]).all() and not torch.isfinite(out[2]).all()
    used = _dequantized(matrix) if matrix_type is Int8Matrix else weight.to(torch.bfloat16).float()
    torch.testing.assert_close(out[0], x[0] @ used.t(), rtol=1e-5, atol=1e-5)


def test_int8_weights_are_within_half_a_step_of_the_float_weights():
    weight = torch.randn(40, 33) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different magnitudes
    weight[7] = 0.0  # an all-zero row quantizes to zeros, not NaN
    matrix = Int8Matrix(weight, None, kernels)  # type: ignore[arg-type]
    error = (_dequantized(matrix) - weight).abs()
    assert torch.all(error <= matrix.scale[:, None] / 2 + 1e-7)
    assert matrix.weight.abs().amax(dim=1)[torch.arange(40) != 7].eq(127).all()
    assert torch.equal(matrix.weight[7], torch.zeros(33, dtype=torch.int8))


def _dequantize_model_in_place(model) -> None:
    """Every linear weight (LM head included) replaced by its int8 round trip: the float model an int8 engine
    is meant to equal."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_dequantized(Int8Matrix(module.weight, None, kernels)))  # type: ignore[arg-type]


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_int8_target_generates_what_transformers_generates_on_the_dequantized_model(arch, tokenizer):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    _dequantize_model_in_place(reference)
    llm = LLM(model, tokenizer, quantization="int8", kv_cache_memory="16MiB", block_size=4)
    assert llm.engine.model.forward_name == "fused (int8 weights)"
    prompts = random_prompts(6, 3, 40, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "bf16"])
def test_quantized_copies_leave_the_models_own_weights_and_forward_untouched(quantization, tokenizer):
    model = tiny_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    prompt = random_prompts(1, 5, 6, seed=2)[0]
    want = hf_greedy(model, prompt, 8)
    LLM(model, tokenizer, quantization=quantization, kv_cache_memory="16MiB")
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert hf_greedy(model, prompt, 8) == want


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "bf16", "q4_1"])
def test_a_model_decodekit_loads_frees_its_layer_weights_once_quantized_and_generates_the_same(quantization,
                                                                                               tokenizer, tiny_dir):
    """Loaded from a folder, the model is the engine's own: its layer weights are swapped for meta tensors (the
    quantized copies serve them), the embeddings stay, and the tokens are those of an engine quantizing a model
    object (whose weights it leaves alone). A self-draft reads the target's weights, so they stay there."""
    owned = LLM(str(tiny_dir), quantization=quantization, kv_cache_memory="16MiB", block_size=4, dtype="float32")
    layer = owned.engine.loaded.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.device.type == "meta" and layer.mlp.down_proj.weight.device.type == "meta"
    assert owned.engine.loaded.model.model.embed_tokens.weight.device.type == "cpu"
    given_model = LLM(type(owned.engine.loaded.model).from_pretrained(tiny_dir), tokenizer,
                      quantization=quantization, kv_cache_memory="16MiB", block_size=4)
    assert given_model.engine.loaded.model.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
    prompts = random_prompts(4, 3, 30, seed=6)
    params = SamplingParams(max_tokens=10, temperature=0)
    assert ([o.token_ids for o in owned.generate(prompts, params)]
            == [o.token_ids for o in given_model.generate(prompts, params)])
    self_draft = LLM(str(tiny_dir), draft="target", draft_quantization=quantization, kv_cache_memory="16MiB",
                     dtype="float32")
    self_draft.generate(prompts[:1], _spec(3, max_tokens=4, temperature=0))
    assert self_draft.engine.loaded.model.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
    # a draft loaded apart from the target is freed when its quantized copy is built (at its first use)
    drafted = LLM(str(tiny_dir), draft=str(tiny_dir), draft_quantization=quantization, kv_cache_memory="16MiB",
                  dtype="float32")
    outs = drafted.generate(prompts, _spec(3, max_tokens=10, temperature=0))
    float_target = [o.token_ids for o in self_draft.generate(prompts, params)]  # plain decoding, no draft
    assert [o.token_ids for o in outs] == float_target
    assert drafted.engine.draft is not None
    assert drafted.engine.draft.model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    assert drafted.engine.loaded.model.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"


def _spec(k: int, **sampling) -> SamplingParams:
    return SamplingParams(strategy={"speculative": {"proposer": "draft", "num_speculative_tokens": k}}, **sampling)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 8])
def test_an_int8_self_draft_gives_the_float_targets_greedy_output(arch, batch, tokenizer):
    model = tiny_model(arch)
    llm = LLM(model, tokenizer, draft="target", draft_quantization="int8", kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(batch, 3, 30, seed=batch)
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _spec(4, max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.token_ids for o in plain] == [hf_greedy(model, p, 20) for p in prompts] or batch > 1
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in spec) > drafted // 2
    proposer = llm.engine.components.get("proposers", "draft")
    assert proposer.model.forward_name == "fused (int8 weights)" and llm.engine.model.forward_name != \
        proposer.model.forward_name
    assert proposer.model.allocator.num_free_blocks == proposer.model.allocator.num_blocks


def _joint_top_k(model, prompt: list[int], length: int, k: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every `length`-token continuation under top-k sampling (temperature 1)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            grown = {}
            for prefix, p in joint.items():
                top = torch.softmax(model(torch.tensor([prompt + list(prefix)])).logits[0, -1], -1).topk(k)
                for q, token in zip((top.values / top.values.sum()).tolist(), top.indices.tolist()):
                    grown[(*prefix, token)] = p * q
            joint = grown
    return joint


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "q4_1"])
def test_sampling_with_a_quantized_self_draft_keeps_the_targets_joint_distribution(quantization, tokenizer):
    """Chi-square of the first three sampled tokens (top_k 2: eight outcomes) against the target's exact joint
    probabilities. The first token comes from the prompt's forward; the second is drafted by the int8 copy and
    accepted or resampled from the residual, the third is the bonus token."""
    model = tiny_model("llama")
    with torch.no_grad():  # sharper logits, and an outlier weight in every row of the LM head: the rest of each row
        model.lm_head.weight.mul_(4.0)  # is quantized coarsely, so the draft's q differs from p where it matters
        model.lm_head.weight[:, 0] = 3.0  # (acceptance ~71%; a residual without q is caught)
    prompt = random_prompts(1, 6, 7, seed=3)[0]
    joint = _joint_top_k(model, prompt, 3, 2)
    draws = 3000
    assert min(joint.values()) * draws >= 5  # the chi-square approximation holds
    llm = LLM(model, tokenizer, draft="target", draft_quantization=quantization, kv_cache_memory="64MiB",
              block_size=4, max_num_seqs=256)
    params = [_spec(1, max_tokens=3, ignore_eos=True, seed=seed, processors=[{"top_k": {"top_k": 2}}])
              for seed in range(draws)]
    outs = llm.generate([prompt] * draws, params)
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert set(counts) <= set(joint)
    chi2 = sum((counts.get(key, 0) - p * draws) ** 2 / (p * draws) for key, p in joint.items())
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    assert sum(o.metrics.num_draft_tokens for o in outs) == draws
    assert 0 < sum(o.metrics.num_accepted_tokens for o in outs) < draws  # both acceptance and the residual ran


@needs_kernels
def test_asking_for_int8_where_it_cannot_run_is_refused_with_the_option_named(tokenizer):
    with pytest.raises(ConfigError, match=r"draft 'target' drafts with the target's own weights.*draft_quantization"):
        LLM(tiny_model("llama"), tokenizer, draft="target", kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match=r"quantization 'int8' multiplies on the native kernels"):
        LLM(tiny_model("llama"), tokenizer, quantization="int8", native_kernels=False, kv_cache_memory="16MiB")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_embd=64, n_layer=1, n_head=4, n_positions=64)).eval()
    with pytest.raises(ConfigError, match=r"draft_quantization: a quantized self-draft.*GPT2LMHeadModel is not one of"):
        LLM(gpt2, tokenizer, draft="target", draft_quantization="int8", fused_decoder=False, kv_cache_memory="16MiB")
    with pytest.raises(ConfigError,
                       match=r"(?s)quantization.*Input should be 'int8', 'bf16', 'gguf', 'q4_0', 'q4_1' or 'q8_0'"):
        LLM(tiny_model("llama"), tokenizer, quantization="int4", kv_cache_memory="16MiB")


def test_a_recipe_drafting_with_the_target_must_say_how_to_quantize_it():
    base = {"model": "smollm2-135m-instruct", "strategy": {"speculative": {"proposer": "draft"}}}
    with pytest.raises(RecipeError, match=r"draft: .*`model: target`.*add `quantization: int8`"):
        recipe_from_data({**base, "draft": {"model": "target"}})
    recipe = recipe_from_data({**base, "draft": {"model": "target", "quantization": "int8"}})
    assert recipe.draft is not None and recipe.draft.quantization == "int8"
    with pytest.raises(RecipeError,
                       match=r"draft\.quantization: Input should be 'int8', 'bf16', 'q4_0', 'q4_1' or 'q8_0'"):
        recipe_from_data({**base, "draft": {"model": "target", "quantization": "int4"}})


def test_int8_panels_unpack_to_the_weight_they_packed():
    from decodekit.execution.kernels.native import pack_int8_panels, unpack_int8_panels

    for out, width in ((16, 2), (37, 11), (5, 70)):
        weight = torch.randint(-127, 128, (out, width), dtype=torch.int8)
        panels = pack_int8_panels(weight)
        assert panels.shape == (-(-out // 16), -(-width // 2), 16, 2)
        assert torch.equal(unpack_int8_panels(panels, out, width), weight)
        assert int(panels.abs().sum()) == int(weight.abs().sum())  # the padding is zeros
