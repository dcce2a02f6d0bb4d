"""How a model runs: the one decision, made once per model (and its draft) when an engine is built.

`plan_execution(loaded, config, draft)` reads the model, the engine's options and the machine, and returns an
`ExecutionPlan`: fused decoder or transformers' own forward, native kernels, prepacked weights, the weight format
(bf16 or int8 copies), bf16 products, re-laid linear layers, CUDA graphs, the KV pool's dtype and size, and the
model's geometry, each with the reason where it was not the obvious one. Everything after this reads the plan
(`ModelExecutor` builds the model's runner and pool from it, the engine its limits); nothing asks the model again.
An option asking for what cannot run here is refused here, naming the option and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from decodekit.api.config import EngineConfig
from decodekit.api.errors import ConfigError
from decodekit.api.models import LoadedModel, StoredWeight
from decodekit.execution.attention.gpu import kernel_available
from decodekit.execution.attention.kv_cache import PagedKVCache, needs_capped_attention, uniform_window
from decodekit.execution.fused.blocks import GEMMA_ARCHITECTURES, fused_decoder_refusal
from decodekit.execution.fused.layer_stack import stack_max_rows, stack_refusal
from decodekit.execution.fused.stored_matrices import STORED_QUANTIZATION
from decodekit.execution.fused.weight_matrices import (
    BF16_GEMM_MIN_ROWS,
    onednn_bf16_available,
    prepacking_available,
)
from decodekit.execution.geometry import ModelGeometry, model_geometry, text_config
from decodekit.execution.kernels.native import NativeKernels, load_kernels
from decodekit.execution.kernels.quant import ACTIVATIONS_VARIABLE, fixed_point_formats
from decodekit.execution.parallel.shard import shard_refusal
from decodekit.models.gguf_weights import stored_formats
from decodekit.models.loader import cpu_has_bf16_dot_products

log = logging.getLogger("decodekit.runner")

# The largest extra weight copy `prepack_weights` makes by default.
PREPACK_DEFAULT_LIMIT = 2 << 30

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# `decode_run_steps` left unset: a lone request's greedy tokens per call at most. On a CPU a token costs 2.5-20 ms and
# a step's Python ~0.1-0.4 ms; runs are cut to ~0.1 s of tokens by the engine's timing (`timed_run_steps`: 8 for a
# float32 token of the bundled model, 32 for its GGUF, whose token paid 0.07 ms of Python in runs of 8 against 0.03
# in runs of 32: 2.5% of it) and end early when a request arrives (`RunInterrupt`). A GPU token of a small model
# costs ~1 ms or less from a graph, about what the step's Python costs, so a replay makes 32
# (`DecodeGraphs.decode_run`).
CPU_RUN_STEPS = 32
GRAPH_RUN_STEPS = 32


@dataclass(frozen=True)
class RelayPlan:
    """How a model that runs its own transformers forward has its linear layers re-laid (`relaid_linears`)."""

    kernels: NativeKernels
    prepack: bool
    quantization: str | None
    widen: bool  # a bfloat16 model decodekit loaded: bf16 copies of its linears, the rest widened to float32
    bf16_gemm: bool


@dataclass(frozen=True)
class ExecutionPlan:
    """How one model runs under an engine's options; `draft` is its draft model's plan, where there is one."""

    config: EngineConfig
    """The engine's options as they apply to this model (a bfloat16 model on a CPU gets `quantization: bf16`; a
    draft has its own `fused_decoder`, `native_kernels`, `quantization` and `cuda_graphs`)."""
    geometry: ModelGeometry
    max_model_len: int
    window: int | None
    """Where every layer attends only its last `window` keys (blocks behind it can be released)."""
    fused: bool
    kernels: NativeKernels | None
    """The native kernels the fused decoder uses (None: torch's ops)."""
    prepack: bool
    """Whether the fused decoder keeps oneDNN-blocked float32 weight copies."""
    quantization: str | None
    bf16_gemm: bool
    """Whether steps of several rows multiply bf16 copies on the CPU's bf16 dot products."""
    relay: RelayPlan | None
    """For a model that runs its own forward: how its linear layers are re-laid (None: left as they are)."""
    cuda_graphs: bool
    compute_dtype: torch.dtype
    kv_dtype: torch.dtype
    reasons: tuple[str, ...] = ()
    """Why a choice was not the obvious one (a fused decoder off, kernels off, prepacking off), for logs and checks."""
    draft: ExecutionPlan | None = field(default=None)
    stored_formats: dict[str, int] = field(default_factory=dict)
    """With `quantization: gguf`: the formats of the weights multiplied as the file stores them, and how many of
    each."""
    native_stack: int = 0
    """The most rows of a step whose whole stack of layers runs in one native call (`fused.layer_stack`); 0: every
    step runs layer by layer."""
    tensor_parallel: int = 1
    """How many ranks the model is split over (`execution.parallel`); `geometry` is then one rank's (its share of
    the KV heads), and so are the KV pool's blocks."""

    def describe(self) -> str:
        """How the model runs, in one line (`decodekit recipe check` prints it)."""
        if self.fused:
            parts = ["fused decoder", "native kernels" if self.kernels is not None else "torch's small ops"]
            if self.quantization == STORED_QUANTIZATION:
                formats = ", ".join(f"{count} {fmt}" for fmt, count in self.stored_formats.items())
                parts.append(f"GGUF weights as stored ({formats})")
            elif self.quantization is not None:
                parts.append(f"{self.quantization} weights" + (" (bf16 products)" if self.bf16_gemm else ""))
            elif self.prepack:
                parts.append("prepacked weights")
        else:
            parts = ["transformers' forward"]
            if self.relay is not None:
                parts.append(f"linear layers in {self.relay.quantization}" if self.relay.quantization
                             else "re-laid linear layers")
        if self.cuda_graphs:
            parts.append(f"CUDA graphs (a lone greedy request's runs of up to {self.config.decode_run_steps} tokens a "
                         "replay)")
        dtype = str(self.compute_dtype).removeprefix("torch.")
        parts += [f"{dtype} activations", f"{str(self.kv_dtype).removeprefix('torch.')} KV cache"]
        if self.native_stack:
            rows = "one row" if self.native_stack == 1 else f"up to {self.native_stack} rows"
            parts.append(f"the layers of steps of {rows} in one native call")
        if self.tensor_parallel > 1:
            parts.append(f"split over {self.tensor_parallel} ranks (tensor parallel)")
        return ", ".join(parts)

    def for_model(self, loaded: LoadedModel) -> ExecutionPlan:
        """The plan of another model (a proposer's own) under this plan's options."""
        config = self.config.model_copy(update={"tensor_parallel_size": 1})  # a proposer's model runs unsplit
        return plan_model(loaded, config, fused_decoder_refusal(loaded.model))

    def kv_block_bytes(self) -> int:
        """The bytes of one KV block of this model (every layer's keys and values of `block_size` tokens)."""
        geometry = self.geometry
        return PagedKVCache.bytes_per_token(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                                            self.kv_dtype) * self.config.block_size

    def kv_pool_blocks(self) -> int:
        """How many KV blocks `config.kv_cache_memory` holds for this model.

        Raises:
            ConfigError: fewer than two blocks fit.
        """
        config, per_block = self.config, self.kv_block_bytes()
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 2:
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory} bytes holds fewer than 2 blocks of "
                              f"{per_block} bytes; raise it")
        return num_blocks


def plan_from_config(model_config: dict[str, Any], name: str, dtype: torch.dtype, device: torch.device,
                     config: EngineConfig, draft_config: dict[str, Any] | None = None,
                     draft_dtype: torch.dtype | None = None, self_draft: bool = False,
                     stored: Callable[[Any], dict[str, StoredWeight]] | None = None) -> ExecutionPlan | None:
    """The plan a model (and its draft) would get here, from config.json alone: nothing is loaded (each model's
    skeleton is built on the meta device, and one the fused decoder cannot take keeps its config's KV geometry,
    unprobed). What `decodekit recipe check` reports and checks. None where transformers cannot build a model from
    the config (an architecture it does not know: `run` finds out when it loads). `self_draft`: the draft is the
    target itself (`draft: {model: target}`). `stored`: the loader's `stored` for this model (the weights its file
    keeps as stored, read for the skeleton without their data), where it keeps them.

    Raises:
        ConfigError: an option asks for what cannot run here (the message names the option).
    """
    target = _skeleton(model_config, name, dtype, device)
    if target is None:
        return None
    if stored is not None:
        target.stored = stored(target.model)
    draft = target if self_draft else None
    if draft_config is not None:
        draft = _skeleton(draft_config, "draft", draft_dtype or dtype, device)
        if draft is None:
            return None
    return plan_execution(target, config, draft)


def _skeleton(model_config: dict[str, Any], name: str, dtype: torch.dtype, device: torch.device
              ) -> LoadedModel | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in model_config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(model_config.get("model_type", ""), **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except Exception as exc:  # whatever transformers raises for a config it cannot build
        log.info("no plan for %s from its config.json: %r", name, exc)
        return None
    return LoadedModel(model, None, name, dtype, device)


def plan_execution(loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None) -> ExecutionPlan:
    """Decide how `loaded` (and its `draft`, for speculative decoding) runs under `config` on this machine.

    Raises:
        ConfigError: an option asks for what cannot run here (each message names the option and says why).
        UnsupportedModelError: the model cannot be paged.
    """
    refusal = fused_decoder_refusal(loaded.model)
    if config.tensor_parallel_size == 1:  # a split model keeps its own weights (`_tensor_parallel`)
        config = _bf16_weights_on_cpu(loaded, config, refusal)
    draft_plan = None
    if draft is not None:
        # the draft's options are checked now: a draft the fused decoder cannot take is refused when the engine is
        # built, not at the first speculative request
        draft_refusal = refusal if draft.model is loaded.model else fused_decoder_refusal(draft.model)
        draft_plan = plan_model(draft, _draft_config(config, draft, loaded, draft_refusal), draft_refusal)
    return plan_model(loaded, config, refusal, draft_plan)


def plan_model(loaded: LoadedModel, config: EngineConfig, refusal: str | None,
               draft: ExecutionPlan | None = None) -> ExecutionPlan:
    """The plan of one model under options already made its own (`plan_execution` makes them: the bf16 default and
    a draft's options); `refusal` is `fused_decoder_refusal(loaded.model)`."""
    reasons: list[str] = []
    geometry = model_geometry(loaded.model, refusal, probe=not _is_skeleton(loaded.model))
    ranks = config.tensor_parallel_size
    if ranks > 1:
        geometry = _tensor_parallel(loaded, config, geometry, reasons)
    max_model_len = min(config.max_model_len or geometry.max_model_len, geometry.max_model_len)
    quantization: str | None = config.quantization
    # quantized copies leave the module's own weights alone, so a model object passed in can be quantized in the
    # fused decoder too; a model it cannot take (or `fused_decoder: false`) quantizes its own linear layers
    setting = config.fused_decoder
    if quantization is not None and setting is None and refusal is None:
        setting = True
    fused = _wants_fused_decoder(loaded, setting, refusal, reasons)
    kernels = _wants_native_kernels(loaded, config.native_kernels, quantization is not None, reasons) if fused else None
    if quantization is not None and fused and kernels is None:
        raise ConfigError(_quantization_refusal(quantization, loaded))
    formats = stored_formats(loaded.stored) if ranks == 1 else {}
    if quantization == STORED_QUANTIZATION and not formats:
        raise ConfigError(f"quantization {STORED_QUANTIZATION!r}: {loaded.name} brings no GGUF quantized weights to "
                          "multiply as stored (a .gguf file, or the bundled model, loaded with dtype auto on a CPU "
                          "does); leave it unset")
    if formats and quantization in (None, STORED_QUANTIZATION):
        quantization = _stored_weights(formats, fused, kernels, reasons, asked=quantization is not None)
    prepack = quantization is None and _wants_prepacking(loaded, config.prepack_weights, reasons)
    bf16_gemm = _wants_bf16_gemm(loaded, config)
    relay = None if fused or ranks > 1 else _plan_relaid_linears(loaded, config, prepack, bf16_gemm)
    graphs = ranks == 1 and _wants_cuda_graphs(loaded, config.cuda_graphs, fused, max_model_len, reasons)
    if quantization == STORED_QUANTIZATION:
        config = config.model_copy(update={"quantization": quantization})  # float32 activations (`_compute_dtype`)
    elif config.quantization == STORED_QUANTIZATION:
        config = config.model_copy(update={"quantization": None})  # asked, and refused above
    if config.decode_run_steps is None:  # a GPU token costs about what a step's Python does: longer runs there
        config = config.model_copy(update={"decode_run_steps": GRAPH_RUN_STEPS if graphs else CPU_RUN_STEPS})
    stack = _native_stack_rows(loaded, kernels, quantization, bf16_gemm, reasons) if fused and ranks == 1 else 0
    return ExecutionPlan(config, geometry, max_model_len, uniform_window(loaded.model), fused, kernels, prepack,
                         quantization, bf16_gemm, relay, graphs, _compute_dtype(loaded, config),
                         kv_cache_dtype(loaded, config), tuple(reasons), draft,
                         formats if quantization == STORED_QUANTIZATION else {}, stack, ranks)


def _tensor_parallel(loaded: LoadedModel, config: EngineConfig, geometry: ModelGeometry, reasons: list[str]
                     ) -> ModelGeometry:
    """One rank's geometry of a model split over `config.tensor_parallel_size` ranks (its share of the KV heads),
    and what the split turns off: the native layer stack and CUDA graphs (their products are not the row-parallel
    ones with an all-reduce), re-laid linear layers and GGUF weights as stored.

    Raises:
        ConfigError: the heads, KV heads or MLP width do not divide by the ranks (the numbers named), the model is
            not made of the Llama block's linear layers, or a `quantization` or `cuda_graphs: true` is asked.
    """
    ranks = config.tensor_parallel_size
    refusal = shard_refusal(loaded.model, ranks)
    if refusal is not None:
        raise ConfigError(refusal)
    if config.quantization is not None:
        raise ConfigError(f"quantization {config.quantization!r}: a model split over tensor_parallel_size {ranks} "
                          "ranks multiplies its own weights' shards; leave quantization unset")
    if config.cuda_graphs:
        raise ConfigError(f"cuda_graphs: the graphs capture one process's forward, not one split over "
                          f"tensor_parallel_size {ranks} ranks; set cuda_graphs to false or leave it unset")
    reasons.append("tensor parallel: the layers run one at a time, without CUDA graphs or re-laid linears")
    return replace(geometry, num_kv_heads=geometry.num_kv_heads // ranks)


def _native_stack_rows(loaded: LoadedModel, kernels: NativeKernels | None, quantization: str | None,
                       bf16_gemm: bool, reasons: list[str]) -> int:
    """The most rows of a step the fused decoder runs as one native call for its whole layer stack
    (`fused.layer_stack`: at batch 1 that replaces ~8 ctypes calls per layer and their Python glue), 0 for none: on
    the native kernels, for the plain Llama block; why not where they run but the block is another."""
    if kernels is None:
        return 0
    refusal = stack_refusal(loaded.model)
    if refusal is not None:
        reasons.append(f"layers one native call at a time: {refusal}")
        return 0
    return stack_max_rows(quantization, bf16_gemm, kernels.gemv_max_rows)


def _stored_weights(formats: dict[str, int], fused: bool, kernels: NativeKernels | None, reasons: list[str],
                    asked: bool) -> str | None:
    """`quantization: gguf` (the file's quantized weights multiplied as stored) where the fused decoder and its
    native kernels run the model, else None (the module's dequantized weights run); the reason either way. `asked`:
    the options name `quantization: gguf` (so not running it is refused).

    Raises:
        ConfigError: it was asked and cannot run, or `DECODEKIT_QUANT_ISA` names a code path this CPU's kernels do
            not have.
    """
    listed = ", ".join(f"{count} {fmt}" for fmt, count in formats.items())
    why = "the fused decoder is off" if not fused else "the native kernels are off" if kernels is None else None
    if why is not None:
        if asked:
            raise ConfigError(f"quantization {STORED_QUANTIZATION!r}: the GGUF weights multiply on the fused decoder's "
                              f"native kernels, and {why} here; leave it unset")
        reasons.append(f"GGUF weights ({listed}) run dequantized to float32: {why}")
        return None
    assert kernels is not None
    try:
        isa = kernels.quant.isa()
        fixed_point = fixed_point_formats(isa)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if fixed_point:
        named = " and ".join([", ".join(fixed_point[:-1]), fixed_point[-1]] if len(fixed_point) > 1 else fixed_point)
        activations = (f"{named} times activations rounded to 16-bit fixed point per block of 32, the "
                       f"rest float32 ({ACTIVATIONS_VARIABLE}=float32 keeps float32 activations)")
    else:
        activations = "float32 activations: the dequantized float32 model's outputs up to summation order"
    reasons.append(f"weights: the GGUF file's blocks ({listed}) multiplied as stored, dequantized inside the {isa} "
                   f"products ({activations}); dtype float32 runs the dequantized model")
    return STORED_QUANTIZATION


def _is_skeleton(model: Any) -> bool:
    """Whether `model` is a skeleton on the meta device (`plan_from_config`): no weights to read or run."""
    return any(p.device.type == "meta" for p in model.parameters())


def _head(loaded: LoadedModel) -> tuple[torch.dtype, torch.device]:
    """The LM head weight's dtype and device; for a skeleton, the dtype and device the model would load in."""
    weight = loaded.model.get_output_embeddings().weight
    return (loaded.dtype, loaded.device) if weight.device.type == "meta" else (weight.dtype, weight.device)


def _wants_fused_decoder(loaded: LoadedModel, setting: bool | None, reason: str | None, reasons: list[str],
                         key: str = "fused_decoder") -> bool:
    """Whether to run `model` through `FusedDecoder`: `setting` True/False forces it, None means "when decodekit
    loaded the model itself and its architecture allows" (the fused decoder re-lays weights in place). `reason` is
    why the fused decoder cannot take the model (None: it can).

    Raises:
        ConfigError: `setting` is True but the model cannot be fused (the message names `key` and says why).
    """
    if setting and reason is not None:
        raise ConfigError(f"{key}: {reason}; set {key} to false or leave it unset")
    head = _head(loaded) if reason is None else None
    if setting is None and head is not None and head[1].type == "cpu" and head[0] != torch.float32:
        # torch's bf16 / fp16 products on a CPU, on the fused decoder's column-major weights, ran 10x slower than
        # transformers' own forward (SmolLM2 bf16 with native_kernels false: 2.4 against 24.8 tok/s, 2-core AVX2);
        # a bf16 model gets the fused decoder through its bf16 copies instead (`_bf16_weights_on_cpu`)
        reason = f"{head[0]} weights on a CPU run faster in transformers' own forward"
    if setting is None and reason is not None:
        log.info("fused decoder off: %s", reason)
        reasons.append(f"fused decoder off: {reason}")
    return reason is None and (setting if setting is not None else loaded.owned)


def _wants_prepacking(loaded: LoadedModel, setting: bool | None, reasons: list[str]) -> bool:
    """Whether the fused decoder (or the re-laid linears of another model) keeps oneDNN-blocked weight copies: only
    where they work (CPU, float32), and by default only when the copy is at most `PREPACK_DEFAULT_LIMIT` bytes."""
    dtype, device = _head(loaded)
    if setting is False:
        return False
    if not prepacking_available(dtype, device):
        if setting:
            log.warning("prepack_weights: oneDNN-blocked weights need float32 on a CPU with oneDNN; %s on %s "
                        "keeps BLAS products", dtype, device)
        return False
    size = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if setting is None and size > PREPACK_DEFAULT_LIMIT:
        log.info("prepack_weights off: a second copy of %.1f GiB of weights is over the default limit", size / 2**30)
        reasons.append(f"prepack_weights off: a second copy of {size / 2**30:.1f} GiB is over the default limit")
        return False
    return True


def _wants_native_kernels(loaded: LoadedModel, setting: bool | None, quantized: bool, reasons: list[str]
                          ) -> NativeKernels | None:
    """The native kernels the fused decoder should use for `model`: on a CPU, for float32 weights (or any float
    weights when `quantized`: the products then run on float32 activations over compressed copies), and by default
    only where they build (a C compiler is found).

    Raises:
        ConfigError: `setting` is True but the kernels cannot run here (the message says why).
    """
    if setting is False:
        return None
    dtype, device = _head(loaded)
    if (dtype != torch.float32 and not quantized) or device.type != "cpu":
        if setting:
            raise ConfigError(f"native_kernels: they run float32 on a CPU, not {dtype} on {device}; "
                              "set native_kernels to false or leave it unset")
        return None
    kernels = load_kernels()
    if isinstance(kernels, str):
        if setting:
            raise ConfigError(f"native_kernels: {kernels}; set native_kernels to false or leave it unset")
        log.warning("native kernels off (%s): small ops stay in torch", kernels)
        reasons.append(f"native kernels off: {kernels}")
        return None
    return kernels


def _bf16_weights_on_cpu(loaded: LoadedModel, config: EngineConfig, refusal: str | None,
                         key: str = "quantization") -> EngineConfig:
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
        fused = config.draft_fused_decoder  # else the draft follows the target's choice (`_draft_config`)
    # a model the fused decoder cannot take gets bf16 copies in its own linear layers (`relaid_linears`), and its
    # other weights widened to float32: only where decodekit loaded it (a model object passed in keeps its dtype)
    own_layers = refusal is not None
    if (loaded.device.type != "cpu" or loaded.dtype != torch.bfloat16 or getattr(config, key) is not None
            or fused is False or config.native_kernels is False or (own_layers and not loaded.owned)
            or isinstance(load_kernels(), str)):
        return config
    log.info("%s: bfloat16 on a CPU runs as bf16 weights multiplied in float32 (%s bf16); float32 activations",
             loaded.name, key)
    return config.model_copy(update={key: "bf16"})


def _wants_bf16_gemm(loaded: LoadedModel, config: EngineConfig) -> bool:
    """Whether `loaded`'s bf16 copies (`quantization: bf16`, which a bfloat16 model on a CPU gets by default:
    `_bf16_weights_on_cpu`) multiply steps of several rows on the CPU's bf16 dot products (oneDNN's bf16 GEMM,
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


def _compute_dtype(loaded: LoadedModel, config: EngineConfig) -> torch.dtype:
    """The dtype of the activations (and of the KV cache unless `kv_cache_dtype` says otherwise): the model's, except
    for quantized weights on a CPU, which are multiplied in float32."""
    return torch.float32 if config.quantization is not None else loaded.dtype


def kv_cache_dtype(loaded: LoadedModel, config: EngineConfig) -> torch.dtype:
    """The KV pool's element dtype: `config.kv_cache_dtype`, where "auto" is the model's dtype (vLLM's rule) where
    the pool can hold it under the activations (float32 or bfloat16), else the activations' (`_compute_dtype`). So
    a bfloat16 model on a CPU, whose bf16 weights are multiplied in float32, keeps a bf16 cache (half the bytes per
    token, attended in float32), and a float32 model with int8 weights a float32 one.

    Raises:
        ConfigError: a dtype other than the activations' is asked off the CPU (the GPU kernels write and read the
            pool in the model's dtype).
    """
    compute = _compute_dtype(loaded, config)
    if config.kv_cache_dtype == "auto":
        return loaded.dtype if loaded.dtype in KV_CACHE_DTYPES.values() else compute
    dtype = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if dtype != compute and loaded.device.type != "cpu":
        raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype}: on {loaded.device.type} the KV cache holds the "
                          f"activations' dtype ({str(compute).removeprefix('torch.')}); leave it auto there")
    return dtype


def _draft_config(config: EngineConfig, draft: LoadedModel, target: LoadedModel, refusal: str | None
                  ) -> EngineConfig:
    """The engine options a draft model runs under: the engine's, with `fused_decoder` from
    `draft_fused_decoder` (unset: the target's explicit `fused_decoder` where the draft can follow it, else the
    default rule) and the native kernels only where the draft is fused. `refusal` is
    `fused_decoder_refusal(draft.model)`.

    A `draft_quantization` runs in the fused decoder where the draft can be fused (copies beside the module), else
    on the draft's own linear layers (`relaid_linears`), which a self-draft cannot do: it shares the `target`'s
    modules.

    Raises:
        ConfigError: `draft_fused_decoder` is True but the draft cannot be fused, or a quantized self-draft cannot.
    """
    config = _bf16_weights_on_cpu(draft, config, refusal, key="draft_quantization")
    setting = config.draft_fused_decoder
    fusable = refusal is None
    if config.draft_quantization is not None:  # quantized copies leave the module as it is, owned or not
        if setting is False or not fusable:
            if draft.model is target.model:
                why = ("draft_fused_decoder is false" if setting is False
                       else f"the fused decoder cannot take it ({refusal})")
                raise ConfigError(f"draft_quantization: a quantized self-draft is a compressed copy the fused decoder "
                                  f"keeps beside the target's own modules, and {why}; draft with a separate model, or "
                                  "with the n-gram proposer")
            setting = False
        else:
            setting = True
    if setting is None and config.fused_decoder is not None and (fusable or not config.fused_decoder):
        setting = config.fused_decoder  # the target's explicit choice, where the draft can follow it
    key = "draft_quantization" if config.draft_quantization is not None else "draft_fused_decoder"
    fused = _wants_fused_decoder(draft, setting, refusal, [], key=key)
    if not fused and config.draft_fused_decoder is None and setting is None and fusable:
        log.warning("the draft model %s runs the transformers forward (a model object passed in is not re-laid in "
                    "place unless asked); draft_fused_decoder=True runs it through the fused decoder, about twice "
                    "as fast", draft.name)
    # an unfused draft runs eagerly even where the target's `cuda_graphs: true` (graphs capture the fused decoder),
    # and gets re-laid linears only where decodekit loaded it (the target's `native_kernels: true` is not consent to
    # re-lay a draft object passed in)
    native = config.native_kernels if fused else (False if config.native_kernels is False else None)
    # the draft runs unsplit on rank 0 (`tensor_parallel_size` 1)
    return config.model_copy(update={"fused_decoder": fused, "native_kernels": native,
                                     "quantization": config.draft_quantization,
                                     "cuda_graphs": config.cuda_graphs if fused else None,
                                     "tensor_parallel_size": 1})


def _quantization_refusal(quantization: str, loaded: LoadedModel) -> str:
    return (f"quantization {quantization!r} multiplies on the native kernels, which cannot run here (they need "
            f"float32 weights on a CPU, a C compiler, and native_kernels not false; this model is {loaded.dtype} on "
            f"{loaded.device})")


def _plan_relaid_linears(loaded: LoadedModel, config: EngineConfig, prepack: bool, bf16_gemm: bool
                         ) -> RelayPlan | None:
    """For a model that runs its own transformers forward: whether its linear layers are re-laid and multiplied the
    fused decoder's way (`relaid_linears`), on a CPU in float32. By default only where decodekit loaded the model
    itself (its weights change layout in place); `native_kernels: true` asks for it on a model object passed in too,
    and `false` keeps torch's products. With `quantization` the layers multiply compressed copies instead, owned or
    not (a model decodekit loaded then frees their float32 weights).

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
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kernels = load_kernels()
    reason = None
    # a bfloat16 model decodekit loaded has its linear layers' bf16 copies made from its own weights, then the rest
    # (embeddings, norms) widened to float32: float32 activations, as the fused decoder runs a bf16 model
    dtype = None if head is None else _head(loaded)[0]
    widen = quantization == "bf16" and loaded.owned and dtype == torch.bfloat16
    if loaded.device.type != "cpu" or head is None or (dtype != torch.float32 and not widen):
        reason = f"they run float32 on a CPU, not {dtype} on {loaded.device}"
    elif isinstance(kernels, str):
        reason = kernels
    if reason is not None:
        if quantization is not None:
            raise ConfigError(_quantization_refusal(quantization, loaded))
        if setting:
            raise ConfigError(f"native_kernels: {reason}; set native_kernels to false or leave it unset")
        return None
    assert not isinstance(kernels, str)
    return RelayPlan(kernels, prepack, quantization, widen, bf16_gemm)


def _wants_cuda_graphs(loaded: LoadedModel, setting: bool | None, fused: bool, max_model_len: int | None,
                       reasons: list[str]) -> bool:
    """Whether to replay the fused decoder's uniform steps from CUDA graphs (`execution.cuda_graphs`): by default
    wherever they can run (the fused decoder on CUDA, with Triton for the attention kernel).

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
    elif needs_capped_attention(text_config(loaded.model), max_model_len):
        reason = "their paged-attention kernel reads whole contexts, and this model's sliding window is shorter"
    if reason is not None and setting:
        raise ConfigError(f"cuda_graphs: {reason}; set cuda_graphs to false or leave it unset")
    if reason is not None and loaded.device.type == "cuda":
        log.info("CUDA graphs off: %s", reason)
        reasons.append(f"CUDA graphs off: {reason}")
    return reason is None
