"""The fused decoder's stack of Llama-block layers in one native call per step (`dk_layer_stack`, `native/layers.c`).

At batch 1 the per-layer native path (`FusedDecoder._native_layer`) makes ~8 calls into the kernels' library per
layer, each with its Python glue (output allocation, `contiguous()`, `data_ptr()`, checks): ~240 a SmolLM2 token,
~1-1.5 ms of an 8-10 ms bf16 or int8 token. `NativeLayerStack` describes every layer once, when the decoder is built
(ctypes Structures mirroring `layers.c`: weight pointers and kinds, norms and epsilons, heads, scaling, window;
stacked GGUF parts with their output offsets), allocates its scratch rows once, and runs a step's whole stack in one
call: the same kernels, in the same order, on the same operands and threads, so the hidden states, the KV written and
the logits are bit for bit the per-layer path's (a test holds it to that).

It takes the plain Llama block as the native path runs it (Llama, Mistral, Qwen2 with its q/k/v bias, Phi-3) with any
of the fused decoder's weight kinds (`Matrix` on `dk_gemv`, `Bf16Matrix` and `Int8Matrix` panels, `GgufMatrix`), for
steps of at most `max_rows` rows (each product's native row limit, and the native SiLU-gating's) with no long prefill
chunk. Everything else keeps the per-layer loop: Gemma's norms and GELU, Qwen3's query/key norms (torch's RMSNorm),
steps on the bf16 GEMM, more rows. `DECODEKIT_NATIVE_STACK=0` turns it off (`execution.plan`), and setting
`FusedDecoder.native_stack` to None switches a built decoder back to the per-layer path (tests, benchmarks).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decodekit.api.sampling import DrawRule
from decodekit.execution.attention.kv_cache import PagedKVCache
from decodekit.execution.fused.blocks import GEMMA_ARCHITECTURES
from decodekit.execution.fused.stored_matrices import (
    BLOCK_FORMATS,
    GGUF_NATIVE_MAX_ROWS,
    STORED_QUANTIZATION,
    GgufMatrix,
)
from decodekit.execution.fused.weight_matrices import (
    BF16_GEMM_MIN_ROWS,
    BF16_NATIVE_MAX_ROWS,
    INT8_NATIVE_MAX_ROWS,
    Bf16Matrix,
    Int8Matrix,
    Matrix,
)
from decodekit.execution.kernels.native import (
    KV_DTYPES,
    NATIVE_GATING_MAX_ROWS,
    PARALLEL_MIN_KEYS,
    DecodeAttentionPlan,
    DrawRuleFields,
    NativeKernels,
)
from decodekit.execution.kernels.quant import GGUF_FORMATS, path_code

STACK_VARIABLE = "DECODEKIT_NATIVE_STACK"
"""Set to 0 (false, no, off) to run every step's layers one native call at a time."""

# `dk_stack_matrix.kind` (the enum in layers.c)
_GEMV, _BF16, _I8, _QUANT = 0, 1, 2, 3
_PARTS = 4  # DK_STACK_PARTS: parts of a stacked GGUF matrix at most

_i = ctypes.c_int64
_p = ctypes.c_void_p
_f = ctypes.c_float


class StackMatrix(ctypes.Structure):
    """`dk_stack_matrix`: one weight product of a layer."""

    _fields_ = [("kind", _i), ("in_dim", _i), ("out_dim", _i), ("weight", _p), ("scale", _p),
                ("bias", _p), ("isa", _i), ("parts", _i), ("part_kind", _i * _PARTS), ("part_blocks", _p * _PARTS),
                ("part_start", _i * _PARTS), ("part_rows", _i * _PARTS)]


class StackLayer(ctypes.Structure):
    """`dk_stack_layer`: one Llama-block layer."""

    _fields_ = [("input_norm", _p), ("post_norm", _p), ("input_eps", _f), ("post_eps", _f), ("scaling", _f),
                ("softcap", _f), ("q_heads", _i), ("kv_heads", _i), ("head_dim", _i), ("intermediate", _i),
                ("window", _i), ("qkv", StackMatrix), ("o", StackMatrix), ("gate_up", StackMatrix),
                ("down", StackMatrix)]


class StackAttention(ctypes.Structure):
    """`dk_stack_attention`: what one step's attention reads."""

    _fields_ = [("cos", _p), ("signed_sin", _p), ("slots", _p), ("tables", _p), ("table_start", _p),
                ("key_len", _p), ("block_size", _i), ("parallel_min_keys", _i), ("kv_mode", _i), ("tiled", _i)]


class StackScratch(ctypes.Structure):
    """`dk_stack_scratch`: a step's scratch rows."""

    _fields_ = [("normed", _p), ("qkv", _p), ("attended", _p), ("gate_up", _p), ("gated", _p), ("mid", _p)]


class RunModel(ctypes.Structure):
    """`dk_run_model`: what a decode run reads beyond the layers."""

    _fields_ = [("embed", _p), ("embed_bf16", _i), ("vocab", _i), ("final_norm", _p), ("final_eps", _f),
                ("head", StackMatrix), ("cos", _p), ("signed_sin", _p), ("rope_positions", _i), ("head_dim", _i),
                ("block_table", _p), ("blocks", _i), ("stop_ids", _p), ("stop_count", _i),
                ("draw", DrawRuleFields), ("uniforms", _p), ("probs", _p), ("interrupt", _p)]


class RunInterrupt:
    """A flag another thread raises to end the decode run in progress after the token it is making (`dk_decode_run`
    reads it after each token): a front-end that hands the engine a new request or an abort raises it, so that a
    long run does not delay them, and lowers it when the engine has taken them (`AsyncLLM`). Raising it while no
    run is in progress ends the next run after its first token; a run always makes at least one."""

    def __init__(self) -> None:
        """A lowered flag."""
        self._flag = ctypes.c_int32(0)

    def raise_(self) -> None:
        """End the run in progress (or the next) after its current token; safe from any thread."""
        self._flag.value = 1

    def lower(self) -> None:
        """Let runs go their whole length again."""
        self._flag.value = 0

    @property
    def raised(self) -> bool:
        """Whether the flag is up."""
        return bool(self._flag.value)

    @property
    def address(self) -> int:
        """Where the native run reads the flag."""
        return ctypes.addressof(self._flag)


@dataclass
class RunDraws:
    """A sampled decode run's draws: each token drawn from the distribution `rule` describes (`DrawRule`: the
    softmax at its temperature, truncated by its top_k, top_p, min_p) by the inverse of its distribution function
    at `uniforms[i]` (float64 in [0, 1), one a step); the run sets `probs` to those distributions (float32
    `[tokens, vocab]`, a row per token it drew). What a sampled draft needs from its model: the tokens and the
    distributions they came from (speculative sampling's q), without a step's Python a token."""

    rule: DrawRule
    uniforms: torch.Tensor
    probs: torch.Tensor | None = None

    def check(self, steps: int) -> None:
        """Raises ValueError where the uniforms are not `steps` contiguous float64 values."""
        if self.uniforms.dtype != torch.float64 or self.uniforms.numel() < steps or not self.uniforms.is_contiguous():
            raise ValueError(f"a sampled run of {steps} steps needs {steps} contiguous float64 uniforms")


class RunScratch(ctypes.Structure):
    """`dk_run_scratch`: a decode run's hidden rows and logits."""

    _fields_ = [("input", _p), ("output", _p), ("normed", _p), ("logits", _p)]


def stack_enabled() -> bool:
    """Whether `DECODEKIT_NATIVE_STACK` leaves the native stack on (the default)."""
    return os.environ.get(STACK_VARIABLE, "1").lower() not in ("0", "false", "no", "off")


def stack_refusal(model: Any) -> str | None:
    """Why the layers of `model` (which the fused decoder takes) keep the per-layer loop, or None when the native
    stack can run them."""
    if not stack_enabled():
        return f"{STACK_VARIABLE}={os.environ[STACK_VARIABLE]}"
    arch = type(model).__name__
    if arch in GEMMA_ARCHITECTURES:
        return f"{arch}'s block (its norms and GELU gating) runs layer by layer"
    if any(getattr(layer.self_attn, "q_norm", None) is not None for layer in model.model.layers):
        return "query/key norms (torch's RMSNorm) run layer by layer"
    return None


def stack_max_rows(quantization: str | None, bf16_gemm: bool, gemv_max_rows: int) -> int:
    """The most rows a step of the native stack takes with the weights of `quantization` (float32 for None; a float32
    fallback matrix in a GGUF model can lower it to `gemv_max_rows`, the kernels' `dk_gemv` limit): the limits
    `_describe_matrix` reads."""
    limits: dict[str | None, int] = {
        None: gemv_max_rows,  # every float32 weight on `dk_gemv`
        "bf16": BF16_GEMM_MIN_ROWS - 1 if bf16_gemm else BF16_NATIVE_MAX_ROWS,
        "int8": INT8_NATIVE_MAX_ROWS, STORED_QUANTIZATION: GGUF_NATIVE_MAX_ROWS,
        **dict.fromkeys(BLOCK_FORMATS, GGUF_NATIVE_MAX_ROWS)}
    product = limits[quantization]
    return min(product, NATIVE_GATING_MAX_ROWS)


def _floats(tensor: torch.Tensor | None) -> int | None:
    """The address of a contiguous float32 CPU tensor (None for None).

    Raises:
        ValueError: it is not one (the kernels read raw float32).
    """
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"a {tensor.dtype} tensor on {tensor.device} (contiguous: {tensor.is_contiguous()}) is not "
                         "the contiguous float32 the native stack reads")
    return tensor.data_ptr()


def _describe_matrix(matrix: Any) -> tuple[StackMatrix, int]:
    """The descriptor of one of the fused decoder's products, and the most rows it multiplies natively.

    Raises:
        ValueError: the product has no native path the stack can call (its Python object runs it).
    """
    desc = StackMatrix()
    if isinstance(matrix, Matrix):
        if matrix.native is None:
            raise ValueError("a float32 weight dk_gemv cannot read (strided)")
        weight = matrix.weight
        desc.kind, (desc.out_dim, desc.in_dim) = _GEMV, weight.shape
        desc.weight = weight.data_ptr()
        if weight.dtype != torch.float32:
            raise ValueError(f"a {weight.dtype} weight for dk_gemv")
        desc.bias = _floats(matrix.bias)
        return desc, matrix.native.gemv_max_rows
    if isinstance(matrix, Bf16Matrix):
        desc.kind, desc.in_dim, desc.out_dim = _BF16, matrix.in_dim, matrix.out_dim
        desc.weight, desc.bias = matrix.panels.data_ptr(), _floats(matrix.bias)
        # with a oneDNN copy, BF16_GEMM_MIN_ROWS rows and more take the bf16 GEMM
        return desc, BF16_GEMM_MIN_ROWS - 1 if matrix.packed is not None else BF16_NATIVE_MAX_ROWS
    if isinstance(matrix, Int8Matrix):
        desc.kind, desc.in_dim, desc.out_dim = _I8, matrix.in_dim, matrix.out_dim
        desc.weight, desc.scale, desc.bias = matrix.panels.data_ptr(), _floats(matrix.scale), _floats(matrix.bias)
        return desc, INT8_NATIVE_MAX_ROWS
    if isinstance(matrix, GgufMatrix):
        if len(matrix.parts) > _PARTS:
            raise ValueError(f"a GGUF stack of {len(matrix.parts)} parts (the native stack takes {_PARTS})")
        desc.kind, desc.in_dim, desc.out_dim = _QUANT, matrix.in_dim, matrix.out_dim
        desc.bias, desc.parts = _floats(matrix.bias), len(matrix.parts)
        desc.isa = path_code(matrix.isa, matrix.float_activations)
        for index, (start, fmt, blocks) in enumerate(matrix.parts):
            desc.part_kind[index], desc.part_blocks[index] = GGUF_FORMATS[fmt][0], blocks.data_ptr()
            desc.part_start[index], desc.part_rows[index] = start, blocks.shape[0]
        return desc, GGUF_NATIVE_MAX_ROWS
    raise ValueError(f"a {type(matrix).__name__} product")


def _describe_layer(layer: Any) -> tuple[StackLayer, int]:
    """The descriptor of one of the fused decoder's layers (its `_FusedLayer`, which imports this module, hence
    `Any`) and the most rows its products take natively.

    Raises:
        ValueError: the layer is not the plain Llama block, or a product or norm is not what the kernels read.
    """
    if (layer.gelu or layer.attn_out_norm is not None or layer.mlp_out_norm is not None or layer.q_norm is not None
            or layer.rope is not None):
        raise ValueError("not the plain Llama block")
    desc = StackLayer(input_norm=_floats(layer.input_norm), post_norm=_floats(layer.post_norm),
                      input_eps=layer.input_eps, post_eps=layer.post_eps, scaling=layer.scaling,
                      softcap=layer.softcap or 0.0, q_heads=layer.q_heads, kv_heads=layer.kv_heads,
                      intermediate=layer.intermediate, window=layer.window or 0)
    rows = NATIVE_GATING_MAX_ROWS
    for name in ("qkv", "o", "gate_up", "down"):
        matrix, limit = _describe_matrix(getattr(layer, name))
        setattr(desc, name, matrix)
        rows = min(rows, limit)
    # the kernel trusts these widths: a layer whose products disagree with its norms and heads is refused here
    heads = layer.q_heads + 2 * layer.kv_heads
    desc.head_dim = desc.qkv.out_dim // heads
    hidden = layer.input_norm.numel()
    widths = (desc.qkv.in_dim, desc.o.out_dim, desc.gate_up.in_dim, desc.down.out_dim, layer.post_norm.numel())
    if (desc.qkv.out_dim != heads * desc.head_dim or desc.o.in_dim != layer.q_heads * desc.head_dim
            or desc.gate_up.out_dim != 2 * layer.intermediate or desc.down.in_dim != layer.intermediate
            or any(width != hidden for width in widths)):
        raise ValueError("the layer's products do not match its norms, heads and intermediate size")
    return desc, rows


class NativeLayerStack:
    """Every layer of a fused decoder described for `dk_layer_stack`, with the scratch rows of its steps.

    Build it with `build` (None where a layer is not one it takes); `run` a step of at most `max_rows` rows whose
    attention plan has no long chunk.
    """

    def __init__(self, layers: Sequence[Any], native: NativeKernels) -> None:
        """Describe `layers` (kept alive by the decoder, which owns them).

        Raises:
            ValueError: a layer is not one the native stack takes (the message says why).
        """
        described = [_describe_layer(layer) for layer in layers]
        self.layers = (StackLayer * len(described))(*(desc for desc, _ in described))
        self.max_rows = min(rows for _, rows in described)
        self.hidden_dim = described[0][0].qkv.in_dim
        self._native = native
        self._widths = {"normed": self.hidden_dim, "mid": self.hidden_dim,
                        "qkv": max(desc.qkv.out_dim for desc, _ in described),
                        "attended": max(desc.o.in_dim for desc, _ in described),
                        "gate_up": max(desc.gate_up.out_dim for desc, _ in described),
                        "gated": max(desc.down.in_dim for desc, _ in described)}
        self._scratch_rows: dict[str, torch.Tensor] = {}
        self._scratch = StackScratch()
        self._attention = StackAttention(parallel_min_keys=PARALLEL_MIN_KEYS, tiled=1)
        self._cache: PagedKVCache | None = None  # whose pools `_key_pools`/`_value_pools` point at
        self._pool_address = 0
        self._key_pools = (_p * len(described))()
        self._value_pools = (_p * len(described))()

    @classmethod
    def build(cls, layers: Sequence[Any], native: NativeKernels) -> NativeLayerStack | None:
        """The stack of `layers`, or None where one is not the plain Llama block on native products."""
        try:
            return cls(layers, native)
        except ValueError:
            return None

    def takes(self, tokens: int, plan: DecodeAttentionPlan) -> bool:
        """Whether a step of `tokens` rows under `plan` runs here (few rows, no chunk attended by the caller)."""
        return tokens <= self.max_rows and not plan.has_chunks

    def _bind(self, cache: PagedKVCache, tokens: int) -> bool:
        """Pools bound to `cache` and scratch rows for `tokens` rows; False where the kernels cannot read the pools."""
        if (cache is not self._cache or cache.pool.data_ptr() != self._pool_address) and not self._bind_pools(cache):
            return False
        self._scratch_for(tokens)
        return True

    def _bind_pools(self, cache: PagedKVCache) -> bool:
        """Point the layers at `cache`'s pools (once per cache); False where the kernels cannot read them."""
        keys = cache.key_slots
        if (len(keys) != len(self.layers) or cache.pool.dtype not in KV_DTYPES or cache.pool.device.type != "cpu"
                or any(keys[i].shape[-2:] != (layer.kv_heads, layer.head_dim) for i, layer in enumerate(self.layers))):
            return False
        for index in range(len(self.layers)):
            self._key_pools[index] = keys[index].data_ptr()
            self._value_pools[index] = cache.value_slots[index].data_ptr()
        self._attention.kv_mode = int(cache.pool.dtype == torch.bfloat16)  # widened to float32 as they are read
        self._cache, self._pool_address = cache, cache.pool.data_ptr()
        return True

    def _scratch_for(self, tokens: int) -> None:
        """Scratch rows for `tokens` rows (allocated once, for `max_rows`)."""
        if self._scratch_rows:
            return
        rows = max(tokens, self.max_rows)
        self._scratch_rows = {name: torch.empty(rows, width) for name, width in self._widths.items()}
        for name, tensor in self._scratch_rows.items():
            setattr(self._scratch, name, tensor.data_ptr())

    def run(self, hidden: torch.Tensor, cache: PagedKVCache, plan: DecodeAttentionPlan) -> torch.Tensor | None:
        """The last layer's output `[T, hidden]` for the float32 step input `hidden` (the embeddings), writing every
        layer's keys and values to `cache`; `plan` has its RoPE tables set. None (nothing run) where the cache's pools
        are not ones the kernels read: the per-layer path then runs the step (and says why).

        Raises:
            MemoryError: the attention could not allocate its scratch memory.
        """
        hidden = hidden.contiguous()
        tokens = hidden.shape[0]
        if not self._bind(cache, tokens):
            return None
        attention = self._attention
        (attention.cos, attention.signed_sin, attention.slots, attention.tables, attention.table_start,
         attention.key_len) = plan.pointers
        attention.block_size = plan.block_size
        out = torch.empty_like(hidden)
        status = self._native.layer_stack(ctypes.addressof(self.layers), len(self.layers), tokens, self.hidden_dim,
                                          hidden.data_ptr(), out.data_ptr(), ctypes.addressof(self._key_pools),
                                          ctypes.addressof(self._value_pools), ctypes.addressof(attention),
                                          ctypes.addressof(self._scratch))
        if status == -2:
            raise MemoryError("native attention could not allocate its scratch memory")
        assert status == 0, "dk_layer_stack refused products it was built with"
        return out


class DecodeRun:
    """Greedy decode runs of one sequence on a `NativeLayerStack` (`dk_decode_run`): several one-row steps, each
    token's embedding, layers, final norm, LM head and argmax in one native call, so the engine's per-step Python
    (scheduling, the forward's glue, processing, selection, stopping: ~0.4 ms a token) is paid once per run.

    Each step makes the calls the fused decoder makes for a one-row step with the same operands, so the tokens are
    the ones the engine would choose step by step (a test holds them equal). Build it with `build` (None where the
    embeddings or the LM head are not ones it reads).
    """

    def __init__(self, stack: NativeLayerStack, embed: torch.Tensor, final_norm: torch.Tensor, final_eps: float,
                 head: Any, native: NativeKernels) -> None:
        """Describe the embeddings (float32 or bf16 rows), the final norm and the LM head (kept alive by the decoder).

        Raises:
            ValueError: one of them is not what the native run reads.
        """
        if embed.dtype not in (torch.float32, torch.bfloat16) or embed.dim() != 2 or not embed.is_contiguous():
            raise ValueError(f"embeddings {embed.dtype} {tuple(embed.shape)} are not contiguous float32/bf16 rows")
        if embed.shape[1] != stack.hidden_dim or final_norm.shape != (stack.hidden_dim,):
            raise ValueError("the embeddings or the final norm do not match the layers' width")
        head_desc, _ = _describe_matrix(head)
        if head_desc.in_dim != stack.hidden_dim or head_desc.out_dim != embed.shape[0]:
            raise ValueError("the LM head does not map the layers' width to the embeddings' vocabulary")
        self.stack = stack
        self.vocab = head_desc.out_dim
        self._native = native
        self._model = RunModel(embed=embed.data_ptr(), embed_bf16=int(embed.dtype == torch.bfloat16),
                               vocab=self.vocab, final_norm=_floats(final_norm),
                               final_eps=final_eps, head=head_desc)
        self._rows = {name: torch.empty(width) for name, width in
                      (("input", stack.hidden_dim), ("output", stack.hidden_dim), ("normed", stack.hidden_dim),
                       ("logits", self.vocab))}
        self._scratch = RunScratch(**{name: row.data_ptr() for name, row in self._rows.items()})

    @classmethod
    def build(cls, stack: NativeLayerStack, embed: torch.Tensor, final_norm: torch.Tensor, final_eps: float,
              head: Any, native: NativeKernels) -> DecodeRun | None:
        """The run over `stack`, or None where the embeddings or the head are not ones it reads."""
        try:
            return cls(stack, embed, final_norm, final_eps, head, native)
        except ValueError:
            return None

    def __call__(self, cache: PagedKVCache, cos: torch.Tensor, signed_sin: torch.Tensor, block_table: list[int],
                 token: int, position: int, steps: int, stop_ids: Sequence[int],
                 draws: RunDraws | None = None, interrupt: RunInterrupt | None = None) -> list[int] | None:
        """Up to `steps` greedy tokens after the pending `token` at `position` (its keys and values, and each new
        token's but the last, written to `cache` at `block_table`'s slots), ending early after one of `stop_ids`
        or once `interrupt` is raised; with `draws`, each token drawn as they say instead of the argmax.
        `cos`/`signed_sin` are the RoPE tables by
        position (`[positions, head_dim]`, float32). None (nothing run) where the cache's pools are not ones the
        kernels read.

        Raises:
            ValueError: the block table or the RoPE tables do not reach `position + steps - 1`, or `draws` does
                not hold `steps` uniforms (`RunDraws.check`).
            MemoryError: the attention could not allocate its scratch memory.
        """
        probs = None
        if draws is not None:
            draws.check(steps)
            probs = torch.empty(max(steps, 1), self.vocab)
        if not self.stack._bind(cache, 1):
            return None
        self.stack._attention.block_size = cache.block_size  # (a step's plan sets it; a run may come first)
        model = self._model
        tables = torch.tensor(block_table, dtype=torch.long)
        stops = torch.tensor(list(stop_ids) or [-1], dtype=torch.long)
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        model.cos, model.signed_sin = _floats(cos), _floats(signed_sin)
        model.rope_positions, model.head_dim = cos.shape[0], cos.shape[1]
        model.block_table, model.blocks = tables.data_ptr(), len(block_table)
        model.stop_ids, model.stop_count = stops.data_ptr(), len(stop_ids)
        model.draw.set(None if draws is None else draws.rule)
        model.uniforms = None if draws is None else draws.uniforms.data_ptr()
        model.probs = None if probs is None else probs.data_ptr()
        model.interrupt = None if interrupt is None else interrupt.address
        out = torch.empty(max(steps, 1), dtype=torch.long)
        stack = self.stack
        done = self._native.decode_run(ctypes.addressof(stack.layers), len(stack.layers), stack.hidden_dim,
                                       ctypes.addressof(stack._key_pools), ctypes.addressof(stack._value_pools),
                                       ctypes.addressof(stack._attention), ctypes.addressof(stack._scratch),
                                       ctypes.addressof(model), ctypes.addressof(self._scratch), token, position,
                                       steps, out.data_ptr())
        if done == -2:
            raise MemoryError("a native run could not allocate its scratch memory (attention or draws)")
        if done == -3:
            raise ValueError(f"a decode run of {steps} steps from position {position} passes its block table "
                             f"({len(block_table)} blocks) or the RoPE tables ({cos.shape[0]} positions)")
        assert done >= 0, "dk_decode_run refused products it was built with"
        if draws is not None and probs is not None:
            draws.probs = probs[:done]
        return out[:done].tolist()
