"""The systems a benchmark compares, all driving the same loaded HF model object in this process.

Every system takes a round's requests (all arriving at once when `run` is called) and returns a `RunRecord`:
wall time, useful tokens (what the requests asked for), tokens computed including padding waste, and
per-request TTFT/TPOT measured from the round's start, so queueing counts the same way for every system.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from decodekit.bench.metrics import request_latencies
from decodekit.bench.workloads import BenchRequest, Workload

SYSTEMS = ("decodekit", "hf-sequential", "hf-static", "hf-cb")
"""System names: decodekit itself and the baselines."""


@dataclass
class RunRecord:
    """What one system did in one round."""

    wall_s: float
    useful_tokens: int  # tokens the requests asked for and got (each request counted up to its output length)
    computed_tokens: int  # output positions decoded, including static batching's padding waste
    outputs: list[list[int]] = field(repr=False)
    ttft_s: list[float] | None = None
    tpot_s: list[float] | None = None
    peak_rss_bytes: int | None = None
    round_index: int = 0


def _useful(outputs: list[list[int]], requests: list[BenchRequest]) -> int:
    return sum(min(len(out), r.output_len) for out, r in zip(outputs, requests, strict=True))


def _tpot(first: float, last: float, n: int) -> float | None:
    return (last - first) / (n - 1) if n >= 2 else None


OnDone = Callable[[int], None]
"""Called with a count of requests just finished (a benchmark's progress)."""


def kv_bytes_per_token(model: Any) -> int:
    """The bytes one token's keys and values take over all of a model's layers, in its dtype."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    itemsize = torch.tensor([], dtype=model.dtype).element_size()
    return int(text.num_hidden_layers * 2 * kv_heads * head_dim * itemsize)


class System:
    """Base class: `prepare` once (warm-up, not timed), `run` per round, `close` at the end."""

    name = "system"
    notes: tuple[str, ...] = ()

    def prepare(self, workload: Workload) -> None:
        """Warm up (untimed)."""

    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """Serve a round of requests that all arrive now (`on_done` is told as requests finish)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the system holds."""


def _linears_relayable(model: Any) -> bool:
    """Whether decodekit would re-lay this (unfused) model's linear layers had it loaded the model itself: float32
    on a CPU where the native kernels build."""
    from decodekit.execution.kernels.native import load_kernels

    head = model.get_output_embeddings()
    return (head is not None and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
            and not isinstance(load_kernels(), str))


class DecodekitSystem(System):
    """decodekit's `LLM`, built once on the shared model object (or on its own copy for the fused decoder).

    By default every request decodes greedily to its exact length (`ignore_eos`), all submitted at once.
    `variant` gives systems that share this one's `LLM` but run a strategy or fixed-size groups (a benchmark
    matrix).
    """

    name = "decodekit"
    strategy: dict[str, Any] | None = None  # SamplingParams.strategy; then `min_tokens` holds EOS off instead
    batch_size: int | None = None  # None: every request at once; else groups of this many, one after another

    def __init__(self, model: Any, tokenizer: Any, dtype: Any, engine_options: dict[str, Any]) -> None:
        """`model` is the shared model object, or a spec (name, .gguf file) that decodekit loads itself: the latter
        for a GGUF run as stored (`dtype` "auto"), whose quantized weights the shared object does not carry."""
        from decodekit.execution.fused.blocks import fused_decoder_refusal
        from decodekit.llm import LLM

        notes: list[str] = []
        if isinstance(model, str):
            notes.append(f"{model} loaded by decodekit itself, its GGUF weights run as stored")
        elif engine_options.get("fused_decoder") is not False and fused_decoder_refusal(model) is None:
            # The fused decoder re-lays weights in place; a copy keeps the baselines on the untouched module,
            # exactly as a user's transformers code would run it.
            model = copy.deepcopy(model)
            engine_options = {**engine_options, "fused_decoder": True}
            notes.append("fused decoder on its own copy of the weights (the process holds the model twice)")
        elif engine_options.get("native_kernels") is None and _linears_relayable(model):
            # likewise for another architecture's linear layers, which decodekit re-lays in place when it owns them
            model = copy.deepcopy(model)
            engine_options = {**engine_options, "native_kernels": True}
            notes.append("linear layers re-laid on its own copy of the weights (the process holds the model twice)")
        self.llm = LLM(model=model, tokenizer=tokenizer, dtype=dtype, **engine_options)
        fused = self.llm.engine.model.runner.fused
        if fused is not None:
            notes.append("native kernels for small ops: " + ("on" if fused.native is not None else "off"))
        self.notes = tuple(notes)

    def variant(self, *, strategy: dict[str, Any] | None = None, batch_size: int | None = None) -> DecodekitSystem:
        """A system on this one's `LLM` (no second copy of the weights) with its own strategy and grouping.

        With a `strategy`, requests hold EOS off with `min_tokens` (as transformers' `min_new_tokens` does)
        rather than `ignore_eos`, which beam search refuses.
        """
        other = copy.copy(self)
        other.strategy, other.batch_size = strategy, batch_size
        return other

    def prepare(self, workload: Workload) -> None:
        """Run a small prefill + decode batch once so first-call costs stay out of the timing."""
        warm = [BenchRequest(workload.token_pool[:16], 4), BenchRequest(workload.token_pool[16:48], 4)]
        self.run(warm)

    def _params(self, request: BenchRequest) -> Any:
        from decodekit.api.params import SamplingParams

        if self.strategy is None:
            return SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=request.output_len, min_tokens=request.output_len,
                              strategy=self.strategy)

    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """`LLM.generate` calls with greedy params of each request's exact length (one call for all requests,
        or one per group of `batch_size`)."""

        def on_output(out: Any) -> None:
            if out.finished and on_done is not None:
                on_done(1)

        size = self.batch_size or max(len(requests), 1)
        results = []
        start = time.perf_counter()
        for i in range(0, len(requests), size):
            group = requests[i : i + size]
            results.extend(self.llm.generate([r.prompt_ids for r in group], [self._params(r) for r in group],
                                             on_output=on_output))
        wall = time.perf_counter() - start
        errors = [o.error for o in results if o.error]
        if errors:
            raise RuntimeError(f"{len(errors)} decodekit request(s) failed, first: {errors[0]}")
        outputs = [list(o.token_ids) for o in results]
        ttft, tpot = request_latencies(results)
        return RunRecord(wall, _useful(outputs, requests), sum(len(o) for o in outputs), outputs, ttft, tpot)


class _StepTimes:
    """A `generate` streamer noting when each output token arrives (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []  # one entry per output position of a row
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        """Called by `generate` with the prompt, then with each step's new tokens: one per row (`[batch]`), or
        a row's accepted run at once in assisted generation (`[1, n]`)."""
        if self._seen_prompt:
            now = time.perf_counter()
            self.times.extend([now] * (int(value.shape[-1]) if value.dim() > 1 else 1))
        self._seen_prompt = True

    def end(self) -> None:
        """Called by `generate` when it is done."""


class HFGenerateSystem(System):
    """transformers `generate`, greedy, in static batches of `batch_size` (1 = one request at a time).

    Batches are formed in arrival order and left-padded; each runs to its longest output length, so shorter
    requests' extra tokens are computed but not counted as useful. `generate_kwargs` go to every `generate` call
    (`num_beams`, `prompt_lookup_num_tokens`); beam search takes no streamer, so it has no TTFT or TPOT.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, *, name: str | None = None,
                 generate_kwargs: dict[str, Any] | None = None) -> None:
        self.model = model
        self.batch_size = batch_size
        self.name = name or ("hf-sequential" if batch_size == 1 else "hf-static")
        self.generate_kwargs = dict(generate_kwargs or {})
        self.streaming = self.generate_kwargs.get("num_beams", 1) <= 1
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else getattr(tokenizer, "eos_token_id", None) or 0
        self.device = next(model.parameters()).device

    def prepare(self, workload: Workload) -> None:
        """One short generate to warm up."""
        self.run([BenchRequest(workload.token_pool[:16], 4)] * min(2, self.batch_size))

    @torch.inference_mode()
    def _generate(self, batch: list[BenchRequest]) -> tuple[list[list[int]], list[float], int]:
        width = max(len(r.prompt_ids) for r in batch)
        ids = [[self.pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch]
        steps = max(r.output_len for r in batch)
        streamer = _StepTimes()
        out = self.model.generate(
            input_ids=torch.tensor(ids, device=self.device),
            attention_mask=torch.tensor(mask, device=self.device),
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=self.pad_id,
            **({"streamer": streamer} if self.streaming else {}), **self.generate_kwargs,
        )
        gen = out[:, width:].tolist()
        return [g[: r.output_len] for g, r in zip(gen, batch, strict=True)], streamer.times, out.shape[1] - width

    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """Serve the requests batch after batch; TTFT/TPOT come from the per-token arrival times."""
        outputs: list[list[int]] = []
        ttft: list[float] = []
        tpot: list[float] = []
        computed = 0
        start = time.perf_counter()
        for i in range(0, len(requests), self.batch_size):
            batch = requests[i : i + self.batch_size]
            outs, times, steps = self._generate(batch)
            outputs.extend(outs)
            computed += len(batch) * steps
            for r in batch:
                if times:
                    ttft.append(times[0] - start)
                    n = min(r.output_len, len(times))
                    value = _tpot(times[0], times[n - 1], n)
                    if value is not None:
                        tpot.append(value)
            if on_done is not None:
                on_done(len(batch))
        wall = time.perf_counter() - start
        return RunRecord(wall, _useful(outputs, requests), computed, outputs, ttft, tpot)


class HFContinuousBatchingSystem(System):
    """transformers' own continuous batching (`ContinuousBatchingManager`), one persistent manager.

    Requests are added one by one with their own `max_new_tokens` and EOS disabled (`eos_token_id=-1`), so
    each generates exactly its length. The KV cache, token budget and sequence limit come from decodekit's
    engine options (`kv_cache_memory`, ...) instead of transformers' default (60% of free memory on a CPU).
    """

    name = "hf-cb"

    def __init__(self, model: Any, engine_options: dict[str, Any], page_size: int = 256) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from decodekit.api.config import EngineConfig

        self.model = model
        config = EngineConfig(**engine_options)
        bytes_per_block = kv_bytes_per_token(model) * page_size
        self.num_blocks = max(2, config.kv_cache_memory // bytes_per_block)
        self.cb_config = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=self.num_blocks, max_batch_tokens=config.max_num_batched_tokens,
            max_requests_per_batch=config.max_num_seqs, allow_block_sharing=False,
        )
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=-1,
                                           pad_token_id=0)
        mib = config.kv_cache_memory >> 20
        self.notes = (f"KV cache {self.num_blocks} blocks x {page_size} tokens (~{mib} MiB, like decodekit); "
                      "prefix sharing off; per-request max_new_tokens, EOS off",)
        self._started = False

    def prepare(self, workload: Workload) -> None:
        """Create the manager and its cache, and run a small batch through it."""
        self.run([BenchRequest(workload.token_pool[:16], 4), BenchRequest(workload.token_pool[16:48], 4)])

    @torch.no_grad()
    def run(self, requests: list[BenchRequest], on_done: OnDone | None = None) -> RunRecord:
        """Add every request to the manager, then collect the results as they finish."""
        with self.model.continuous_batching_context_manager(
            generation_config=self.gen_config, continuous_batching_config=self.cb_config,
            persistent_manager=True, block=True, timeout=30,
        ) as manager:
            self._started = True
            start = time.perf_counter()
            ids = [manager.add_request(list(r.prompt_ids), max_new_tokens=r.output_len, eos_token_id=-1,
                                       record_timestamps=True) for r in requests]
            results: dict[str, Any] = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                    if on_done is not None:
                        on_done(1)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped unexpectedly")
            wall = time.perf_counter() - start
        failed = [r.error for r in results.values() if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} hf-cb request(s) failed, first: {failed[0]}")
        outputs = [list(results[i].generated_tokens) for i in ids]
        ttft, tpot = [], []
        for i in ids:
            stamps = results[i].timestamps or []
            if stamps:
                ttft.append(stamps[0] - start)
                value = _tpot(stamps[0], stamps[-1], len(stamps))
                if value is not None and math.isfinite(value):
                    tpot.append(value)
        return RunRecord(wall, _useful(outputs, requests), sum(len(o) for o in outputs), outputs, ttft, tpot)

    def close(self) -> None:
        """Destroy the cached manager (and its KV cache)."""
        if self._started:
            self.model.destroy_cached_continuous_batching_manager()


def build_system(name: str, model: Any, tokenizer: Any, *, dtype: Any, batch_size: int,
                 engine_options: dict[str, Any]) -> System:
    """Construct a system by name (see `SYSTEMS`)."""
    if name == "decodekit":
        return DecodekitSystem(model, tokenizer, dtype, engine_options)
    if name == "hf-sequential":
        return HFGenerateSystem(model, tokenizer, 1)
    if name == "hf-static":
        return HFGenerateSystem(model, tokenizer, batch_size)
    if name == "hf-cb":
        return HFContinuousBatchingSystem(model, engine_options)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
