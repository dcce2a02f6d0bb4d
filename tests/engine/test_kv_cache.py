"""Paged attention over the block pool equals plain causal attention per sequence, for any layout."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.execution.attention.kv_cache import PagedKVCache, build_layout, paged_attention_forward

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


class _Layer(torch.nn.Module):
    layer_idx = 0


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_per_sequence_causal_attention(seqs, seed):
    """Each (context, new) pair is one sequence: `context` tokens already cached, `new` tokens queried now."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    total_blocks = sum(-(-(c + q) // BLOCK) for c, q in seqs) + 2
    cache = PagedKVCache(1, total_blocks, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    free = list(range(total_blocks))
    rng.shuffle(free)  # blocks scattered through the pool, not contiguous
    tables, full_k, full_v = [], [], []
    for c, q in seqs:
        tables.append([free.pop() for _ in range(-(-(c + q) // BLOCK))])
        full_k.append(torch.randn(KV_HEADS, c + q, DIM))
        full_v.append(torch.randn(KV_HEADS, c + q, DIM))
    # write the cached context directly into the pool
    for (c, _), table, k, v in zip(seqs, tables, full_k, full_v):
        for pos in range(c):
            block, off = table[pos // BLOCK], pos % BLOCK
            cache.pool[0, 0, block, off] = k[:, pos]
            cache.pool[0, 1, block, off] = v[:, pos]
    layout, positions = build_layout([q for _, q in seqs], [c for c, _ in seqs], tables, BLOCK, torch.device("cpu"))
    new_k = torch.cat([k[:, c:] for (c, _), k in zip(seqs, full_k)], dim=1)[None]
    new_v = torch.cat([v[:, c:] for (c, _), v in zip(seqs, full_v)], dim=1)[None]
    queries = torch.randn(1, HEADS, new_k.shape[2], DIM)
    cache.layout = layout
    cache.update(new_k, new_v, 0)
    out, _ = paged_attention_forward(_Layer(), queries, new_k, new_v, None, scaling=DIM**-0.5, paged_kv_cache=cache)
    start = 0
    for (c, q), k, v in zip(seqs, full_k, full_v):
        qs = queries[:, :, start : start + q]
        mask = torch.ones(q, c + q, dtype=torch.bool).tril(diagonal=c)
        ref = F.scaled_dot_product_attention(qs, k[None], v[None], attn_mask=mask, scale=DIM**-0.5,
                                             enable_gqa=True)
        torch.testing.assert_close(out[0, start : start + q], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        assert positions[start : start + q].tolist() == list(range(c, c + q))
        start += q


def test_copy_blocks_copies_every_layer_and_both_keys_and_values():
    cache = PagedKVCache(3, 4, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.pool.normal_()
    before = cache.pool[:, :, 1].clone()
    cache.copy_blocks([(1, 3)])
    torch.testing.assert_close(cache.pool[:, :, 3], before)
    torch.testing.assert_close(cache.pool[:, :, 1], before)
