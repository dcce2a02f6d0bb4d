"""CUDA graphs of the fused decoder's decode and verify steps: one launch per step instead of hundreds.

On a GPU a small model's step is bound by Python and kernel launches, not by reading weights: SmolLM2-135M's bf16
weights take ~0.09 ms to read on an H100, while a step was ~27 kernel launches per layer, each dispatched from
Python. `DecodeGraphs` captures the whole fused forward once per (batch bucket, query length) and replays it.

- The inputs live in static buffers: token ids, positions, KV slots, and each token's row and key limit in a
  static block table (`TokenTable`). Each step copies its values in from pinned memory (asynchronous copies) and
  replays. The attention kernel reads block tables and key limits from memory, so one graph serves any contexts.
- Batches are padded up to a bucket (1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to `max_num_seqs`). Padding rows write
  their keys and values to the pool's scratch slot (`PagedKVCache.scratch_slot`) and attend to nothing.
- A step qualifies when every sequence brings 1 to `MAX_GRAPH_QUERY` new tokens: plain decode (1), beams,
  speculative verification (k + 1, each sequence padded to the step's longest). Steps with a prefill chunk longer
  than that run eagerly. Graphs are captured lazily, the first time a (bucket, query length) is seen, all into one
  memory pool.
- Logits and last hidden states come out for every row; `run` picks the rows asked for by index, which also
  copies them out of the graph's buffers before the next replay overwrites them.

With `capture=False` the same static-buffer forward runs eagerly. That is how the padding and the token-table
logic are tested on a machine without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from decodekit.execution.attention.gpu import TokenTable, attention_parts
from decodekit.execution.attention.kv_cache import AttentionLayout, PagedKVCache

if TYPE_CHECKING:
    from decodekit.execution.fused.decoder import FusedDecoder
    from decodekit.execution.items import ForwardItem

log = logging.getLogger("decodekit.cuda_graphs")

# Steps whose sequences each bring at most this many tokens can be replayed: decode, and verification of up to 15
# draft tokens. (The n-gram proposer's adaptive k tops out at 10.)
MAX_GRAPH_QUERY = 16
# The most steps of one decode run (`DecodeGraphs.decode_run`): the run's token ids live in one static row of the
# metadata (the pending token, then each step's argmax). A run replays a power of two of steps (at most 7 graphs
# for any run lengths asked, each captured once), and a step of the engine's Python (~1 ms) is paid once a run.
MAX_RUN_STEPS = 64

# Rows of the static metadata buffer: token ids, positions, KV slots, token rows, key limits.
_IDS, _POSITIONS, _SLOTS, _ROWS, _LIMITS = range(5)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: the powers of two and the points halfway between them in ratio (1, 2, 3, 4, 6,
    8, 12, 16, 24, ...), up to and including `max_batch`. A step pads up to the next one, so at most a third of a
    replayed step's rows are padding."""
    buckets = {max_batch}
    power = 1
    while power < max_batch:
        buckets.update({power, min(power + power // 2, max_batch)})
        power *= 2
    return tuple(sorted(b for b in buckets if b >= 1))


class GraphCaptureFailed(RuntimeError):
    """A graph could not be captured; `DecodeGraphs` is then disabled and the step runs eagerly."""


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph, or None when not capturing
    logits: torch.Tensor
    hidden: torch.Tensor


class DecodeGraphs:
    """The fused decoder's uniform steps, replayed from CUDA graphs (or run eagerly from static buffers).

    Args:
        fused: the fused decoder to run.
        cache: its paged KV cache.
        max_batch: the most sequences in one step (the engine's `max_num_seqs`).
        max_model_len: the longest context, which sizes the static block table.
        capture: capture CUDA graphs (needs CUDA); False runs the same static-buffer forward eagerly.
    """

    def __init__(self, fused: FusedDecoder, cache: PagedKVCache, max_batch: int, max_model_len: int,
                 capture: bool = True) -> None:
        device = cache.pool.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device}")
        self.fused = fused
        self.cache = cache
        self.capture = capture
        self.buckets = batch_buckets(max_batch)
        max_tokens = max(self.buckets[-1] * MAX_GRAPH_QUERY, MAX_RUN_STEPS + 1)
        self.width = -(-(max_model_len + MAX_GRAPH_QUERY) // cache.block_size)
        self.meta = torch.zeros(5, max_tokens, dtype=torch.long, device=device)
        self.tables = torch.zeros(self.buckets[-1], self.width, dtype=torch.long, device=device)
        self.every_row = torch.arange(max_tokens, device=device)
        self._picks = torch.zeros(2, max_tokens, dtype=torch.long, device=device)  # logit and hidden rows
        # Host staging in pinned memory, so each step's uploads are asynchronous copies rather than host syncs;
        # `_uploaded` marks when the last step's copies are done, before the staging is written again.
        pinned = capture
        self._host_meta = torch.zeros(5, max_tokens, dtype=torch.long, pin_memory=pinned)
        self._host_tables = torch.zeros(self.buckets[-1], self.width, dtype=torch.long, pin_memory=pinned)
        self._host_picks = torch.zeros(2, max_tokens, dtype=torch.long, pin_memory=pinned)
        self._uploaded = torch.cuda.Event() if capture else None
        # RoPE by lookup for every position a step can reach (the block table's width)
        fused.prepare_device_rope(self.width * cache.block_size)
        self.kv_heads = cache.key_slots[0].shape[1] if cache.key_slots else 1
        # by (batch bucket, query length, attention parts: `attention_parts`, for decode steps)
        self._graphs: dict[tuple[int, int, int], _Captured] = {}
        self._runs: dict[tuple[int, int], _Captured] = {}  # decode runs, by (steps, attention parts)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled: str | None = None  # why graphs are off for good (a capture failed), else None

    @property
    def num_captured(self) -> int:
        """How many (batch bucket, query length, attention parts) graphs exist so far."""
        return len(self._graphs)

    def accepts(self, items: list[ForwardItem]) -> bool:
        """Whether this step can replay a graph: every sequence brings 1..`MAX_GRAPH_QUERY` tokens, the batch fits
        the largest bucket and every context the static block table."""
        if self.disabled is not None or not items or len(items) > self.buckets[-1]:
            return False
        limit = self.width * self.cache.block_size - MAX_GRAPH_QUERY
        return all(1 <= len(it.token_ids) <= MAX_GRAPH_QUERY and it.context_len <= limit for it in items)

    def run(self, items: list[ForwardItem], logit_index: list[int], hidden_index: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one accepted step. Returns float32 logits at `logit_index` and hidden states (the final norm's
        output) at `hidden_index` (None when empty), both indices into the step's packed tokens, like the eager
        forward's. The rows are copies, so the next replay does not change them."""
        batch, q = len(items), max(len(it.token_ids) for it in items)
        bucket = next(b for b in self.buckets if b >= batch)
        padded = bucket * q
        block_size, scratch = self.cache.block_size, self.cache.scratch_slot
        # every sequence gets q rows (its tokens, then padding), and the batch `bucket` sequences
        host = [[0] * padded, [0] * padded, [scratch] * padded, [0] * padded, [0] * padded]
        row_of_token: list[int] = []
        for i, it in enumerate(items):
            first = i * q
            table = it.block_table
            for j, token in enumerate(it.token_ids):
                position = it.context_len + j
                row = first + j
                host[_IDS][row] = token
                host[_POSITIONS][row] = position
                host[_SLOTS][row] = table[position // block_size] * block_size + position % block_size
                host[_ROWS][row] = i
                host[_LIMITS][row] = position + 1
                row_of_token.append(row)
        width = max(-(-(it.context_len + len(it.token_ids)) // block_size) for it in items)
        # a decode step splits long contexts' keys over several programs: a graph per split, for any context
        parts = (attention_parts(padded, self.kv_heads, max(it.context_len + 1 for it in items), self.meta.device)
                 if q == 1 else 1)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last step's uploads have left the staging buffers
        self._host_meta[:, :padded].copy_(torch.tensor(host, dtype=torch.long))
        self._host_tables[:batch, :width].copy_(torch.tensor(
            [(it.block_table + [0] * width)[:width] for it in items], dtype=torch.long))
        self.meta[:, :padded].copy_(self._host_meta[:, :padded], non_blocking=True)
        self.tables[:batch, :width].copy_(self._host_tables[:batch, :width], non_blocking=True)
        keep = self._pick(0, [row_of_token[t] for t in logit_index])
        rows = self._pick(1, [row_of_token[t] for t in hidden_index]) if hidden_index else None
        if self._uploaded is not None:
            self._uploaded.record()
        captured = self._graphs.get((bucket, q, parts))
        if captured is None:
            try:
                captured = self._graphs[(bucket, q, parts)] = self._capture(padded, q == 1, parts)
            except Exception as exc:
                # a model the capture cannot take must not fail every decode step: run eagerly from now on
                self.disabled = f"capturing {padded} rows failed: {exc!r}"
                log.warning("CUDA graphs off for this engine (%s); steps run eagerly", self.disabled)
                raise GraphCaptureFailed(self.disabled) from exc
        if captured.graph is None:  # not capturing: the static-buffer forward, eagerly
            logits, hidden = self._forward(padded, q == 1, parts)
        else:
            captured.graph.replay()
            logits, hidden = captured.logits, captured.hidden
        # copies, not views: the next replay overwrites the graph's buffers
        chosen = logits[keep].to(torch.float32, copy=True)
        return chosen, None if rows is None else hidden[rows].clone()

    def decode_run(self, token: int, position: int, block_table: list[int], steps: int, stop_ids: Sequence[int]
                   ) -> list[int] | None:
        """Up to `steps` greedy tokens of one sequence in one replay (`ModelExecutor.decode_run`): the pending `token`
        at `position`, then each step's argmax fed to the next on the device, so the host waits once per run
        instead of once per token. Ends after one of `stop_ids` (the tokens computed after it are dropped, their
        keys and values written to the sequence's own slots, which it then frees). The largest power of two of
        steps up to `steps` and `MAX_RUN_STEPS` (a graph per run length: the engine asks for the rest next step);
        None (nothing run) where the graphs are off or the run's context passes the static block table."""
        steps = 1 << (min(steps, MAX_RUN_STEPS).bit_length() - 1) if steps >= 1 else 0
        block_size = self.cache.block_size
        if self.disabled is not None or steps < 1 or position + steps > self.width * block_size - MAX_GRAPH_QUERY:
            return None
        host = [[0] * steps for _ in range(5)]
        host[_IDS][0] = token
        for i in range(steps):
            at = position + i
            host[_POSITIONS][i] = at
            host[_SLOTS][i] = block_table[at // block_size] * block_size + at % block_size
            host[_LIMITS][i] = at + 1
        width = -(-(position + steps) // block_size)
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._host_meta[:, :steps].copy_(torch.tensor(host, dtype=torch.long))
        self._host_tables[0, :width].copy_(torch.tensor(block_table[:width], dtype=torch.long))
        self.meta[:, :steps].copy_(self._host_meta[:, :steps], non_blocking=True)
        self.tables[0, :width].copy_(self._host_tables[0, :width], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        parts = attention_parts(1, self.kv_heads, position + steps, self.meta.device)
        captured = self._runs.get((steps, parts))
        if captured is None:
            try:
                captured = self._runs[(steps, parts)] = self._capture_run(steps, parts)
            except Exception as exc:
                self.disabled = f"capturing a run of {steps} steps failed: {exc!r}"
                log.warning("CUDA graphs off for this engine (%s); steps run eagerly", self.disabled)
                return None
        if captured.graph is None:
            self._run_steps(steps, parts)
        else:
            captured.graph.replay()
        tokens = self.meta[_IDS, 1:steps + 1].tolist()  # the one wait of the run
        stops = set(stop_ids)
        for i, new in enumerate(tokens):
            if new in stops:
                return tokens[:i + 1]
        return tokens

    def _run_steps(self, steps: int, parts: int) -> None:
        """The one-token forwards of a decode run over static column i of the metadata, each step's argmax written
        as the next step's token id (what a run's graph captures)."""
        one = self.every_row[:1]
        try:
            for i in range(steps):
                meta = self.meta[:, i:i + 1]
                self.cache.layout = AttentionLayout(meta[_SLOTS], (), (), token_table=TokenTable(
                    meta[_ROWS], meta[_LIMITS], self.tables, single_query=True, parts=parts))
                logits = self.fused(meta[_IDS], meta[_POSITIONS], self.cache, one, None, None)
                self.meta[_IDS, i + 1:i + 2].copy_(torch.argmax(logits, dim=-1))
        finally:
            self.cache.layout = None

    def _capture_run(self, steps: int, parts: int) -> _Captured:
        """Capture a decode run of `steps` steps (warm-up first, as `_capture`; the static buffers hold the run's
        real values, so the warm-up writes the keys and values the replay then writes again, identically)."""
        if not self.capture:
            return _Captured(None, torch.empty(0), torch.empty(0))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run_steps(steps, parts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._run_steps(steps, parts)
        log.debug("captured a CUDA graph of a %d-step decode run", steps)
        return _Captured(graph, torch.empty(0), torch.empty(0))

    def _pick(self, which: int, rows: list[int]) -> slice | torch.Tensor:
        """Rows of the graph's outputs as an index: a slice when they are consecutive (a plain decode step), else
        uploaded from pinned staging (asynchronously)."""
        n = len(rows)
        if n == 0:
            return slice(0, 0)
        if rows == list(range(rows[0], rows[0] + n)):
            return slice(rows[0], rows[0] + n)
        self._host_picks[which, :n].copy_(torch.tensor(rows, dtype=torch.long))
        index = self._picks[which, :n]
        index.copy_(self._host_picks[which, :n], non_blocking=True)
        return index

    def _forward(self, tokens: int, single_query: bool, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused forward over the first `tokens` static rows (what a graph captures); `single_query`: every
        sequence brings one token, whose keys `parts` programs share (`TokenTable`)."""
        meta = self.meta[:, :tokens]
        every = self.every_row[:tokens]
        self.cache.layout = AttentionLayout(meta[_SLOTS], (), (), token_table=TokenTable(
            meta[_ROWS], meta[_LIMITS], self.tables, single_query=single_query, parts=parts))
        try:
            logits = self.fused(meta[_IDS], meta[_POSITIONS], self.cache, every, None, every)
            hidden = self.fused.last_hidden
            assert hidden is not None
            return logits, hidden
        finally:
            self.cache.layout = None
            self.fused.last_hidden = None

    def _capture(self, tokens: int, single_query: bool, parts: int) -> _Captured:
        """Capture the forward of `tokens` rows (the static buffers already hold a real step's values: warm-up and
        capture write its keys and values, which the replay then writes again, identically)."""
        if not self.capture:
            return _Captured(None, torch.empty(0), torch.empty(0))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: cuBLAS workspaces, Triton compilation, the allocator
            self._forward(tokens, single_query, parts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = self._forward(tokens, single_query, parts)
        log.debug("captured a CUDA graph of %d rows (%d graphs)", tokens, len(self._graphs) + 1)
        return _Captured(graph, logits, hidden)
