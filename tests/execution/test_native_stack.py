"""The native layer stack (`fused/layer_stack.py`, `dk_layer_stack`): a step's whole stack of layers in one native
call is bit for bit the per-layer native path (logits and every key and value written, `torch.equal`) over random
steps of every weight kind (float32, bf16 panels, int8 panels, the tiny GGUF's stacked blocks), q/k/v biases, sliding
windows, Phi-3's fused projections and a bf16 KV pool, at batch 1 and a few rows, after prompts of several lengths;
steps it does not take (more rows, long chunks) run layer by layer; the plan says when it runs and why not."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from decodekit import LLM, SamplingParams
from decodekit.api.cpu import cpu_flags
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.execution import ModelExecutor
from decodekit.execution.attention.kv_cache import BATCHED_MAX_QUERY
from decodekit.execution.fused.layer_stack import STACK_VARIABLE, NativeLayerStack
from decodekit.execution.kernels.native import load_kernels
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.helpers.gguf_blocks import TINY_GGUF, TinyGgufLoader

kernels = load_kernels()
pytestmark = pytest.mark.skipif(isinstance(kernels, str), reason=f"native kernels unavailable: {kernels}")


def _phi3() -> Any:
    config = AutoConfig.for_model("phi3", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _tiny_gguf() -> LLM:
    pm = get_plugin_manager(load_entry_points=False)
    pm.register(TinyGgufLoader(), "tiny-gguf")
    return LLM(TINY_GGUF, plugin_manager=pm, kv_cache_memory="8MiB", block_size=4)


def _with_biases(model: Any) -> Any:
    """`model` with random q/k/v biases where it has them (transformers initializes them to zero, which would
    leave a dropped bias unseen)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for seed, name in enumerate(("q_proj", "k_proj", "v_proj")):
                bias = getattr(getattr(layer.self_attn, name, None), "bias", None)
                if bias is not None:
                    bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


def _tiny(arch: str = "llama", dtype: torch.dtype = torch.float32, **options: Any) -> Callable[[], LLM]:
    overrides = options.pop("model", {})
    return lambda: LLM(_with_biases(tiny_model(arch, **overrides)).to(dtype), tiny_tokenizer(), device="cpu",
                       fused_decoder=True, kv_cache_memory="8MiB", block_size=4, **options)


CONFIGS: dict[str, Callable[[], LLM]] = {
    "float32 llama": _tiny(),
    "float32 qwen2 (q/k/v bias)": _tiny("qwen2"),
    "float32 mistral, window 6": _tiny("mistral", model={"sliding_window": 6}),
    "float32 phi3 (fused projections)": lambda: LLM(_phi3(), tiny_tokenizer(), device="cpu", fused_decoder=True,
                                                    kv_cache_memory="8MiB", block_size=4),
    "bf16 llama": _tiny(quantization="bf16"),
    "bf16 qwen2, bf16 KV pool": _tiny("qwen2", quantization="bf16", kv_cache_dtype="bfloat16"),
    "bf16 model (bf16 products where the CPU has them)": _tiny(dtype=torch.bfloat16),
    "int8 llama": _tiny(quantization="int8"),
    "int8 qwen2, window 6 on its second layer": _tiny("qwen2", quantization="int8", model={
        "sliding_window": 6, "use_sliding_window": True, "max_window_layers": 1}),
    "q4_1 llama (block copies, Q8_0 head)": _tiny(quantization="q4_1"),
    "tiny GGUF as stored (Q4_0/Q4_1/Q8_0 q/k/v, Q4_K, Q6_K)": _tiny_gguf,
}


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {}


def _engine(engines: dict[str, LLM], name: str) -> LLM:
    if name not in engines:
        engines[name] = CONFIGS[name]()
    return engines[name]


def _kv(executor: ModelExecutor, keys: list[int]) -> torch.Tensor:
    """Every layer's stored keys and values of sequences `keys`, in token order."""
    cache, size = executor.kv_cache, executor.kv_cache.block_size
    slots = [table[pos // size] * size + pos % size for key in keys
             for table in [executor.allocator.block_table(key)] for pos in range(executor.num_cached(key))]
    return cache.slots[:, :, torch.tensor(slots)].clone()


def _twin_step(executor: ModelExecutor, batch: list[tuple[int, list[int]]]) -> bool:
    """Run `batch` with the native stack and again, rolled back, layer by layer: the logits and the keys and values
    stored must be equal. Returns whether the stack ran the first."""
    fused = executor.runner.fused
    stack = fused.native_stack
    assert isinstance(stack, NativeLayerStack)
    starts = {key: executor.num_cached(key) for key, _ in batch}
    keys = list(starts)
    ran: list[int] = []
    run = stack.run

    def counted(*args: Any) -> Any:
        ran.append(1)
        return run(*args)

    stack.run = counted  # type: ignore[method-assign]
    try:
        stacked = executor.forward(batch)
    finally:
        del stack.run
    stacked_kv = _kv(executor, keys)
    for key, start in starts.items():
        executor.truncate(key, start)
    fused.native_stack = None
    try:
        layered = executor.forward(batch)
    finally:
        fused.native_stack = stack
    assert torch.equal(stacked, layered), (stacked - layered).abs().max()
    assert torch.equal(stacked_kv, _kv(executor, keys))
    return bool(ran)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_stack_steps_equal_the_per_layer_path_bit_for_bit(engines, name, data):
    """Prompts of 1-30 tokens (prefilled on the stack where it takes their rows and the native attention their
    chunk, else layer by layer), then decode and verification-sized steps of 1 to a few rows over 1-4 sequences:
    each step's logits and KV equal with the stack on and off, and the stack runs exactly the steps it takes."""
    llm = _engine(engines, name)
    executor = llm.engine.model
    stack = executor.runner.fused.native_stack
    assert stack is not None and stack.max_rows == executor.plan.native_stack, name
    draw = data.draw
    count = draw(st.integers(1, 4), label="sequences")
    vocab = st.integers(3, 383)
    keys = list(range(1000, 1000 + count))
    try:
        for key in keys:
            prompt = draw(st.lists(vocab, min_size=1, max_size=30), label="prompt")
            assert executor.reserve(key, len(prompt) + 16)
            ran = _twin_step(executor, [(key, prompt)])
            # a prompt longer than a decode query is a prefill chunk: the stack takes it where the native attention
            # does (`native_chunk_keys`), else SDPA attends it layer by layer
            native_chunk = executor.runner.fused.native_chunk_keys(len(prompt), executor.kv_cache) >= len(prompt)
            assert ran == (len(prompt) <= stack.max_rows and (len(prompt) <= BATCHED_MAX_QUERY or native_chunk))
        for _ in range(draw(st.integers(1, 4), label="steps")):
            batch = [(key, draw(st.lists(vocab, min_size=1, max_size=3), label="new tokens")) for key in keys]
            for key, tokens in batch:
                assert executor.reserve(key, executor.num_cached(key) + len(tokens))
            assert _twin_step(executor, batch) == (sum(len(tokens) for _, tokens in batch) <= stack.max_rows)
    finally:
        for key in keys:
            executor.release(key)


def test_float32_weights_stack_up_to_the_gemv_limit_and_quantized_ones_up_to_their_native_limits(engines):
    """float32 weights are all row-major (`dk_gemv` takes up to 12 rows of them, 8 built for AVX-512); bf16 and int8
    panels take up to the native gating's 64 rows, the GGUF blocks too; a bf16 model with bf16 products
    (`bf16_gemm`) stops below the rows those start at."""
    rows = {name: _engine(engines, name).engine.plan.native_stack for name in CONFIGS}
    kernels = load_kernels()
    assert not isinstance(kernels, str)
    gemv_max_rows = kernels.gemv_max_rows
    assert gemv_max_rows == (8 if "avx512f" in cpu_flags() else 24)
    assert rows["float32 llama"] == rows["float32 phi3 (fused projections)"] == gemv_max_rows
    assert rows["bf16 llama"] == rows["int8 llama"] == 64
    assert rows["tiny GGUF as stored (Q4_0/Q4_1/Q8_0 q/k/v, Q4_K, Q6_K)"] == 64
    plan = _engine(engines, "bf16 model (bf16 products where the CPU has them)").engine.plan
    assert plan.native_stack == (7 if plan.bf16_gemm else 64)
    int8, float32 = (_engine(engines, name).engine.plan.describe() for name in ("int8 llama", "float32 llama"))
    assert int8.endswith("float32 KV cache, the layers of steps of up to 64 rows in one native call")
    assert float32.endswith(f"the layers of steps of up to {gemv_max_rows} rows in one native call")


def test_qwen3_query_key_norms_keep_the_per_layer_loop_and_say_why():
    llm = LLM(tiny_model("qwen3"), tiny_tokenizer(), device="cpu", fused_decoder=True)
    assert llm.engine.plan.native_stack == 0 and llm.engine.model.runner.fused.native_stack is None
    assert "layers one native call at a time: query/key norms (torch's RMSNorm) run layer by layer" in (
        llm.engine.plan.reasons)
    assert "native call" not in llm.engine.plan.describe()


def test_the_environment_variable_turns_the_stack_off_and_the_plan_says_so(monkeypatch):
    monkeypatch.setenv(STACK_VARIABLE, "0")
    llm = LLM(tiny_model(), tiny_tokenizer(), device="cpu", fused_decoder=True)
    assert llm.engine.plan.native_stack == 0 and llm.engine.model.runner.fused.native_stack is None
    assert f"layers one native call at a time: {STACK_VARIABLE}=0" in llm.engine.plan.reasons


def test_a_layer_the_stack_cannot_describe_leaves_the_decoder_on_the_per_layer_path(engines):
    """A product with no native path (here a float32 weight strided both ways) makes `build` refuse the stack."""
    fused = _engine(engines, "float32 llama").engine.model.runner.fused
    layers = [copy.copy(layer) for layer in fused.layers]
    layers[1].o = copy.copy(layers[1].o)
    layers[1].o.native = None
    assert NativeLayerStack.build(layers, kernels) is None
    assert NativeLayerStack.build(fused.layers, kernels) is not None


def test_the_stack_times_its_products_only_while_asked_and_within_the_step():
    llm = _tiny()()
    native = llm.engine.model.runner.fused.native
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)
    assert native.stack_product_seconds() is None  # off unless asked: no clock reads in a served step
    native.time_stack_products(True)
    start = time.perf_counter()
    llm.generate([[5, 6, 7]], params)
    wall = time.perf_counter() - start
    products = native.stack_product_seconds()
    parts = native.stack_seconds()
    native.time_stack_products(False)
    assert products is not None and 0 < products < wall
    assert native.stack_product_seconds() is None and native.stack_seconds() is None
    # every part ran within the generate call, and the parts are disjoint: together they fit in its wall time
    assert parts is not None and parts["products"] == products
    assert all(parts[name] > 0 for name in ("attention", "norms", "run")) and sum(parts.values()) < wall


def test_two_engines_decoding_at_once_on_two_threads_get_the_tokens_each_gets_alone():
    """The layer stack plans its keys-and-values prefetch in process-wide state (`dk_side_prefetch`); two engines
    stepping at once from two Python threads (ctypes lets go of the GIL) must still each decode exactly as alone."""
    from concurrent.futures import ThreadPoolExecutor

    llms = [_tiny()(), _tiny("qwen2", quantization="int8")()]
    prompts = [[5 + i + 3 * k for i in range(6 + 5 * k)] for k in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def decode(llm: LLM) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for _ in range(4) for out in llm.generate(prompts, params)]

    alone = [decode(llm) for llm in llms]
    with ThreadPoolExecutor(max_workers=2) as pool:
        together = list(pool.map(decode, llms))
    assert together == alone
