"""The model runner: one packed forward pass for every scheduled sequence, logits only where they are needed."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from decodekit.api.models import StoredWeight
from decodekit.execution.attention.gpu import kernel_available
from decodekit.execution.attention.kv_cache import (
    ATTENTION_NAME,
    BATCHED_MAX_QUERY,
    PagedKVCache,
    build_layout,
    has_attention_sinks,
    needs_capped_attention,
)
from decodekit.execution.cuda_graphs import DecodeGraphs, GraphCaptureFailed
from decodekit.execution.fused.decoder import FusedDecoder
from decodekit.execution.fused.layer_stack import RunDraws, RunInterrupt
from decodekit.execution.geometry import text_config
from decodekit.execution.items import ForwardItem
from decodekit.execution.kernels.native import DecodeAttentionPlan
from decodekit.execution.plan import ExecutionPlan

log = logging.getLogger("decodekit.runner")

# Steps whose short-query sequences (at most BATCHED_MAX_QUERY new tokens each) bring at most this many tokens
# run the native kernels (when on); long prefill chunks in the same step keep the blocked SDPA. Measured (SmolLM2,
# benchmarks/profile_decode.py): a batch-64 decode step at context 256 took 620 ms native vs 1162 ms in torch
# (1 thread); batch 128 at context 64, 763 vs 807 ms (1 thread) and 540 vs 540 ms (2 threads).
NATIVE_MAX_TOKENS = 512


class ModelRunner:
    """Runs a model over the paged KV cache it is given (a `ModelExecutor` owns both); turns a list of `ForwardItem`s
    into logits `[sum(num_logits), vocab]`.

    Where the plan says `fused`, the model runs through `FusedDecoder` (which re-lays its weights in place, or with
    a `quantization` makes compressed copies of them); otherwise through its own transformers forward with the paged
    attention function.
    """

    def __init__(self, model: Any, kv_cache: PagedKVCache, plan: ExecutionPlan,
                 stored: dict[str, StoredWeight] | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.pool.device
        self._config = model.config
        # `stored`: the weights the model's file stores, which `quantization: gguf` multiplies as they are
        self.fused = (FusedDecoder(model, plan.prepack, plan.kernels, plan.quantization, plan.bf16_gemm, stored,
                                   native_stack=plan.native_stack > 0) if plan.fused else None)
        # the GPU path: short queries attended in place by the token-table kernel, uniform steps from CUDA graphs
        capped = needs_capped_attention(text_config(model), plan.max_model_len) or has_attention_sinks(model)
        self.by_token = kernel_available(self.device) and not capped
        self.graphs: DecodeGraphs | None = None
        if plan.cuda_graphs:
            assert self.fused is not None, "CUDA graphs capture the fused decoder"
            self.graphs = DecodeGraphs(self.fused, kv_cache, plan.config.max_num_seqs, plan.max_model_len)

    def forward(self, items: list[ForwardItem], block_copies: list[tuple[int, int]]) -> torch.Tensor:
        """Run one packed forward pass and return float32 logits for the requested positions, in item order."""
        return self.forward_with_hidden(items, block_copies)[0]

    @property
    def runs_decode(self) -> bool:
        """Whether `decode_run` runs greedy steps in one call here: natively (`FusedDecoder.runs_decode`), or as one
        graph replay on a GPU (`DecodeGraphs.decode_run`)."""
        if self.graphs is not None:
            return self.graphs.disabled is None
        return self.fused is not None and self.fused.runs_decode

    @torch.inference_mode()
    def decode_run(self, token: int, position: int, block_table: list[int], steps: int, stop_ids: Sequence[int],
                   block_copies: list[tuple[int, int]], draws: RunDraws | None = None,
                   interrupt: RunInterrupt | None = None) -> list[int] | None:
        """Up to `steps` greedy tokens of one sequence, natively (`FusedDecoder.decode_run`) or from a graph
        (`DecodeGraphs.decode_run`), after the pending copy-on-write `block_copies`; with `draws`, sampled tokens
        (`RunDraws`), natively only; a raised `interrupt` ends a native run after its current token (a graph's
        replay runs whole). None where this runner has no such runs (nothing is run)."""
        if not self.runs_decode or (draws is not None and self.graphs is not None):
            return None
        assert self.fused is not None
        self.kv_cache.copy_blocks(block_copies)
        if self.graphs is not None:
            return self.graphs.decode_run(token, position, block_table, steps, stop_ids)
        return self.fused.decode_run(token, position, block_table, self.kv_cache, steps, stop_ids, draws, interrupt)

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
        query_lens = [len(it.token_ids) for it in items]
        # the fused decoder's native attention (a plan, below) reads no padded groups: the layout leaves them out
        native = (self.fused is not None and self.fused.native is not None
                  and sum(q for q in query_lens if q <= BATCHED_MAX_QUERY) <= NATIVE_MAX_TOKENS)
        layout, positions = build_layout(
            query_lens, [it.context_len for it in items], [it.block_table for it in items],
            self.kv_cache.block_size, self.device, by_token=self.by_token, groups=not native,
            kv_heads=self.kv_cache.key_slots[0].shape[1] if self.kv_cache.key_slots else 1,
        )
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)[None]
        self.kv_cache.layout = layout
        if self.fused is not None:
            plan = None
            if native:
                plan = DecodeAttentionPlan(layout.slot_mapping, query_lens, [it.context_len for it in items],
                                           [it.block_table for it in items], self.kv_cache.block_size,
                                           chunk_max_keys=self.fused.native_chunk_keys(len(flat), self.kv_cache))
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
