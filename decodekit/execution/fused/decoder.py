"""The fused decoder: a lean forward for Llama-family, Gemma and Phi-3 models over the paged KV cache.

At batch 1, transformers' modules spent ~25 ms of a ~75 ms SmolLM2 step here outside the matrix products, and
torch's single-row product streams the weights on one core. For
architectures whose layers are exactly "RMSNorm, attention with RoPE, RMSNorm, SiLU-gated MLP" (Llama, Mistral,
Qwen2 and their fine-tunes, SmolLM2 among them; Qwen3, whose queries and keys also pass a per-head RMSNorm before
RoPE; Gemma, whose block has (1 + w) norms and GELU-tanh gating; Gemma 2, which adds a norm of the attention's and
of the MLP's output before each residual add, local layers and soft-capped scores and logits; Gemma 3, with Qwen3's
query/key norms instead of the score cap and a RoPE table per layer type; Phi-3, the Llama block with q/k/v and
gate/up already fused into one linear each) this module runs the same math with fewer, larger operations:

- q/k/v and gate/up are fused into one product each; the residual add rides on the output product (Gemma 2 and 3
  norm that output first);
- weights keep their `[out, in]` layout (the fused ones stacked by rows, the modules viewing into the stack), which
  the native `dk_gemv` streams one weight row at a time on every thread for 1 to 8 rows (see `weight_matrices`);
- optionally (`prepack`), a second, oneDNN-blocked copy of each weight serves products of more rows
  (batched decode, beams, prefill), 1.4-1.8x faster than BLAS there;
- attention is the engine's own paged attention (`kv_cache.paged_attention`), so both paths share one cache;
- optionally (`quantization="int8"`), every product (the LM head too) runs on int8 copies of the weights with one
  float32 scale per output row, through the native `dk_linear_i8` kernel: ~3x faster per token at batch 1, no
  longer exact. The model's own weights are then left as they are, so an int8 copy of the target can serve as its
  speculative draft (`draft: {model: target, quantization: int8}`) beside the float forward of the same module;
- optionally (`quantization="bf16"`), every product runs on bfloat16 copies of the weights packed in panels,
  multiplied in float32 by `dk_linear_bf16` (llama.cpp's bf16 weights on a CPU): half the bytes per step, exact for
  weights that bf16 represents, at most 2^-9 (0.2%) relative rounding for others.

The fusion replaces the modules' parameters by views into the fused buffers, so the transformers module keeps
working (plain `generate` on it gives the same tokens) and no weight is stored twice (the prepacked copy aside).
RMSNorm and RoPE are bit-identical to transformers' in float32 (tested); the products themselves (fused,
native, blocked, residual inside `addmm`) can differ in the last bits, as BLAS results already do between batch
sizes, and the engine's exactness tests against `generate` run on both forwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.api.huge_pages import on_huge_pages
from decodekit.api.models import StoredWeight
from decodekit.execution.attention.gpu import attend_tokens, kernel_available
from decodekit.execution.attention.kv_cache import PagedKVCache, attend_chunks, paged_attention
from decodekit.execution.fused.block_copies import COPY_QUANTIZATIONS, copies_maker
from decodekit.execution.fused.blocks import (
    GEMMA3_BLOCK_ARCHITECTURES,
    GEMMA_ARCHITECTURES,
    block_fields,
    fused_decoder_refusal,
    head_counts,
    layer_window,
    norm_eps,
    norm_weight,
    projections,
    qkv_bias_of,
)
from decodekit.execution.fused.layer_stack import DecodeRun, NativeLayerStack, RunDraws, RunInterrupt
from decodekit.execution.fused.stored_matrices import (
    STORED_QUANTIZATION,
    LayerMatrix,
    StackMaker,
    stored_matrix_maker,
)
from decodekit.execution.fused.weight_matrices import BF16_GEMM_MIN_ROWS, Bf16Matrix, Matrix
from decodekit.execution.kernels import gpu_layer, gpu_ops
from decodekit.execution.kernels.native import NATIVE_GATING_MAX_ROWS, DecodeAttentionPlan, NativeKernels

log = logging.getLogger("decodekit.fused")

# The most keys (context and chunk) of a sequence whose prefill chunk the native attention takes (query by query)
# instead of SDPA: float32 and widened bf16 arithmetic, and bf16 dot products (`native_chunk_keys`).
NATIVE_CHUNK_MAX_KEYS = 512
NATIVE_CHUNK_MAX_KEYS_DOT = 1024


@dataclass
class _FusedLayer:
    """One decoder layer's weights, fused for the fused forward."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: LayerMatrix
    q_heads: int
    kv_heads: int
    o: LayerMatrix
    post_norm: torch.Tensor
    post_eps: float
    gate_up: LayerMatrix
    intermediate: int
    down: LayerMatrix
    scaling: float
    # Qwen3's per-head RMSNorms of queries and keys before RoPE (`[head_dim]` weights), None for the Llama block
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0
    window: int | None = None  # the layer's sliding window (Mistral, Qwen2's windowed layers), None: whole context
    # Gemma 2 and 3: the norms of the attention's and the MLP's outputs before each residual add (None: the Llama
    # block, whose residual add rides on the output product); Gemma: GELU-tanh gating instead of SiLU; Gemma 2: the
    # score cap; Gemma 3: the layer's RoPE table
    softcap: float | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    out_eps: float = 0.0
    gelu: bool = False
    rope: str | None = None


def _norm_queries_and_keys(layer: _FusedLayer, qkv: torch.Tensor, tokens: int) -> None:
    """Qwen3's query and key RMSNorms, in place on the fused q/k/v product (before RoPE), where the layer has them.

    Each is transformers' RMSNorm over one head (`_rms_norm`, bit-identical in float32)."""
    if layer.q_norm is None or layer.k_norm is None:
        return
    heads = qkv.view(tokens, layer.q_heads + 2 * layer.kv_heads, -1)
    query, key = heads[:, : layer.q_heads], heads[:, layer.q_heads: layer.q_heads + layer.kv_heads]
    query.copy_(_rms_norm(query, layer.q_norm, layer.qk_eps))
    key.copy_(_rms_norm(key, layer.k_norm, layer.qk_eps))


def _share(module: nn.Linear, weight_view: torch.Tensor) -> None:
    """Point `module.weight` at a view of a fused buffer (same values), so nothing is stored twice."""
    module.weight = nn.Parameter(weight_view, requires_grad=False)


def _fuse_rows(modules: list[nn.Linear]) -> torch.Tensor:
    """One `[sum(out), in]` buffer holding every module's weight, stacked by output rows; the modules then view into
    it (each a contiguous block of its rows)."""
    fused = on_huge_pages(torch.cat([module.weight.detach() for module in modules]))
    start = 0
    for module in modules:
        width = module.weight.shape[0]
        _share(module, fused[start:start + width])
        start += width
    return fused


def _own_rows(module: nn.Linear) -> torch.Tensor:
    """The module's `[out, in]` weight, made contiguous and moved onto huge pages in place where it is not yet (the
    module then holds the copy). A weight read from a memory-mapped file stays there (contiguous): a copy would not
    free the file's pages, only add its own."""
    weight = module.weight.detach()
    moved = on_huge_pages(weight.contiguous(), unless_file_mapped=True)
    if moved is not weight:
        _share(module, moved)
    return moved


def release_layer_weights(model: Any) -> int:
    """Swap the decoder layers' projection weights of `model` for meta tensors (same shape and dtype, no memory) and
    return the bytes that frees. For a model the engine owns, once a quantized `FusedDecoder` holds its own copies
    of them: the module's weights are then never read again, and keeping them would hold a bf16 model's weights
    twice, or an int8 model's float32 weights beside its int8 ones. The embeddings and the LM head stay (lookups,
    and proposers that reuse them); anything that runs the module's own forward afterwards fails on the meta
    weights rather than computing with stale ones."""
    freed = 0
    with torch.no_grad():
        for layer in model.model.layers:
            for part, name in projections(type(model).__name__, layer.self_attn, layer.mlp):
                module = getattr(part, name)
                weight = module.weight
                if weight.device.type == "meta":
                    continue
                freed += weight.numel() * weight.element_size()
                module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                             requires_grad=False)
    _trim_heap()
    return freed


def _trim_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc's `malloc_trim`; elsewhere nothing). Weights freed after
    loading sit in the heap's middle, where glibc keeps them: for SmolLM2 in bf16 the process stayed at its size
    after freeing 202 MiB of layer weights until trimmed, and then shrank by 230 MiB."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


class FusedDecoder:
    """Runs a Llama-family `*ForCausalLM` over the paged KV cache with fused weights.

    Building it stacks the model's q/k/v and gate/up weights in place (values unchanged), or with a `quantization`
    ("int8", "bf16") makes compressed copies of them and leaves the model as it is. Call it with the packed tokens of
    one engine step (the cache's layout must be set) to get logits for `logit_index`.

    With `native_stack` (and native kernels), steps of a few rows run the whole stack of layers in one native call
    (`layer_stack.NativeLayerStack`, bit for bit the per-layer path) where every layer is the plain Llama block;
    `self.native_stack` is then that stack, and setting it to None runs every step layer by layer.

    Raises:
        ValueError: the model is not fusable (see `fused_decoder_refusal`), or a quantization is asked without native
            kernels.
    """

    def __init__(self, model: Any, prepack: bool = False, native: NativeKernels | None = None,
                 quantization: str | None = None, bf16_gemm: bool = False,
                 stored: dict[str, StoredWeight] | None = None, native_stack: bool = False) -> None:
        reason = fused_decoder_refusal(model)
        if reason is not None:
            raise ValueError(f"the fused decoder cannot run this model: {reason}")
        weight = model.lm_head.weight
        if native is not None and ((weight.dtype != torch.float32 and quantization is None)
                                   or weight.device.type != "cpu"):
            raise ValueError(f"native kernels need float32 weights on the CPU (any float weights with a quantization), "
                             f"not {weight.dtype} on {weight.device}")
        known = (*COPY_QUANTIZATIONS, STORED_QUANTIZATION)
        if quantization is not None and (quantization not in known or native is None):
            raise ValueError(f"quantization {quantization!r}: the fused decoder has {list(known)}, which run on its "
                             "native kernels (float32 on a CPU with a C compiler)")
        if quantization == STORED_QUANTIZATION and not stored:
            raise ValueError(f"quantization {STORED_QUANTIZATION!r} multiplies the weights the model's file stores, "
                             "and none were given")
        self.native = native
        self.quantization = quantization
        # bf16 copies multiply several rows on the CPU's bf16 dot products (`execution.plan`)
        self.bf16_gemm = bf16_gemm and quantization == "bf16"
        head_dim = model.model.layers[0].self_attn.head_dim
        gemma = type(model).__name__ in GEMMA_ARCHITECTURES
        # the GPU path: steps attended by token table run their small ops as Triton kernels (`gpu_ops`), written for
        # the Llama block
        self.gpu_ops = kernel_available(weight.device) and head_dim & (head_dim - 1) == 0 and not gemma
        # ... and steps of up to this many rows run each layer as five launches (`gpu_layer`; 0: off), which the
        # plain Llama block allows (set after the layers are built)
        self.gpu_layer_rows = 0
        self._gpu_layer_proven: set[tuple[bool, bool, bool]] = set()  # kernel variants that ran once here
        base = model.model
        self.embed_tokens = base.embed_tokens  # Gemma's scales its rows by sqrt(hidden) itself
        self.rotary_emb = base.rotary_emb
        # Gemma 3 has a RoPE table per layer type (local and global layers), the Llama block one
        by_type = type(model).__name__ in GEMMA3_BLOCK_ARCHITECTURES
        self.rope_types: list[str] | None = sorted(set(model.config.layer_types)) if by_type else None
        self._rope_static = _static_rope(self.rotary_emb)
        self._rope_cache: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_positions = 0  # positions the cached tables cover
        # on a GPU, `[positions, 2 * head_dim]` rows of (cos, signed_sin) for every position the engine reaches
        # (`prepare_device_rope`), so a step's RoPE is one lookup instead of the rotary module's ~10 launches
        self._device_rope: torch.Tensor | None = None
        self.final_softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        # quantized copies are multiplied in float32 whatever the model's dtype (a bf16 model on a CPU: see
        # `execution.plan`), so the embeddings and norms they meet are float32 too
        self.dtype = torch.float32 if quantization is not None else weight.dtype
        # Gemma's (1 + w) stays float32: `_rms_norm` then multiplies before rounding to the activations' dtype
        self.final_norm = norm_weight(base.norm, gemma) if gemma else base.norm.weight.to(self.dtype)
        self.final_eps = norm_eps(base.norm)
        self.last_hidden: torch.Tensor | None = None  # the last call's hidden states at `hidden_index`
        self.prepacked = prepack and quantization is None
        if quantization is not None:
            assert native is not None
            make = (stored_matrix_maker(model, stored or {}, native) if quantization == STORED_QUANTIZATION
                    else copies_maker(quantization, self.bf16_gemm, native, model.lm_head))
            with torch.no_grad():
                self.layers = [self._quantize(layer, make, gemma, by_type) for layer in base.layers]
                self.lm_head: LayerMatrix = make([model.lm_head], None)
        else:
            with torch.no_grad():
                self.layers = [self._fuse(layer, prepack, native, gemma, by_type) for layer in base.layers]
                # a head tied to the input embeddings keeps sharing their Parameter (its rows are the lookups' rows)
                embeddings = model.get_input_embeddings()
                tied = embeddings is not None and embeddings.weight is model.lm_head.weight
                self.lm_head = Matrix(_own_rows(model.lm_head), None, prepack, native)
                if tied:
                    embeddings.weight = model.lm_head.weight
        # the rows moved onto huge pages left their old blocks in the C heap's middle: give them back
        _trim_heap()
        if self.gpu_ops and all(layer.attn_out_norm is None and not layer.gelu and isinstance(m, Matrix)
                                for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            self.gpu_layer_rows = gpu_layer.FUSED_MAX_ROWS
        self.native_stack: NativeLayerStack | None = (
            NativeLayerStack.build(self.layers, native) if native_stack and native is not None and not self.gpu_ops
            else None)
        # greedy runs of one sequence natively (`decode_run`): on the native stack, with one static RoPE table, no
        # final soft-cap and float32 activations
        self.decode_runner: DecodeRun | None = None
        if (self.native_stack is not None and native is not None and self.rope_types is None and self._rope_static
                and not self.final_softcap and self.dtype == torch.float32
                and type(self.embed_tokens) is torch.nn.Embedding):  # a plain lookup, no scaling of its own
            self.decode_runner = DecodeRun.build(self.native_stack, self.embed_tokens.weight.detach(),
                                                 self.final_norm, self.final_eps, self.lm_head, native)

    @staticmethod
    def _quantize(layer: Any, make: StackMaker, gemma: bool, rope_by_type: bool) -> _FusedLayer:
        """The layer's products as compressed weights (`make`: q/k/v and gate/up stacked by rows); the module is not
        touched."""
        attn, mlp = layer.self_attn, layer.mlp
        q_heads, kv_heads = head_counts(attn)
        if hasattr(attn, "qkv_proj"):  # Phi-3: already fused by rows, q then k then v; gate then up
            qkv, qkv_bias, gate_up = [attn.qkv_proj], None, [mlp.gate_up_proj]
        else:
            qkv, qkv_bias = [attn.q_proj, attn.k_proj, attn.v_proj], qkv_bias_of(attn)
            gate_up = [mlp.gate_proj, mlp.up_proj]
        return _FusedLayer(
            qkv=make(qkv, qkv_bias), q_heads=q_heads, kv_heads=kv_heads, o=make([attn.o_proj], None),
            gate_up=make(gate_up, None), intermediate=sum(m.weight.shape[0] for m in gate_up) // 2,
            down=make([mlp.down_proj], None),
            scaling=float(attn.scaling), window=layer_window(attn, attn.config),
            **block_fields(layer, True, gemma, rope_by_type),
        )

    @staticmethod
    def _fuse(layer: Any, prepack: bool, native: NativeKernels | None, gemma: bool, rope_by_type: bool
              ) -> _FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        q_heads, kv_heads = head_counts(attn)
        if hasattr(attn, "qkv_proj"):  # Phi-3: already fused by rows, q then k then v; gate then up
            qkv, qkv_bias = _own_rows(attn.qkv_proj), None
            gate_up = _own_rows(mlp.gate_up_proj)
        else:
            qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj]), qkv_bias_of(attn)
            gate_up = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        return _FusedLayer(
            qkv=Matrix(qkv, qkv_bias, prepack, native), q_heads=q_heads, kv_heads=kv_heads,
            o=Matrix(_own_rows(attn.o_proj), None, prepack, native), gate_up=Matrix(gate_up, None, prepack, native),
            intermediate=gate_up.shape[0] // 2, down=Matrix(_own_rows(mlp.down_proj), None, prepack, native),
            scaling=float(attn.scaling), window=layer_window(attn, attn.config),
            **block_fields(layer, False, gemma, rope_by_type),
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                 logit_index: torch.Tensor, plan: DecodeAttentionPlan | None = None,
                 hidden_index: torch.Tensor | None = None) -> torch.Tensor:
        """Forward `[T]` packed tokens at `[T]` positions; return logits `[len(logit_index), vocab]`.

        With `hidden_index`, the final norm's output at those tokens (the LM head's input) is kept in
        `self.last_hidden` (`[len(hidden_index), hidden]`) for the strategies that read hidden states.

        With a `plan` (and native kernels) the step's small ops run natively; the runner makes one for every step
        whose short-query sequences bring at most `runner.NATIVE_MAX_TOKENS` tokens (long chunks in it get SDPA).
        A step the `native_stack` takes (few rows, no long chunk) runs every layer in one native call instead of
        `_native_layer` per layer, with the same result bit for bit.
        """
        hidden = self.embed_tokens(input_ids).to(self.dtype)  # [T, hidden]
        ropes = self._rope_tables(hidden, positions)
        tokens = hidden.shape[0]
        native = self.native
        if native is not None and plan is not None:
            # a step whose products run on the bf16 GEMM takes bf16 inputs (the norms and the gating round them in
            # their own pass) and attends on bf16 dot products (a bf16 pool, AVX512-BF16)
            bf16_step = self.bf16_gemm and tokens >= BF16_GEMM_MIN_ROWS
            stack = self.native_stack
            stacked = None
            if stack is not None and not bf16_step and stack.takes(tokens, plan):
                plan.set_rope(ropes[None][0][:, 0], ropes[None][1][:, 0])  # the plain block has one table
                stacked = stack.run(hidden, cache, plan)
            if stacked is not None:
                hidden = stacked
            else:
                table: str | None = None
                for index, layer in enumerate(self.layers):
                    if index == 0 or layer.rope != table:
                        table = layer.rope
                        plan.set_rope(ropes[table][0][:, 0], ropes[table][1][:, 0])
                    hidden = self._native_layer(native, index, layer, hidden, cache, plan, bf16_step)
            if hidden_index is not None:
                self.last_hidden = native.rms_norm(hidden.index_select(0, hidden_index), self.final_norm,
                                                   self.final_eps)
            hidden = native.rms_norm(hidden.index_select(0, logit_index), self.final_norm, self.final_eps)
            return self._logits(hidden)
        layout = cache.layout
        if self.gpu_ops and layout is not None and layout.token_table is not None and not layout.chunks:
            cos2d, sin2d = ropes[None][0][:, 0], ropes[None][1][:, 0]
            if tokens <= self.gpu_layer_rows:
                token_table = layout.token_table
                # what the kernels specialize on
                variant = (tokens == 1, token_table.single_query, token_table.parts > 1)
                try:
                    for index, layer in enumerate(self.layers):
                        self._gpu_fused_layer(index, layer, hidden, cos2d, sin2d, cache)
                except Exception as exc:
                    if variant in self._gpu_layer_proven:
                        raise
                    # a kernel this GPU or Triton cannot compile must not fail every step: the per-op path from now
                    # on (the products have not finished `hidden`, so the step starts over from the embeddings)
                    log.warning("the five-launch GPU layer failed on first use (%r); running one launch per op", exc)
                    self.gpu_layer_rows = 0
                    hidden = self.embed_tokens(input_ids).to(self.dtype)
                else:
                    self._gpu_layer_proven.add(variant)
                    normed = gpu_ops.rms_norm(hidden, self.final_norm, self.final_eps)
                    if hidden_index is not None:
                        self.last_hidden = normed.index_select(0, hidden_index)
                    return self._logits(normed.index_select(0, logit_index))
            delta: torch.Tensor | None = None  # each layer's last product, added to `hidden` by the next norm
            for index, layer in enumerate(self.layers):
                hidden, delta = self._gpu_layer(index, layer, hidden, delta, cos2d, sin2d, cache, tokens)
            normed = gpu_ops.rms_norm(hidden, self.final_norm, self.final_eps, residual=delta)
            if hidden_index is not None:
                self.last_hidden = normed.index_select(0, hidden_index)
            return self._logits(normed.index_select(0, logit_index))
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, *ropes[layer.rope], cache, tokens)
        if hidden_index is not None:
            self.last_hidden = _rms_norm(hidden.index_select(0, hidden_index), self.final_norm, self.final_eps)
        hidden = _rms_norm(hidden.index_select(0, logit_index), self.final_norm, self.final_eps)
        return self._logits(hidden)

    @property
    def runs_decode(self) -> bool:
        """Whether `decode_run` runs here: a `decode_runner` was built and the native stack is on (a decoder switched
        to the per-layer path runs no runs)."""
        return self.decode_runner is not None and self.native_stack is not None

    def decode_run(self, token: int, position: int, block_table: list[int], cache: PagedKVCache, steps: int,
                   stop_ids: Sequence[int], draws: RunDraws | None = None,
                   interrupt: RunInterrupt | None = None) -> list[int] | None:
        """Up to `steps` greedy tokens of one sequence whose pending `token` sits at `position` (`block_table`
        holding every position the run writes), each the argmax of the logits this decoder's one-row step would
        give, ending after one of `stop_ids`; None (nothing run) where `runs_decode` is False or the cache's pools
        are not ones the kernels read. The keys and values of the pending token and of every new token but the last are
        written, as the step-by-step forwards would have. With `draws`, each token is drawn as they say instead
        (`RunDraws`); a raised `interrupt` ends the run after its current token."""
        run = self.decode_runner
        if run is None or not self.runs_decode:
            return None
        needed = position + steps
        if needed > self._rope_positions:
            self._rope_by_position(self.dtype, needed)
        cos, signed_sin = self._rope_cache[None]
        return run(cache, cos, signed_sin, block_table, token, position, steps, stop_ids, draws, interrupt)

    def native_chunk_keys(self, tokens: int, cache: PagedKVCache) -> int:
        """The most keys (context and chunk) of a sequence whose prefill chunk, in a step of `tokens` tokens, the
        native attention takes instead of SDPA (`DecodeAttentionPlan`'s `chunk_max_keys`; 0: none).

        The native kernel attends query by query, SDPA in blocks of queries: measured on SmolLM2's heads (2-core
        Zen 5, one layer, every prompt a whole chunk), on bf16 dot products (a bf16 step on a bf16 pool, AVX512-BF16)
        the native kernel took 0.5-0.6x SDPA's time up to 480 keys and 0.8x at 960; in float32 0.6-0.85x up to 480,
        the same at 640 and 1.15x at 960. Key-by-key libraries (no tiled attention) leave every chunk to SDPA."""
        native = self.native
        head_dim = cache.key_slots[0].shape[-1] if cache.key_slots else 0
        if native is None or not native.tiled_attention or head_dim % native.attention_tile:
            return 0
        dot = (self.bf16_gemm and tokens >= BF16_GEMM_MIN_ROWS and cache.pool.dtype == torch.bfloat16
               and head_dim % 32 == 0 and head_dim <= native.dot_attention_max_dim)
        return NATIVE_CHUNK_MAX_KEYS_DOT if dot else NATIVE_CHUNK_MAX_KEYS

    def _rope_tables(self, hidden: torch.Tensor, positions: torch.Tensor
                     ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """This step's RoPE tables `(cos, signed_sin)`, `[T, 1, head_dim]` each (broadcast over heads; `signed_sin`
        as `_rotate` takes it), by layer type for Gemma 3, under None for the Llama block's single table.

        On a CPU, for a RoPE whose tables depend on the position alone (not the dynamic and long-context types, which
        rescale with the longest sequence), they are rows of tables computed once (`_rope_by_position`): the
        rotary module's own elementwise math, so the same values, for ~0.1 ms less a token than calling it."""
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        keys: list[str | None] = list(self.rope_types) if self.rope_types else [None]
        if self._device_rope is not None and hidden.device == self._device_rope.device:
            rows = self._device_rope.index_select(0, positions)[:, None]
            half = rows.shape[-1] // 2
            return {None: (rows[..., :half], rows[..., half:])}
        if self._rope_static and hidden.device.type == "cpu":
            needed = int(positions.max()) + 1 if positions.numel() else 0
            if needed > self._rope_positions:
                self._rope_by_position(hidden.dtype, needed)
            for key in keys:
                cos, signed_sin = self._rope_cache[key]
                tables[key] = cos.index_select(0, positions)[:, None], signed_sin.index_select(0, positions)[:, None]
            return tables
        for key in keys:
            tables[key] = self._rope_rows(hidden, positions, key)
        return tables

    def prepare_device_rope(self, positions: int) -> None:
        """On the model's device (a GPU; the CPU in tests), compute the RoPE rows of positions `0..positions-1` once,
        which every later step then looks up (the caller promises no step goes past them: the CUDA graphs size them
        by the engine's longest context).
        Only for one static table (not Gemma 3's per-layer-type tables nor a dynamic RoPE); the rows come from the
        rotary module itself, so they are the values its per-step calls give."""
        weight = self.final_norm
        if not self._rope_static or self.rope_types is not None:
            return
        if self._device_rope is not None and self._device_rope.shape[0] >= positions:
            return
        probe = torch.empty(positions, 1, dtype=self.dtype, device=weight.device)
        cos, signed_sin = self._rope_rows(probe, torch.arange(positions, device=weight.device), None)
        self._device_rope = torch.cat([cos[:, 0], signed_sin[:, 0]], dim=-1).contiguous()

    def _rope_rows(self, hidden: torch.Tensor, positions: torch.Tensor, key: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, signed_sin)` `[T, 1, head_dim]` at `positions` from the rotary module (table `key`)."""
        extra = () if key is None else (key,)
        cos, sin = self.rotary_emb(hidden[None], positions[None], *extra)
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _rope_by_position(self, dtype: torch.dtype, needed: int) -> None:
        """(Re)compute the cached tables `[positions, head_dim]` for at least `needed` positions (doubling, so a
        growing context recomputes them a logarithmic number of times)."""
        count = max(1024, 1 << (needed - 1).bit_length())
        positions = torch.arange(count)
        probe = torch.empty(count, 1, dtype=dtype)
        keys: list[str | None] = list(self.rope_types) if self.rope_types else [None]
        self._rope_cache = {}
        for key in keys:
            cos, signed_sin = self._rope_rows(probe, positions, key)
            self._rope_cache[key] = cos[:, 0].contiguous(), signed_sin[:, 0].contiguous()
        self._rope_positions = count

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on final-norm outputs, soft-capped as the model caps its logits (`final_logit_softcapping`)."""
        logits = self.lm_head(normed)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @staticmethod
    def _native_layer(native: NativeKernels, index: int, layer: _FusedLayer, hidden: torch.Tensor,
                      cache: PagedKVCache, plan: DecodeAttentionPlan, bf16_step: bool = False) -> torch.Tensor:
        """`_layer` with its small ops as native kernels: RMSNorm, RoPE + KV write + attention, SiLU-gating.

        With `bf16_step` (the step's products run on the bf16 GEMM: `Bf16Matrix.takes_bf16`), the norms round their
        output to bf16 and the SiLU-gating goes bf16 to bf16, in their own passes, instead of a conversion before
        and after each product (the same values), and attention runs on the CPU's bf16 dot products where the pool
        is bf16 (`rope_cache_attend`).

        Prefill chunks of sequences longer than the plan takes (`native_chunk_keys`; `plan.chunks_left`) are attended
        by SDPA from the rotated `qkv`, and SiLU-gating of many rows stays with torch's vectorized `exp`.
        """
        tokens = hidden.shape[0]
        qkv = layer.qkv(native.rms_norm(hidden, layer.input_norm, layer.input_eps, bf16_out=bf16_step))
        _norm_queries_and_keys(layer, qkv, tokens)
        attended = native.rope_cache_attend(qkv, layer.q_heads, layer.kv_heads, cache.key_slots[index],
                                            cache.value_slots[index], plan, layer.scaling, layer.window, layer.softcap,
                                            bf16_dot=bf16_step)
        if plan.has_chunks:
            assert cache.layout is not None
            heads = qkv.view(tokens, -1, cache.key_slots[index].shape[-1])
            query, key, value = heads.split([layer.q_heads, layer.kv_heads, layer.kv_heads], dim=1)
            attend_chunks(cache.layout, query, key, value, cache.key_rows[index], cache.value_rows[index],
                          layer.scaling, attended.view(tokens, layer.q_heads, -1), layer.window, layer.softcap,
                          only=plan.chunks_left)
        if layer.attn_out_norm is None:
            hidden = layer.o(attended, residual=hidden)
        else:  # Gemma 2 and 3: the attention's output is normed before the residual add
            hidden = hidden + native.rms_norm(layer.o(attended), layer.attn_out_norm, layer.out_eps)
        normed = native.rms_norm(hidden, layer.post_norm, layer.post_eps, bf16_out=bf16_step)
        gate_up_matrix = layer.gate_up
        if (bf16_step and not layer.gelu and tokens <= NATIVE_GATING_MAX_ROWS and isinstance(gate_up_matrix, Bf16Matrix)
                and gate_up_matrix.takes_bf16(tokens)):
            gated = native.silu_mul(gate_up_matrix.bf16_product(normed))  # bf16 to bf16: the down product's input
        else:
            gate_up = gate_up_matrix(normed)
            if layer.gelu:
                gated = _gelu_gate(gate_up, layer.intermediate)
            elif tokens > NATIVE_GATING_MAX_ROWS:
                gated = _silu_gate(gate_up, layer.intermediate)
            else:
                gated = native.silu_mul(gate_up)
        if layer.mlp_out_norm is None:
            return layer.down(gated, residual=hidden)
        return hidden + native.rms_norm(layer.down(gated), layer.mlp_out_norm, layer.out_eps)

    @staticmethod
    def _gpu_layer(index: int, layer: _FusedLayer, hidden: torch.Tensor, delta: torch.Tensor | None,
                   cos: torch.Tensor, signed_sin: torch.Tensor, cache: PagedKVCache, tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_layer` on the GPU path (a step attended by token table, no long chunk): RMSNorm (with the residual add
        of the product before it), RoPE + KV write and SiLU-gating as one Triton kernel each, attention by the
        paged kernel; `cos`/`signed_sin` are `[T, D]`. Returns `hidden` and the MLP's output, which the next norm
        adds to it."""
        layout = cache.layout
        assert layout is not None and layout.token_table is not None
        keys, values = cache.key_slots[index], cache.value_slots[index]
        qkv = layer.qkv(gpu_ops.rms_norm(hidden, layer.input_norm, layer.input_eps, residual=delta))
        _norm_queries_and_keys(layer, qkv, tokens)
        query = gpu_ops.rope_write(qkv, cos, signed_sin, layer.q_heads, layer.kv_heads, keys, values,
                                   layout.slot_mapping)
        attended = torch.empty_like(query)
        attend_tokens(layout.token_table, query, keys, values, cache.block_size, layer.scaling, attended)
        normed = gpu_ops.rms_norm(hidden, layer.post_norm, layer.post_eps, residual=layer.o(attended.view(tokens, -1)))
        return hidden, layer.down(gpu_ops.silu_mul(layer.gate_up(normed), layer.intermediate))

    @staticmethod
    def _gpu_fused_layer(index: int, layer: _FusedLayer, hidden: torch.Tensor, cos: torch.Tensor,
                         signed_sin: torch.Tensor, cache: PagedKVCache) -> None:
        """`_gpu_layer` for a step of at most `gpu_layer_rows` rows, in five launches (`gpu_layer`): the input norm
        inside the q/k/v product; RoPE, KV write and attention in one (a decode step; else `rope_write` and the
        paged kernel); the output product adding into `hidden`; the post norm and SiLU-gating inside the gate/up
        product; the down product adding into `hidden`. Updates `hidden` in place."""
        layout = cache.layout
        assert layout is not None and layout.token_table is not None
        assert isinstance(layer.qkv, Matrix) and isinstance(layer.o, Matrix)
        assert isinstance(layer.gate_up, Matrix) and isinstance(layer.down, Matrix)
        keys, values = cache.key_slots[index], cache.value_slots[index]
        table = layout.token_table
        tokens = hidden.shape[0]
        qkv = gpu_layer.linear(hidden, layer.qkv.weight, layer.qkv.bias, norm_weight=layer.input_norm,
                               eps=layer.input_eps)
        _norm_queries_and_keys(layer, qkv, tokens)
        if table.single_query:
            attended = gpu_layer.rope_attend(qkv, cos, signed_sin, layer.q_heads, layer.kv_heads, keys, values,
                                             layout.slot_mapping, table, cache.block_size, layer.scaling)
        else:  # several tokens of a sequence attend to each other's keys: written by one launch, read by the next
            query = gpu_ops.rope_write(qkv, cos, signed_sin, layer.q_heads, layer.kv_heads, keys, values,
                                       layout.slot_mapping)
            attended = torch.empty_like(query)
            attend_tokens(table, query, keys, values, cache.block_size, layer.scaling, attended)
            attended = attended.view(tokens, -1)
        gpu_layer.linear(attended, layer.o.weight, residual=hidden)
        gated = gpu_layer.linear(hidden, layer.gate_up.weight, norm_weight=layer.post_norm, eps=layer.post_eps,
                                 gated=True)
        gpu_layer.linear(gated, layer.down.weight, residual=hidden)

    @staticmethod
    def _layer(index: int, layer: _FusedLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: PagedKVCache, tokens: int) -> torch.Tensor:
        qkv = layer.qkv(_rms_norm(hidden, layer.input_norm, layer.input_eps))
        _norm_queries_and_keys(layer, qkv, tokens)
        head_dim = cos.shape[-1]
        # RoPE on queries and keys together (the first q + kv heads of the fused product): one set of
        # elementwise ops for all their heads.
        qk, value = qkv.view(tokens, -1, head_dim).split([layer.q_heads + layer.kv_heads, layer.kv_heads], dim=1)
        query, key = _rotate(qk, cos, sin).split([layer.q_heads, layer.kv_heads], dim=1)
        cache.write(index, key, value)
        attended = paged_attention(cache, index, query, key, value, layer.scaling, layer.window, layer.softcap)
        if layer.attn_out_norm is None:
            hidden = layer.o(attended.reshape(tokens, -1), residual=hidden)
        else:  # Gemma 2 and 3: the attention's output is normed before the residual add
            hidden = hidden + _rms_norm(layer.o(attended.reshape(tokens, -1)), layer.attn_out_norm, layer.out_eps)
        gate_up = layer.gate_up(_rms_norm(hidden, layer.post_norm, layer.post_eps))
        gated = (_gelu_gate if layer.gelu else _silu_gate)(gate_up, layer.intermediate)
        if layer.mlp_out_norm is None:
            return layer.down(gated, residual=hidden)
        return hidden + _rms_norm(layer.down(gated), layer.mlp_out_norm, layer.out_eps)


def _static_rope(rotary: Any) -> bool:
    """Whether `rotary`'s tables depend on the position alone, so rows computed once serve every step: its RoPE types
    (one, or one per layer type) are neither dynamic nor long-context, whose transformers forward rescales the
    frequencies with the longest position seen (`dynamic_rope_update`)."""
    kinds = getattr(rotary, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    return all(isinstance(kind, str) and "dynamic" not in kind and kind != "longrope" for kind in kinds)


def _silu_gate(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`silu(gate) * up` from the fused gate/up product's two halves."""
    return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]


def _gelu_gate(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (Gemma's `gelu_pytorch_tanh`) from the fused gate/up product's two halves."""
    return F.gelu(gate_up[:, :intermediate], approximate="tanh") * gate_up[:, intermediate:]


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (float32 statistics), rounding the same way: LlamaRMSNorm where `weight` has the
    activations' dtype, Gemma's where it is float32 under narrower activations.

    In float32 the fused `F.rms_norm` kernel gives bit-identical results in one op instead of six (a test holds
    it to that). Llama rounds to the model dtype before the weight multiply, followed op for op here; Gemma
    multiplies by its float32 (1 + w) first and rounds after, which is `F.rms_norm` in float32, then rounded.
    """
    dtype = hidden.dtype
    if dtype == torch.float32:
        return F.rms_norm(hidden, weight.shape, weight, eps)
    if weight.dtype == torch.float32:
        return F.rms_norm(hidden.to(torch.float32), weight.shape, weight, eps).to(dtype)
    as_float = hidden.to(torch.float32)
    variance = as_float.pow(2).mean(-1, keepdim=True)
    return weight * (as_float * torch.rsqrt(variance + eps)).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on `[T, heads, head_dim]`, bit for bit as transformers computes it.

    transformers does `x * cos + cat(-x2, x1) * sin`; with `signed_sin = cat(-sin1, sin2)` that is
    `x * cos + roll(x, half) * signed_sin` (negating either factor is exact), one roll instead of two slices, a
    negation and a cat.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
