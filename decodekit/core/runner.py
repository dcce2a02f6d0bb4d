"""The model runner: one packed forward pass for every scheduled sequence, logits only where they are needed."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from decodekit.api.errors import ConfigError, UnsupportedModelError
from decodekit.api.models import LoadedModel
from decodekit.core.attention_probe import probe_attention
from decodekit.core.config import EngineConfig
from decodekit.core.cuda_graphs import DecodeGraphs, GraphCaptureFailed
from decodekit.core.fused_blocks import GEMMA_ARCHITECTURES, fused_decoder_refusal
from decodekit.core.fused_decoder import FusedDecoder
from decodekit.core.gpu_attention import kernel_available
from decodekit.core.kv_cache import (
    ATTENTION_NAME,
    BATCHED_MAX_QUERY,
    SUPPORTED_LAYER_TYPES,
    PagedKVCache,
    build_layout,
    has_attention_sinks,
    needs_capped_attention,
)
from decodekit.core.native_kernels import DecodeAttentionPlan, NativeKernels, load_kernels
from decodekit.core.relaid_linears import relay_linears
from decodekit.core.weight_matrices import BF16_GEMM_MIN_ROWS, onednn_bf16_available, prepacking_available
from decodekit.models.loader import cpu_has_bf16_dot_products

log = logging.getLogger("decodekit.runner")


@dataclass(frozen=True)
class ModelGeometry:
    """What the KV pool must look like for a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int


def _text_config(model: Any) -> Any:
    """The config of the language model (the text part of a multimodal config)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def model_geometry(model: Any) -> ModelGeometry:
    """Read layer count, KV heads, head size and context length from a HF config (refusing what we can't page).

    Any model the fused decoder cannot take runs once on two tokens through a recording attention function
    (`attention_probe`): an attention keyword the paged attention does not implement refuses the model, and the KV
    heads and head size its layers write override the config's.

    Sliding-window layers and attention-logit soft-capping are served by the paged attention itself (transformers
    passes `sliding_window` and `softcap` to the attention function per layer), so they keep the whole context."""
    config = _text_config(model)
    arch = type(model).__name__
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise UnsupportedModelError(f"{arch}: layer types {unsupported} are not supported by decodekit's paged "
                                    f"attention yet (it serves {list(SUPPORTED_LAYER_TYPES)})")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_len = getattr(config, "max_position_embeddings", None) or 2048
    num_layers = config.num_hidden_layers
    # models the fused decoder can take pass known keywords (tests/test_attention_probe.py holds their architectures
    # to it) and state their KV shapes; skipping their probe saves a forward at start-up (150-500 ms for SmolLM2 on
    # 2 cores). A variant it refuses (a bidirectional Gemma, say) is probed.
    probe = None if fused_decoder_refusal(model) is None else probe_attention(model)
    if probe is not None:
        reason = probe.refusal(arch)
        if reason is not None:
            raise UnsupportedModelError(reason)
        if probe.kv_shapes[0] != (kv_heads, head_dim):
            # the layers' own keys decide the pool's width (a config may set an attribute its architecture ignores)
            log.info("%s: the layers write %d KV heads of size %d (the config says %d of %d)", arch,
                     *probe.kv_shapes[0], kv_heads, head_dim)
            kv_heads, head_dim = probe.kv_shapes[0]
        deepest = max(index for index in probe.layer_indices if index is not None)
        if deepest >= num_layers:
            raise UnsupportedModelError(f"{arch}: an attention layer has index {deepest}, beyond the config's "
                                        f"{num_layers} hidden layers")
    return ModelGeometry(num_layers, kv_heads, head_dim, max_len, config.vocab_size)


def wants_fused_decoder(model: Any, setting: bool | None, owned: bool, key: str = "fused_decoder") -> bool:
    """Whether to run `model` through `FusedDecoder`: `setting` True/False forces it, None means "when decodekit
    loaded the model itself and its architecture allows" (the fused decoder re-lays weights in place).

    Raises:
        ConfigError: `setting` is True but the model cannot be fused (the message names `key` and says why).
    """
    reason = fused_decoder_refusal(model)
    if setting and reason is not None:
        raise ConfigError(f"{key}: {reason}; set {key} to false or leave it unset")
    weight = model.get_output_embeddings().weight if reason is None else None
    if setting is None and weight is not None and weight.device.type == "cpu" and weight.dtype != torch.float32:
        # torch's bf16 / fp16 products on a CPU, on the fused decoder's column-major weights, ran 10x slower than
        # transformers' own forward (SmolLM2 bf16 with native_kernels false: 2.4 against 24.8 tok/s, 2-core AVX2);
        # a bf16 model gets the fused decoder through its bf16 copies instead (`bf16_weights_on_cpu`)
        reason = f"{weight.dtype} weights on a CPU run faster in transformers' own forward"
    if setting is None and reason is not None:
        log.info("fused decoder off: %s", reason)
    return reason is None and (setting if setting is not None else owned)


# Steps whose short-query sequences (at most BATCHED_MAX_QUERY new tokens each) bring at most this many tokens
# run the native kernels (when on); long prefill chunks in the same step keep the blocked SDPA. Measured (SmolLM2,
# benchmarks/profile_decode.py): a batch-64 decode step at context 256 took 620 ms native vs 1162 ms in torch
# (1 thread); batch 128 at context 64, 763 vs 807 ms (1 thread) and 540 vs 540 ms (2 threads).
NATIVE_MAX_TOKENS = 512

# The largest extra weight copy `prepack_weights` makes by default.
PREPACK_DEFAULT_LIMIT = 2 << 30


def wants_prepacking(model: Any, setting: bool | None) -> bool:
    """Whether the fused decoder (or the re-laid linears of another model) keeps oneDNN-blocked weight copies: only
    where they work (CPU, float32), and by default only when the copy is at most `PREPACK_DEFAULT_LIMIT` bytes."""
    weight = model.get_output_embeddings().weight
    if setting is False:
        return False
    if not prepacking_available(weight.dtype, weight.device):
        if setting:
            log.warning("prepack_weights: oneDNN-blocked weights need float32 on a CPU with oneDNN; %s on %s "
                        "keeps BLAS products", weight.dtype, weight.device)
        return False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if setting is None and size > PREPACK_DEFAULT_LIMIT:
        log.info("prepack_weights off: a second copy of %.1f GiB of weights is over the default limit", size / 2**30)
        return False
    return True


def wants_native_kernels(model: Any, setting: bool | None, quantized: bool = False) -> NativeKernels | None:
    """The native kernels the fused decoder should use for `model`: on a CPU, for float32 weights (or any float
    weights when `quantized`: the products then run on float32 activations over compressed copies), and by default
    only where they build (a C compiler is found).

    Raises:
        ConfigError: `setting` is True but the kernels cannot run here (the message says why).
    """
    if setting is False:
        return None
    weight = model.lm_head.weight
    if (weight.dtype != torch.float32 and not quantized) or weight.device.type != "cpu":
        if setting:
            raise ConfigError(f"native_kernels: they run float32 on a CPU, not {weight.dtype} on {weight.device}; "
                              "set native_kernels to false or leave it unset")
        return None
    loaded = load_kernels()
    if isinstance(loaded, str):
        if setting:
            raise ConfigError(f"native_kernels: {loaded}; set native_kernels to false or leave it unset")
        log.warning("native kernels off (%s): small ops stay in torch", loaded)
        return None
    return loaded


def bf16_weights_on_cpu(loaded: LoadedModel, config: EngineConfig, key: str = "quantization") -> EngineConfig:
    """`config` with `key` (`quantization` or `draft_quantization`) set to "bf16" where `loaded` is a bfloat16
    model on a CPU that the fused decoder and its native kernels can run (or any architecture decodekit loaded
    itself: its own linear layers then multiply the copies), and nothing else was asked: its weights
    are then multiplied in float32 by the native bf16 product (llama.cpp's bf16 on a CPU), with float32 activations
    (and a bf16 KV cache: `kv_cache_dtype`). torch's own bf16 CPU path rounds every activation to bf16 and measured
    0.1x float32's speed at batch 1 on a 2-core AVX2 CPU (0.68x on an AVX512-BF16 one, issue 21); this one 1.9x
    (2 threads). `native_kernels: false` (or `fused_decoder: false`, for the draft `draft_fused_decoder: false`)
    keeps torch's."""
    fused = config.fused_decoder
    if key == "draft_quantization" and config.draft_fused_decoder is not None:
        fused = config.draft_fused_decoder  # else the draft follows the target's choice (`draft_config`)
    # a model the fused decoder cannot take gets bf16 copies in its own linear layers (`relaid_linears`), and its
    # other weights widened to float32: only where decodekit loaded it (a model object passed in keeps its dtype)
    own_layers = fused_decoder_refusal(loaded.model) is not None
    if (loaded.device.type != "cpu" or loaded.dtype != torch.bfloat16 or getattr(config, key) is not None
            or fused is False or config.native_kernels is False or (own_layers and not loaded.owned)
            or isinstance(load_kernels(), str)):
        return config
    log.info("%s: bfloat16 on a CPU runs as bf16 weights multiplied in float32 (%s bf16); float32 activations",
             loaded.name, key)
    return config.model_copy(update={key: "bf16"})


def wants_bf16_gemm(loaded: LoadedModel, config: EngineConfig) -> bool:
    """Whether `loaded`'s bf16 copies (`quantization: bf16`, which a bfloat16 model on a CPU gets by default:
    `bf16_weights_on_cpu`) multiply steps of several rows on the CPU's bf16 dot products (oneDNN's bf16 GEMM,
    activations rounded to bf16 at each product's input: `Bf16Matrix`) rather than in float32 arithmetic.

    `bf16_arithmetic` decides: "float32" never; "bf16" wherever torch's oneDNN has bf16 products (emulated, and
    slower than float32, on a CPU without bf16 dot products: a warning says so); "auto" where the model itself is
    bfloat16 (the user asked for bf16 arithmetic, as vLLM's and transformers' bf16 run it) and the CPU has bf16 dot
    products (AVX512-BF16 or AMX) for oneDNN to use. `quantization: bf16` on a float32 model stays weight-only
    (float32 activations) under "auto".

    Raises:
        ConfigError: "bf16" is asked where torch's oneDNN has no bf16 products.
    """
    setting = config.bf16_arithmetic
    if config.quantization != "bf16" or setting == "float32" or loaded.device.type != "cpu":
        return False
    native = cpu_has_bf16_dot_products()
    if setting == "bf16":
        if not onednn_bf16_available():
            raise ConfigError("bf16_arithmetic: bf16 runs oneDNN's bf16 products, which this torch build lacks; "
                              "set bf16_arithmetic to float32 or auto")
        if not native:
            log.warning("bf16_arithmetic: bf16 on a CPU without bf16 dot products (AVX512-BF16, AMX): oneDNN "
                        "emulates them, slower than float32 arithmetic")
        return True
    chosen = loaded.dtype == torch.bfloat16 and native and onednn_bf16_available()
    if chosen:
        log.info("%s: steps of %d rows or more multiply on the CPU's bf16 dot products (oneDNN; bf16_arithmetic: "
                 "auto, a bfloat16 model on a CPU with AVX512-BF16 or AMX)", loaded.name, BF16_GEMM_MIN_ROWS)
    return chosen


def compute_dtype(loaded: LoadedModel, config: EngineConfig) -> torch.dtype:
    """The dtype of the activations (and of the KV cache unless `kv_cache_dtype` says otherwise): the model's, except
    for quantized weights on a CPU, which are multiplied in float32."""
    return torch.float32 if config.quantization is not None else loaded.dtype


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_cache_dtype(loaded: LoadedModel, config: EngineConfig) -> torch.dtype:
    """The KV pool's element dtype: `config.kv_cache_dtype`, where "auto" is the model's dtype (vLLM's rule) where
    the pool can hold it under the activations (float32 or bfloat16), else the activations' (`compute_dtype`). So
    a bfloat16 model on a CPU, whose bf16 weights are multiplied in float32, keeps a bf16 cache (half the bytes per
    token, attended in float32), and a float32 model with int8 weights a float32 one.

    Raises:
        ConfigError: a dtype other than the activations' is asked off the CPU (the GPU kernels write and read the
            pool in the model's dtype).
    """
    compute = compute_dtype(loaded, config)
    if config.kv_cache_dtype == "auto":
        return loaded.dtype if loaded.dtype in KV_CACHE_DTYPES.values() else compute
    dtype = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if dtype != compute and loaded.device.type != "cpu":
        raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype}: on {loaded.device.type} the KV cache holds the "
                          f"activations' dtype ({str(compute).removeprefix('torch.')}); leave it auto there")
    return dtype


def draft_config(config: EngineConfig, draft: LoadedModel, target: LoadedModel | None = None) -> EngineConfig:
    """The engine options a draft model runs under: the engine's, with `fused_decoder` from
    `draft_fused_decoder` (unset: the target's explicit `fused_decoder` where the draft can follow it, else the
    default rule) and the native kernels only where the draft is fused. Computed when the engine is built, so a
    draft the fused decoder cannot take is refused then (only when `draft_fused_decoder` is True), never at the
    first speculative request.

    A `draft_quantization` runs in the fused decoder where the draft can be fused (copies beside the module), else
    on the draft's own linear layers (`relaid_linears`), which a self-draft cannot do: it shares the `target`'s
    modules.

    Raises:
        ConfigError: `draft_fused_decoder` is True but the draft cannot be fused, or a quantized self-draft cannot.
    """
    config = bf16_weights_on_cpu(draft, config, key="draft_quantization")
    setting = config.draft_fused_decoder
    fusable = fused_decoder_refusal(draft.model) is None
    if config.draft_quantization is not None:  # quantized copies leave the module as it is, owned or not
        if setting is False or not fusable:
            if target is not None and draft.model is target.model:
                why = ("draft_fused_decoder is false" if setting is False
                       else f"the fused decoder cannot take it ({fused_decoder_refusal(draft.model)})")
                raise ConfigError(f"draft_quantization: a quantized self-draft is a compressed copy the fused decoder "
                                  f"keeps beside the target's own modules, and {why}; draft with a separate model, or "
                                  "with the n-gram proposer")
            setting = False
        else:
            setting = True
    if setting is None and config.fused_decoder is not None and (fusable or not config.fused_decoder):
        setting = config.fused_decoder  # the target's explicit choice, where the draft can follow it
    key = "draft_quantization" if config.draft_quantization is not None else "draft_fused_decoder"
    fused = wants_fused_decoder(draft.model, setting, draft.owned, key=key)
    if not fused and config.draft_fused_decoder is None and setting is None and fusable:
        log.warning("the draft model %s runs the transformers forward (a model object passed in is not re-laid in "
                    "place unless asked); draft_fused_decoder=True runs it through the fused decoder, about twice "
                    "as fast", draft.name)
    # an unfused draft runs eagerly even where the target's `cuda_graphs: true` (graphs capture the fused decoder),
    # and gets re-laid linears only where decodekit loaded it (the target's `native_kernels: true` is not consent to
    # re-lay a draft object passed in)
    native = config.native_kernels if fused else (False if config.native_kernels is False else None)
    return config.model_copy(update={"fused_decoder": fused, "native_kernels": native,
                                     "quantization": config.draft_quantization,
                                     "cuda_graphs": config.cuda_graphs if fused else None})


def build_runner(loaded: LoadedModel, kv_cache: PagedKVCache, config: EngineConfig) -> ModelRunner:
    """The runner for `loaded` under an engine's `config`: fused or transformers forward, prepacked or not, native
    kernels or not, int8 weights or not.

    Raises:
        ConfigError: an option asks for what cannot run here (each message names the option and says why).
    """
    quantization = config.quantization
    geometry = model_geometry(loaded.model)
    max_model_len = min(config.max_model_len or geometry.max_model_len, geometry.max_model_len)
    # quantized copies leave the module's own weights alone, so a model object passed in can be quantized in the
    # fused decoder too; a model it cannot take (or `fused_decoder: false`) quantizes its own linear layers
    setting = config.fused_decoder
    if quantization is not None and setting is None and fused_decoder_refusal(loaded.model) is None:
        setting = True
    fused = wants_fused_decoder(loaded.model, setting, loaded.owned)
    native = wants_native_kernels(loaded.model, config.native_kernels, quantization is not None) if fused else None
    if quantization is not None and fused and native is None:
        raise ConfigError(_quantization_refusal(quantization, loaded))
    if not fused:
        relay_unfused_linears(loaded, config)
    graphs = wants_cuda_graphs(loaded, config.cuda_graphs, fused, max_model_len)
    return ModelRunner(loaded.model, kv_cache, fused=fused, prepack_weights=config.prepack_weights, native=native,
                       quantization=quantization, cuda_graphs=graphs, max_num_seqs=config.max_num_seqs,
                       max_model_len=max_model_len, bf16_gemm=wants_bf16_gemm(loaded, config))


def _quantization_refusal(quantization: str, loaded: LoadedModel) -> str:
    return (f"quantization {quantization!r} multiplies on the native kernels, which cannot run here (they need "
            f"float32 weights on a CPU, a C compiler, and native_kernels not false; this model is {loaded.dtype} on "
            f"{loaded.device})")


def relay_unfused_linears(loaded: LoadedModel, config: EngineConfig) -> int:
    """For a model that runs its own transformers forward: re-lay its linear layers and multiply them the fused
    decoder's way (`relaid_linears`), on a CPU in float32. By default only where decodekit loaded the model itself
    (its weights change layout in place); `native_kernels: true` asks for it on a model object passed in too, and
    `false` keeps torch's products. With `quantization` the layers multiply compressed copies instead, owned or not
    (a model decodekit loaded then frees their float32 weights). Returns how many layers now run this way.

    Raises:
        ConfigError: `native_kernels` is true, or a `quantization` is asked, but this cannot run here (the message
            says why).
    """
    setting = config.native_kernels
    model = loaded.model
    quantization = config.quantization
    if quantization is not None and setting is False:
        raise ConfigError(_quantization_refusal(quantization, loaded))
    if setting is False or (setting is None and not loaded.owned and quantization is None):
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kernels = load_kernels()
    reason = None
    # a bfloat16 model decodekit loaded has its linear layers' bf16 copies made from its own weights, then the rest
    # (embeddings, norms) widened to float32: float32 activations, as the fused decoder runs a bf16 model
    widen = (quantization == "bf16" and loaded.owned and head is not None
             and head.weight.dtype == torch.bfloat16)
    if loaded.device.type != "cpu" or head is None or (head.weight.dtype != torch.float32 and not widen):
        dtype = None if head is None else head.weight.dtype
        reason = f"they run float32 on a CPU, not {dtype} on {loaded.device}"
    elif isinstance(kernels, str):
        reason = kernels
    if reason is not None:
        if quantization is not None:
            raise ConfigError(_quantization_refusal(quantization, loaded))
        if setting:
            raise ConfigError(f"native_kernels: {reason}; set native_kernels to false or leave it unset")
        return 0
    assert not isinstance(kernels, str)
    routed: tuple[int, str | None] | None = getattr(model, "decodekit_relaid_linears", None)
    if routed is not None:  # the same model object in a second engine: its layers already run their products
        if routed[1] != quantization:
            raise ConfigError(f"quantization {quantization!r}: this model object's linear layers already multiply "
                              f"{routed[1] or 'float32'} products for another engine; load a fresh copy")
        return routed[0]
    prepack = quantization is None and wants_prepacking(model, config.prepack_weights)
    count = relay_linears(model, prepack, kernels, quantization, release=loaded.owned,
                          bf16_gemm=wants_bf16_gemm(loaded, config))
    if widen:
        model.float()
    model.decodekit_relaid_linears = (count, quantization)
    log.info("%s runs its own forward; %d linear layers %s", loaded.name, count,
             f"multiply {quantization} copies" if quantization else "re-laid for the native single-row products")
    return count


def wants_cuda_graphs(loaded: LoadedModel, setting: bool | None, fused: bool, max_model_len: int | None = None
                      ) -> bool:
    """Whether to replay the fused decoder's uniform steps from CUDA graphs (`decodekit.core.cuda_graphs`): by
    default wherever they can run (the fused decoder on CUDA, with Triton for the attention kernel).

    Raises:
        ConfigError: `setting` is True but graphs cannot run here (the message says why).
    """
    if setting is False:
        return False
    reason = None
    if loaded.device.type != "cuda":
        reason = f"they need the model on a CUDA device, not {loaded.device}"
    elif not fused:
        reason = "they capture the fused decoder, which is off for this model"
    elif type(loaded.model).__name__ in GEMMA_ARCHITECTURES:
        reason = "the fused decoder's GPU kernels are written for the Llama block, not Gemma's"
    elif not kernel_available(loaded.device):
        reason = "the paged-attention kernel needs Triton, which is not installed"
    elif needs_capped_attention(_text_config(loaded.model), max_model_len):
        reason = "their paged-attention kernel reads whole contexts, and this model's sliding window is shorter"
    if reason is not None and setting:
        raise ConfigError(f"cuda_graphs: {reason}; set cuda_graphs to false or leave it unset")
    if reason is not None and loaded.device.type == "cuda":
        log.info("CUDA graphs off: %s", reason)
    return reason is None


@dataclass
class ForwardItem:
    """One sequence's part of a forward: its new tokens after `context_len` cached ones, and logits wanted."""

    token_ids: list[int]
    context_len: int
    block_table: list[int]
    num_logits: int  # logits for the last `num_logits` of the new tokens (0 for a mid-prompt chunk)
    num_hidden: int = 0  # last hidden states for the last `num_hidden` of the new tokens (`Strategy.hidden_states`)


class ModelRunner:
    """Runs a model over the paged KV cache it is given (a `PagedModel` owns both); turns a list of `ForwardItem`s
    into logits `[sum(num_logits), vocab]`.

    With `fused=True` the model runs through `FusedDecoder` (which re-lays its weights in place, or with
    `quantization` makes int8 copies of them); otherwise through its own transformers forward with the paged
    attention function.
    """

    def __init__(self, model: Any, kv_cache: PagedKVCache, fused: bool = False,
                 prepack_weights: bool | None = None, native: NativeKernels | None = None,
                 quantization: str | None = None, cuda_graphs: bool = False, max_num_seqs: int = 128,
                 max_model_len: int = 2048, bf16_gemm: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.pool.device
        self._config = model.config
        prepack = quantization is None and wants_prepacking(model, prepack_weights)
        self.fused = FusedDecoder(model, prepack, native, quantization, bf16_gemm) if fused else None
        # the GPU path: short queries attended in place by the token-table kernel, uniform steps from CUDA graphs
        capped = needs_capped_attention(_text_config(model), max_model_len) or has_attention_sinks(model)
        self.by_token = kernel_available(self.device) and not capped
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            assert self.fused is not None, "CUDA graphs capture the fused decoder"
            self.graphs = DecodeGraphs(self.fused, kv_cache, max_num_seqs, max_model_len)

    def forward(self, items: list[ForwardItem], block_copies: list[tuple[int, int]]) -> torch.Tensor:
        """Run one packed forward pass and return float32 logits for the requested positions, in item order."""
        return self.forward_with_hidden(items, block_copies)[0]

    @torch.inference_mode()
    def forward_with_hidden(self, items: list[ForwardItem], block_copies: list[tuple[int, int]]
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the last hidden states (the final norm's output, the LM head's input) of the positions
        the items ask for (`num_hidden`), in item order; None when none asks."""
        self.kv_cache.copy_blocks(block_copies)
        flat: list[int] = []
        logit_index: list[int] = []
        hidden_rows: list[int] = []
        for it in items:
            flat.extend(it.token_ids)
            logit_index.extend(range(len(flat) - it.num_logits, len(flat)))
            hidden_rows.extend(range(len(flat) - it.num_hidden, len(flat)))
        if self.graphs is not None and self.graphs.accepts(items):
            try:
                return self.graphs.run(items, logit_index, hidden_rows)
            except GraphCaptureFailed:
                pass  # logged; the graphs are now off and this step runs eagerly below
        keep = torch.tensor(logit_index, dtype=torch.long, device=self.device)
        hidden_index = torch.tensor(hidden_rows, dtype=torch.long, device=self.device) if hidden_rows else None
        layout, positions = build_layout(
            [len(it.token_ids) for it in items], [it.context_len for it in items],
            [it.block_table for it in items], self.kv_cache.block_size, self.device, by_token=self.by_token,
        )
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)[None]
        self.kv_cache.layout = layout
        if self.fused is not None:
            plan = None
            query_lens = [len(it.token_ids) for it in items]
            short_tokens = sum(q for q in query_lens if q <= BATCHED_MAX_QUERY)
            if self.fused.native is not None and short_tokens <= NATIVE_MAX_TOKENS:
                plan = DecodeAttentionPlan(layout.slot_mapping, query_lens, [it.context_len for it in items],
                                           [it.block_table for it in items], self.kv_cache.block_size)
            try:
                logits = self.fused(input_ids[0], positions, self.kv_cache, keep, plan, hidden_index).float()
                return logits, None if hidden_index is None else self.fused.last_hidden
            finally:
                self.kv_cache.layout = None
                self.fused.last_hidden = None
        # A step where a strategy reads hidden states still runs the whole causal-LM forward (so whatever the model
        # does after its LM head, e.g. Gemma 2's logit soft-cap or Granite's scaling, applies) and takes the base
        # model's last hidden state (after its final norm: the LM head's input) as it passes.
        captured: list[torch.Tensor] = []
        hook = None
        # Switch attention only for this call, so the same model object stays usable by plain transformers
        # (`generate` with padding masks) between engine steps.
        previous = self._config._attn_implementation
        self._config._attn_implementation = ATTENTION_NAME
        try:
            if hidden_index is not None:
                base = self.model.base_model
                if base is self.model or self.model.get_output_embeddings() is None:
                    raise ValueError(f"{type(self.model).__name__} has no separate base model and LM head, so its "
                                     "hidden states cannot be read")
                hook = base.register_forward_hook(lambda _m, _a, output: captured.append(output[0]))
            out = self.model(
                input_ids=input_ids,
                position_ids=positions[None],
                past_key_values=self.kv_cache,
                use_cache=True,
                logits_to_keep=keep,
                paged_kv_cache=self.kv_cache,
            )
        finally:
            self._config._attn_implementation = previous
            self.kv_cache.layout = None
            if hook is not None:
                hook.remove()
        hidden = None if hidden_index is None else captured[-1][0].index_select(0, hidden_index)
        return out.logits[0].float(), hidden
