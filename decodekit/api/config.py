"""`EngineConfig`: the engine's limits and memory, validated with pydantic (recipes embed it as `engine:`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TARGET_DRAFT = "target"
"""The draft spec (`LLM(draft=...)`, recipe `draft.model`) meaning the target model itself, run as a quantized copy
(`draft_quantization`)."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: int | str) -> int:
    """Parse 1073741824, "1GiB", "512MB" into bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size like 1GiB or 512MB, got {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"expected a size like 1GiB or 512MB, got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class EngineConfig(BaseModel):
    """Limits and memory of one engine."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_memory: int = Field(1 << 30, description="Bytes for the KV block pool (e.g. 1GiB, 512MB).")
    block_size: int = Field(16, ge=1, le=1024, description="Token slots per KV block.")
    max_num_seqs: int = Field(128, ge=1, description="Most sequences decoded together in one step.")
    max_num_batched_tokens: int = Field(1024, ge=16, description="Token budget of one step (prefill + decode).")
    max_model_len: int | None = Field(None, ge=1, description="Context limit; default the model's.")
    scheduling_policy: str = Field("fcfs", description="fcfs or priority (lower value first).")
    seed: int = Field(0, description="Seed for unseeded sampling.")
    fused_decoder: bool | None = Field(
        None, description="Run Llama-family models through the fused decoder (re-lays their weights in place). "
        "Default: on for models decodekit loads itself, off for model objects passed in.")
    draft_fused_decoder: bool | None = Field(
        None, description="The same choice for the draft model of speculative decoding (True fuses a draft passed "
        "as a model object too, re-laying its weights in place). Default: the target's fused_decoder where the "
        "draft can be fused, else the default rule.")
    prepack_weights: bool | None = Field(
        None, description="With the fused decoder on a CPU in float32, keep a second, oneDNN-blocked copy of every "
        "weight for steps of 2-128 rows (batches, speculation, beams: 1.3-1.8x faster products). Default: on "
        "when that copy takes at most 2 GiB.")
    native_kernels: bool | None = Field(
        None, description="With the fused decoder on a CPU in float32, run RMSNorm, SiLU-gating and RoPE + KV write "
        "+ attention of small steps (decode, speculation, beams) as native kernels compiled at first use with the "
        "system C compiler; for a model the fused decoder cannot take, re-lay its own linear layers in place and "
        "multiply them on those kernels (1-24 rows on AVX2, 1-8 on AVX-512, on every core). Default: on when a "
        "compiler is found (else torch ops), for models decodekit loads itself; true asks for it on a model object "
        "too and fails where it cannot run.")

    cuda_graphs: bool | None = Field(
        None, description="On CUDA, replay the fused decoder's decode and verification steps (every sequence "
        "bringing the same 1-16 tokens) from CUDA graphs captured per batch-size bucket at first use. Default: on "
        "where they can run (the fused decoder on CUDA, with Triton); true fails elsewhere.")

    quantization: Literal["int8", "bf16", "gguf", "q4_0", "q4_1", "q8_0"] | None = Field(
        None, description="Weights of the fused decoder's products: unset keeps the model's own (for a GGUF file "
        "loaded with dtype auto on a CPU, its quantized weights as stored: 'gguf', Q4_0, Q4_1, Q8_0, Q4_K and Q6_K "
        "dequantized inside the native products, the dequantized float32 model's outputs up to summation order (on "
        "AVX2 and AVX-512 CPUs Q4_0 and Q4_1, and on AVX2 Q8_0, times activations rounded to 16-bit fixed point per "
        "block of 32); "
        "dtype float32 runs the dequantized model instead); 'int8' multiplies "
        "int8 copies with one float32 scale per output row (the LM head too; float32 activations, like llama.cpp's "
        "Q8_0 weights) through the native kernels: about 2x faster per token at batch 1 on a CPU, no longer exactly "
        "the float model's tokens; 'bf16' multiplies bfloat16 copies in float32 (llama.cpp's bf16 weights): half "
        "the bytes of float32, 2-2.6x faster products of 1-8 rows, 0.85x at 64-128. 'q4_0', 'q4_1' and 'q8_0' "
        "copy the weights into those GGUF block formats at load (llama.cpp's reference quantizer, the LM head in "
        "Q8_0) and multiply them as a GGUF file's stored blocks run: 4-bit with its Q8_0 head reads ~1/6 of "
        "float32's bytes a token. All "
        "need a float model on a CPU with a C compiler. Llama-family models get the copies in the fused decoder; "
        "other architectures (and any model under fused_decoder: false) multiply them in their own linear layers, "
        "whose float32 weights a model decodekit loaded then frees.")
    draft_quantization: Literal["int8", "bf16", "q4_0", "q4_1", "q8_0"] | None = Field(
        None, description="The same choice for the draft model of speculative decoding; with the draft "
        "`target` (the target model itself), any of them makes a quantized self-draft (a model the fused "
        "decoder takes): 'q4_1' reads ~60% of int8's bytes a token, though on AVX2 its product is bound by its "
        "arithmetic and runs no faster.")

    bf16_arithmetic: Literal["auto", "float32", "bf16"] = Field(
        "auto", description="How bf16 weights (quantization: bf16, which a bfloat16 model on a CPU gets) multiply "
        "steps of 8 rows or more (batches, prefill): 'bf16' on the CPU's bf16 dot products (oneDNN's bf16 GEMM: "
        "activations rounded to bf16 at each product's input, float32 accumulation, as vLLM's and transformers' bf16 "
        "run; 2-3x the float32-arithmetic products on AVX512-BF16; with a bf16 KV pool on AVX512-BF16 the decode "
        "steps' attention multiplies on bf16 dot products too, query and probabilities rounded to bf16); 'float32' in "
        "float32 arithmetic (the bf16 "
        "weights' exact products: tokens equal a float32 run of the bf16-rounded model). 'auto': bf16 for a "
        "bfloat16 model on a CPU with bf16 dot products (AVX512-BF16 or AMX), float32 otherwise (and for "
        "quantization: bf16 of a float32 model). Fewer rows always run float32 arithmetic.")

    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Elements of the KV block pool. 'auto': the model's dtype (float32 for a float32 model, "
        "int8 weights included; bfloat16 for a bfloat16 model, also on a CPU where its weights are multiplied in "
        "float32). 'bfloat16' under float32 activations halves the bytes per cached token (twice the tokens in "
        "kv_cache_memory, half the bytes attention reads; 1.02-1.2x faster decode steps on a 2-core CPU): keys and "
        "values are rounded to bf16 when written and attended in float32. On a GPU the pool holds the activations' "
        "dtype.")

    decode_run_steps: int | None = Field(
        None, ge=1, description="Greedy steps of a lone request run in one call (the fused decoder's native "
        "layer stack on a CPU, one CUDA graph replay on a GPU): when one request runs and none waits, and its tokens "
        "are plain argmaxes (greedy, no processors, logprobs or trace), up to this many tokens come from one call "
        "and then pass the stopping criteria in order, so the step's Python is paid once per run (a batch-1 token "
        "1.05-1.15x faster on a 2-core CPU); the same tokens, streamed a run at a time. A run is cut to about 0.1 s "
        "of tokens (no fewer than 8) by the engine's timing of earlier runs, and ends after its current token when "
        "a request arrives or is aborted through the server. Default 32 (a GPU's CUDA graph replays 32 steps too). "
        "1: every token its own step.")

    tensor_parallel_size: int = Field(
        1, ge=1, description="Split the model over this many processes on this machine (tensor parallelism, "
        "Megatron-style: each rank holds 1/N of every layer's attention heads, KV heads and MLP width, and its share "
        "of the KV pool; torch.distributed with gloo on CPUs, NCCL on GPUs). Rank 0 (this process) runs the "
        "scheduler, the plugins and the front-ends; ranks 1..N-1 are worker processes. kv_cache_memory is per rank. "
        "The heads, the KV heads and the MLP width must divide by N. 1: one process, nothing distributed.")

    tensor_parallel_backend: Literal["mp", "ray"] = Field(
        "mp", description="How ranks 1..N-1 of tensor_parallel_size start: 'mp', processes on this machine "
        "(torch.multiprocessing, the model handed over through shared memory); 'ray', Ray actors in a placement "
        "group of one bundle per rank (PACK: this node first, then the cluster's others), on the Ray cluster this "
        "process is connected to (else RAY_ADDRESS's, else a local one), the model handed over through Ray's "
        "object store (needs decodekit[ray]).")

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_memory(cls, value: int | str) -> int:
        return parse_bytes(value)

    @field_validator("scheduling_policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        if value not in ("fcfs", "priority"):
            raise ValueError(f"must be 'fcfs' or 'priority', got {value!r}")
        return value
