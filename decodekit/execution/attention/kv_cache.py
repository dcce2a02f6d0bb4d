"""The KV cache tensors and the paged attention that reads them, plugged into unmodified transformers models.

Two public seams of transformers are used, nothing private:
- `PagedKVCache` is a `transformers.Cache`: the model's attention layers call `update(k, v, layer_idx)`, which
  writes the new keys/values into the block pool at this step's slots (`index_copy_`, no allocation).
- `paged_attention_forward` is registered with `AttentionInterface` as "decodekit_paged"; it attends each
  query to its own sequence's keys gathered from the pool. Because the name has no mask function registered,
  transformers skips building a mask and the layout below carries the sequence boundaries instead. The per-layer
  options transformers passes to attention functions are honoured: `sliding_window` (Mistral, Qwen2, Phi-3, the
  local layers of Gemma 2/3) masks keys more than `window - 1` positions back, `softcap` (Gemma 2) caps the
  scores, and `s_aux` (gpt-oss's attention sinks) adds one learned logit per head to each softmax, all as
  transformers' eager attention computes them.

The pool is allocated once: `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`. Reads gather whole blocks
(`index_select` over the block dimension: one contiguous copy per block, measured about 10x faster here than
indexing slot by slot with a 2-D index).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from decodekit.execution.attention.gpu import TokenTable, attend_tokens, attention_parts

ATTENTION_NAME = "decodekit_paged"
# transformers' `config.layer_types` values the paged attention serves
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Sequences scoring at most this many new tokens are attended together in one padded SDPA call; longer prefill
# chunks get one call each (the padding would cost more than the Python loop).
BATCHED_MAX_QUERY = 16


def sliding_window(config: Any) -> int | None:
    """The window of a model's sliding-window layers (a query sees itself and the `window - 1` keys before it), or
    None where every layer attends the whole context. Read from a transformers config the way its models do."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    if layer_types is None and getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def uniform_window(model: Any) -> int | None:
    """The sliding window when every attention layer of the model has one (Mistral v0.1, Phi-3, StarCoder2, Qwen2
    with every layer windowed): the widest of them. None when some layer attends the whole context (Gemma 2/3,
    gpt-oss, Qwen2's full layers) or none is windowed: then every key may be read again and all blocks are kept.

    Read from the config as transformers' models do, and checked against each attention module's own
    `sliding_window` where it keeps one (a module whose window is unset attends everything)."""
    config = getattr(model, "config", None)
    window = sliding_window(config) if config is not None else None
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "sliding_attention" for kind in layer_types):
        return None
    windows = [window]
    for module in model.modules():
        if hasattr(module, "sliding_window") and hasattr(module, "layer_idx"):
            if not module.sliding_window:
                return None
            windows.append(int(module.sliding_window))
    return max(windows)


def has_attention_sinks(model: Any) -> bool:
    """Whether the model's attention layers carry learned sink logits (gpt-oss's `sinks`, passed as `s_aux`)."""
    return any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules())


def needs_capped_attention(config: Any, max_model_len: int | None = None) -> bool:
    """Whether some layer of the model soft-caps its scores, or attends through a sliding window shorter than
    `max_model_len` (default: any window), which only the mask-carrying attention here serves (not the GPU
    token-table kernel)."""
    window = sliding_window(config)
    bites = window is not None and (max_model_len is None or window < max_model_len)
    return bites or bool(getattr(config, "attn_logit_softcapping", None))


@dataclass(frozen=True)
class BatchedGroup:
    """Sequences with short queries attended in one padded SDPA call (B sequences, Qmax queries, L keys)."""

    query_index: torch.Tensor  # [B * Qmax] long, packed token of each padded query
    query_valid: torch.Tensor | None  # [B * Qmax] bool; None when every sequence has Qmax queries
    blocks: torch.Tensor  # [B * n_blocks] long, block ids (padded with block 0)
    mask: torch.Tensor | None  # [B, 1, Qmax, L] bool, True = attend; None when nothing is masked
    batch: int
    q_max: int
    # (first, count) when the group's blocks are consecutive ids: the keys are then a view of the pool, no gather
    # (one sequence decoding alone usually owns consecutive blocks).
    block_span: tuple[int, int] | None = None
    key_len: int | None = None  # keys to attend when the group is one single-query sequence (then no mask)
    # keys each padded query sees (its position + 1), row-major `[B, Qmax]`: sliding-window masks are built from
    # them, once per window size and step (`window_masks`)
    limits: tuple[int, ...] = ()
    window_masks: dict[int, tuple[int, torch.Tensor | None]] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class AttentionLayout:
    """Where every query token of one forward pass lives and what it may attend to (built once per step).

    Tokens are packed as one row `[1, T]`; `slot_mapping[t]` is the pool slot token t's K/V is written to.
    """

    slot_mapping: torch.Tensor  # [T] long
    groups: tuple[BatchedGroup, ...]
    # long prefill chunks, one SDPA each: (token_start, token_end, context_start, block ids or None)
    chunks: tuple[tuple[int, int, int, torch.Tensor | None], ...] = ()
    # True when one group holds every token in packed order (e.g. a batch of plain decodes): no query gather
    # or output scatter is needed.
    in_order: bool = False
    # The GPU path: every short-query token attended in place by the token-table kernel
    # (`execution.attention.gpu`) instead of `groups`; chunk tokens have limit 0 there and `chunks` fills them.
    token_table: TokenTable | None = None


def build_layout(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
    device: torch.device, by_token: bool = False, groups: bool = True, kv_heads: int = 1,
) -> tuple[AttentionLayout, torch.Tensor]:
    """Describe one packed forward pass: sequence i brings `query_lens[i]` new tokens after `context_lens[i]`.

    Returns the layout and the position id of every packed token. Built with Python lists and one tensor per
    field: a decode step has a handful of sequences, and a dozen small tensor ops cost more (measured ~0.4 ms).
    With `by_token` (the GPU path) short queries are described by a `TokenTable` instead of padded groups; with
    `groups` False by neither (a step the native attention serves reads only the slots, the positions and the
    chunks); the pool's `kv_heads` size a decode step's split of keys over programs there (`attention_parts`).
    """
    n = len(query_lens)
    starts = list(accumulate(query_lens, initial=0))[:n]
    positions: list[int] = []
    slot_mapping: list[int] = []
    for q_len, ctx_len, table in zip(query_lens, context_lens, block_tables):
        span = range(ctx_len, ctx_len + q_len)
        positions.extend(span)
        slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in span)

    chunks = []
    for i in range(n):
        if query_lens[i] > BATCHED_MAX_QUERY:
            total = context_lens[i] + query_lens[i]
            blocks = (torch.tensor(block_tables[i][: -(-total // block_size)], dtype=torch.long, device=device)
                      if context_lens[i] > 0 else None)
            chunks.append((starts[i], starts[i] + query_lens[i], context_lens[i], blocks))
    totals = [c + q for c, q in zip(context_lens, query_lens)]
    if by_token:
        slots = torch.tensor(slot_mapping, dtype=torch.long, device=device)
        return (AttentionLayout(slots, (), tuple(chunks), token_table=_token_table(
            query_lens, context_lens, block_tables, block_size, device, kv_heads)),
            torch.tensor(positions, dtype=torch.long, device=device))
    if not groups:
        return (AttentionLayout(torch.tensor(slot_mapping, dtype=torch.long, device=device), (), tuple(chunks)),
                torch.tensor(positions, dtype=torch.long, device=device))
    short = sorted((i for i in range(n) if query_lens[i] <= BATCHED_MAX_QUERY), key=lambda i: totals[i])
    buckets = _bucket_by_length(short, totals)
    padded = tuple(_batched_group(g, query_lens, context_lens, starts, block_tables, block_size, device)
                   for g in buckets)
    in_order = not chunks and len(buckets) == 1 and buckets[0] == list(range(n)) and len(set(query_lens)) == 1
    layout = AttentionLayout(torch.tensor(slot_mapping, dtype=torch.long, device=device), padded, tuple(chunks),
                             in_order)
    return layout, torch.tensor(positions, dtype=torch.long, device=device)


def _token_table(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
                 device: torch.device, kv_heads: int) -> TokenTable:
    """The token table of a packed step: token j of sequence i sees `context_lens[i] + j + 1` keys; tokens of long
    chunks get 0 (SDPA attends them)."""
    rows: list[int] = []
    limits: list[int] = []
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        rows.extend([i] * q_len)
        limits.extend(range(ctx_len + 1, ctx_len + q_len + 1) if q_len <= BATCHED_MAX_QUERY else [0] * q_len)
    width = max(1, max(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)))
    tables = [b for table in block_tables for b in (table + [0] * width)[:width]]
    single = all(q_len == 1 for q_len in query_lens)
    return TokenTable(torch.tensor(rows, dtype=torch.long, device=device),
                      torch.tensor(limits, dtype=torch.long, device=device),
                      torch.tensor(tables, dtype=torch.long, device=device).view(len(query_lens), width),
                      single_query=single, parts=attention_parts(len(rows), kv_heads, max(limits, default=0), device)
                      if single else 1)


def _bucket_by_length(order: list[int], lengths: list[int]) -> list[list[int]]:
    """Split sequences (sorted by length) so padding to a group's longest wastes at most about a third.

    Attention over the KV cache is memory-bound: every padded key is read for nothing, so mixed lengths get a few
    SDPA calls instead of one padded to the longest.
    """
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= 1.5 * lengths[groups[-1][0]] + 16:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _batched_group(members: list[int], query_lens: list[int], context_lens: list[int], starts: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device) -> BatchedGroup:
    b_q = [query_lens[i] for i in members]
    b_ctx = [context_lens[i] for i in members]
    q_max = max(b_q)
    totals = [c + q for c, q in zip(b_ctx, b_q)]
    n_blocks = -(-max(totals) // block_size)
    # Each padded query slot j of sequence i stands for its query min(j, q_i - 1) (padding repeats the last).
    clamped = [[min(j, q - 1) for j in range(q_max)] for q in b_q]
    query_index = [starts[i] + j for i, row in zip(members, clamped) for j in row]
    uniform_q = all(q == q_max for q in b_q)
    query_valid = None if uniform_q else torch.tensor([j < q for q in b_q for j in range(q_max)], device=device)
    blocks = [b for i in members for b in (block_tables[i] + [0] * n_blocks)[:n_blocks]]
    mask = None
    key_len = None
    limits = [c + j + 1 for c, row in zip(b_ctx, clamped) for j in row]  # keys each query sees
    if len(members) == 1 and q_max == 1:
        key_len = totals[0]  # one decoding sequence: cut the keys to its length instead of masking the tail
    elif q_max > 1 or any(t != n_blocks * block_size for t in totals):
        limit = torch.tensor(limits).view(len(members), q_max)
        mask = (torch.arange(n_blocks * block_size)[None, None, :] < limit[:, :, None]).unsqueeze(1).to(device)
    return BatchedGroup(
        query_index=torch.tensor(query_index, dtype=torch.long, device=device),
        query_valid=query_valid,
        blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        block_span=(blocks[0], len(blocks)) if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None,
        key_len=key_len,
        mask=mask,
        batch=len(members),
        q_max=q_max,
        limits=tuple(limits),
    )


class PagedKVCache(Cache):
    """The block pool of keys and values for every layer, exposed to models as a transformers `Cache`.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: pool geometry.
        dtype, device: where the pool lives. The pool's dtype may be narrower than the model's activations
            (`kv_cache_dtype: bfloat16` under a float32 model): keys and values are then rounded to it as they are
            written and widened back as they are read, so attention's arithmetic stays in the activations' dtype.

    The pool holds one block more than `num_blocks`, never handed out: `scratch_slot` is its first slot, where the
    padding rows of captured CUDA graphs write their keys and values.
    """

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype,
                                device=device)
        self.scratch_slot = num_blocks * block_size
        # The same memory seen slot by slot, for writes: [layers, 2, (num_blocks + 1) * block_size, kv_heads, dim].
        self.slots = self.pool.view(num_layers, 2, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        # Per layer, made once: slot views for writes `[slots, KVH, D]` and block-row views for gathers
        # `[num_blocks + 1, block_size * KVH * D]` (gathering whole rows is byte-identical to gathering blocks of the
        # 4-D pool and measured 1.1-4.8x faster); a decode step would otherwise spend ~10 view calls per layer.
        self.key_slots = [self.slots[i, 0] for i in range(num_layers)]
        self.value_slots = [self.slots[i, 1] for i in range(num_layers)]
        self.key_rows = [self.pool[i, 0].view(num_blocks + 1, -1) for i in range(num_layers)]
        self.value_rows = [self.pool[i, 1].view(num_blocks + 1, -1) for i in range(num_layers)]
        self.layout: AttentionLayout | None = None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Pool bytes one token costs across all layers (keys and values)."""
        return num_layers * 2 * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values (`[1, kv_heads, T, head_dim]`) into the pool; return them unchanged."""
        self.write(layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return key_states, value_states

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `[T, kv_heads, head_dim]` keys and values of this step's packed tokens at their slots."""
        assert self.layout is not None, "PagedKVCache.write called outside an engine forward"
        slots = self.layout.slot_mapping
        self.key_slots[layer_idx].index_copy_(0, slots, keys.to(self.pool.dtype))
        self.value_slots[layer_idx].index_copy_(0, slots, values.to(self.pool.dtype))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write block copies (src, dst) for every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.pool.device)
        dst = torch.tensor([d for _, d in copies], device=self.pool.device)
        self.pool[:, :, dst] = self.pool[:, :, src]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Not meaningful for a packed batch of many sequences; the engine always passes position ids."""
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The number of slots in the pool."""
        return self.num_blocks * self.block_size

    @property
    def is_compileable(self) -> bool:
        """The pool is written with data-dependent indices, so compiled full graphs are not supported."""
        return False


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of packed queries `[1, heads, T, head_dim]` over each sequence's keys in the paged pool.

    Honours the layer's `sliding_window` and `softcap` keywords. Returns `[1, T, heads, head_dim]` as
    transformers' attention functions do.
    """
    cache: PagedKVCache | None = kwargs.get("paged_kv_cache")
    if cache is None or cache.layout is None:
        # Called by plain transformers code (e.g. `model.generate` on a model the engine also serves).
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    out = paged_attention(cache, layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), scaling, window=kwargs.get("sliding_window"),
                          softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return out.unsqueeze(0), None


def paged_attention(cache: PagedKVCache, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scaling: float | None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attend packed queries `[T, heads, head_dim]` to their sequences' keys in the pool (after `write`).

    `key`/`value` (`[T, kv_heads, head_dim]`) are this step's own keys, read directly when a prefill chunk is a
    sequence's whole context. With a `window`, a query at position p sees keys p - window + 1 .. p (transformers'
    `sliding_window`); with a `softcap`, scores are capped to `softcap * tanh(score / softcap)`; with `sinks`
    (`[heads]`), each head's softmax has one more logit, whose weight is dropped (gpt-oss). Returns
    `[T, heads, head_dim]`. Shared by the transformers attention function above and the fused decoder
    (`decodekit/execution/fused/decoder.py`).
    """
    layout = cache.layout
    assert layout is not None, "paged_attention called outside an engine forward"
    k_rows, v_rows = cache.key_rows[layer_idx], cache.value_rows[layer_idx]
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    if layout.token_table is not None:
        # the token-table kernel attends whole contexts without capping: `ModelRunner` builds no token table for a
        # model with a soft-cap, or with a window shorter than its context (so a window seen here never bites)
        assert softcap is None and sinks is None, "the token-table kernel has no softcap or sinks"
        out = query.new_empty(tokens, heads, dim)
        attend_tokens(layout.token_table, query, cache.key_slots[layer_idx], cache.value_slots[layer_idx],
                      cache.block_size, scaling, out)
        attend_chunks(layout, query, key, value, k_rows, v_rows, scaling, out)
        return out
    if layout.in_order:  # one group, every token in packed order: no gather, no scatter
        return _attend_group(layout.groups[0], query, k_rows, v_rows, kv_heads, scaling, window, softcap, sinks)
    out = query.new_empty(tokens, heads, dim)
    for group in layout.groups:
        ob = _attend_group(group, query.index_select(0, group.query_index), k_rows, v_rows, kv_heads, scaling,
                           window, softcap, sinks)
        if group.query_valid is None:
            out.index_copy_(0, group.query_index, ob)
        else:
            out.index_copy_(0, group.query_index[group.query_valid], ob[group.query_valid])
    attend_chunks(layout, query, key, value, k_rows, v_rows, scaling, out, window, softcap, sinks)
    return out


def attend_chunks(layout: AttentionLayout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  k_rows: torch.Tensor, v_rows: torch.Tensor, scaling: float | None, out: torch.Tensor,
                  window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None, only: Collection[int] | None = None) -> None:
    """Attend the layout's long prefill chunks (one SDPA each), writing their rows of `out` `[T, heads, D]`.

    `query`/`key`/`value` are this step's `[T, heads | kv_heads, D]`; `k_rows`/`v_rows` one layer's block rows;
    `window`, `softcap` and `sinks` as in `paged_attention`; with `only`, just the chunks starting at those tokens
    (the rest attended by the native kernel: `DecodeAttentionPlan.chunks_left`).
    """
    kv_heads, dim = key.shape[1], key.shape[2]
    for start, end, ctx_start, blocks in layout.chunks:
        if only is not None and start not in only:
            continue
        qs = query[start:end].transpose(0, 1).unsqueeze(0)
        n_q = end - start
        n_k = ctx_start + n_q
        if blocks is None:  # the whole context is this chunk: no gather
            ks, vs = key[start:end].transpose(0, 1)[None], value[start:end].transpose(0, 1)[None]
            # the values the pool holds, so a prompt attends the same keys whether its prefill is one chunk or many
            ks, vs = _as_stored(ks, k_rows.dtype), _as_stored(vs, v_rows.dtype)
        windowed = window is not None and window < n_k
        skip = 0  # leading keys no query of the chunk sees (whole blocks of them are not read)
        if blocks is not None:
            if windowed:
                assert window is not None
                block_size = k_rows.shape[1] // (kv_heads * dim)
                skipped_blocks = max(0, ctx_start - window + 1) // block_size
                blocks, skip = blocks[skipped_blocks:], skipped_blocks * block_size
            ks = k_rows.index_select(0, blocks).view(-1, kv_heads, dim)[:n_k - skip].transpose(0, 1).unsqueeze(0)
            vs = v_rows.index_select(0, blocks).view(-1, kv_heads, dim)[:n_k - skip].transpose(0, 1).unsqueeze(0)
            ks, vs = ks.to(query.dtype), vs.to(query.dtype)
        if blocks is None and not windowed and softcap is None and sinks is None:
            os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            # query i is at position ctx_start + i; key column c holds position skip + c
            mask = torch.ones(n_q, n_k - skip, dtype=torch.bool, device=query.device).tril(diagonal=ctx_start - skip)
            if windowed:
                assert window is not None
                mask = mask.triu(diagonal=ctx_start - skip - window + 1)  # key >= position - window + 1
            os_ = _attention(qs, ks, vs, mask, scaling, softcap, sinks)
        out[start:end] = os_[0].transpose(0, 1)


def _attend_group(group: BatchedGroup, queries: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                  kv_heads: int, scaling: float | None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One padded SDPA call for a group: `queries` `[B * Qmax, heads, D]` in the group's order, same shape out."""
    batch, q_max = group.batch, group.q_max
    _, heads, dim = queries.shape
    qb = queries.view(batch, q_max, heads, dim).transpose(1, 2)  # [B, H, Q, D]
    if group.block_span is not None:
        first, count = group.block_span
        kb, vb = k_rows[first:first + count], v_rows[first:first + count]
    else:
        kb, vb = k_rows.index_select(0, group.blocks), v_rows.index_select(0, group.blocks)
    kb = kb.view(batch, -1, kv_heads, dim)[:, : group.key_len].transpose(1, 2).to(queries.dtype)  # [B, KVH, L, D]
    vb = vb.view(batch, -1, kv_heads, dim)[:, : group.key_len].transpose(1, 2).to(queries.dtype)
    mask = group.mask
    if window is not None and window < max(group.limits):
        skip, mask = _window_mask(group, window, kb.shape[2], queries.device)
        kb, vb = kb[:, :, skip:], vb[:, :, skip:]
    ob = _attention(qb, kb, vb, mask, scaling, softcap, sinks)
    return ob.transpose(1, 2).reshape(batch * q_max, heads, dim)


def _window_mask(group: BatchedGroup, window: int, num_keys: int, device: torch.device
                 ) -> tuple[int, torch.Tensor | None]:
    """The group's keys cut to `window` (made once per step and window size, shared by the layers using it):
    how many leading keys no query of the group sees (skipped, not read), and the mask over the rest
    (`[B, 1, Qmax, keys]`, True = attend; None when a single query sees exactly the rest)."""
    cached = group.window_masks.get(window)
    if cached is not None:
        return cached
    firsts = [max(0, limit - window) for limit in group.limits]  # the first key each query sees
    skip = min(firsts)
    result: tuple[int, torch.Tensor | None]
    if len(group.limits) == 1 and group.key_len is not None:
        result = (skip, None)  # one decoding sequence: the keys it sees are exactly [skip, key_len)
    else:
        keys = torch.arange(skip, num_keys)[None, :]
        first = torch.tensor(firsts)[:, None]
        limit = torch.tensor(group.limits)[:, None]
        mask = ((keys >= first) & (keys < limit)).view(group.batch, 1, group.q_max, num_keys - skip)
        result = (skip, mask.to(device))
    group.window_masks[window] = result
    return result


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over `[B, heads, Q, D]` queries and `[B, kv_heads, L, D]` keys with a boolean `mask` (True = attend);
    with a `softcap` or `sinks`, which SDPA lacks, transformers' eager attention op for op (so those models stay
    exact)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:  # gpt-oss: one more logit per head, its share of the softmax dropped
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], -1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(weights, value)


def _as_stored(states: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """`states` rounded to the pool's dtype and back (itself where the pool holds its dtype)."""
    return states if states.dtype == pool_dtype else states.to(pool_dtype).to(states.dtype)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
