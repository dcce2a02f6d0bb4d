"""The GPU path's parts that run anywhere: the token-table attention and the graphs' static-buffer forward.

`DecodeGraphs(capture=False)` runs exactly what a CUDA graph captures (static buffers, batches padded to a
bucket, padding rows writing to the scratch slot and attending to nothing), eagerly, so its logic is proven here
on the CPU. The kernel and the captured graphs themselves are tested on a GPU in tests/execution/test_cuda_path.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.execution.attention.kv_cache import PagedKVCache, build_layout, paged_attention
from decodekit.execution.cuda_graphs import MAX_GRAPH_QUERY, MAX_RUN_STEPS, DecodeGraphs, batch_buckets
from decodekit.execution.plan import CPU_RUN_STEPS, GRAPH_RUN_STEPS
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import random_prompts


@given(st.integers(1, 600))
def test_batch_buckets_end_at_the_batch_limit_and_pad_a_batch_by_at_most_a_third(max_batch):
    buckets = batch_buckets(max_batch)
    assert buckets[0] == 1 and buckets[-1] == max_batch and list(buckets) == sorted(set(buckets))
    for batch in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= batch)
        assert bucket - batch <= max(1, bucket // 3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 40)), min_size=1, max_size=5), st.integers(0, 10**6))
def test_token_table_attention_equals_the_padded_group_attention(seqs, seed):
    # the GPU path's layout (`by_token`) and the CPU path's padded SDPA groups attend to the same keys
    gen = torch.Generator().manual_seed(seed)
    block_size, kv_heads, heads, dim = 4, 2, 4, 8
    cache = PagedKVCache(1, 64, block_size, kv_heads, dim, torch.float32, torch.device("cpu"))
    cache.pool.normal_(generator=gen)
    order = torch.randperm(64, generator=gen).tolist()
    tables, start = [], 0
    for q_len, ctx in seqs:
        need = -(-(q_len + ctx) // block_size)
        tables.append(order[start:start + need])
        start += need
    if start > 64:
        return
    query_lens, context_lens = [q for q, _ in seqs], [c for _, c in seqs]
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, dim, generator=gen)
    key = torch.randn(tokens, kv_heads, dim, generator=gen)
    value = torch.randn(tokens, kv_heads, dim, generator=gen)
    outs = []
    for by_token in (False, True):
        cache.layout, _ = build_layout(query_lens, context_lens, tables, block_size, torch.device("cpu"), by_token)
        cache.write(0, key, value)
        outs.append(paged_attention(cache, 0, query, key, value, 0.3))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def _with_static_buffers(llm: LLM, max_batch: int = 8) -> DecodeGraphs:
    runner = llm.engine.model.runner
    assert runner.fused is not None
    runner.graphs = DecodeGraphs(runner.fused, llm.engine.kv_cache, max_batch, llm.engine.max_model_len,
                                 capture=False)
    return runner.graphs


@pytest.mark.parametrize("strategy", [None, {"speculative": {"proposer": "ngram", "num_speculative_tokens": 3}},
                                      {"beam_search": {"num_beams": 3}}])
def test_static_buffer_steps_give_the_tokens_of_the_eager_path(tokenizer, strategy):
    # 3 and 5 sequences pad to buckets of 4 and 8: padding rows must leave the real rows and the cache untouched
    model = tiny_model("llama")
    plain = LLM(model, tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4)
    graphed = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4)
    graphs = _with_static_buffers(graphed, max_batch=16)  # beams: 3 per prompt
    for n in (3, 5):
        prompts = [(p * 3)[:25] for p in random_prompts(n, 3, 30, seed=n)]
        params = SamplingParams(temperature=0, max_tokens=14, strategy=strategy)
        expected = [[o.token_ids for o in out.outputs] for out in plain.generate(prompts, params)]
        outs = graphed.generate(prompts, params)
        assert all(o.finish_reason in ("length", "stop") for out in outs for o in out.outputs)
        assert [[o.token_ids for o in out.outputs] for out in outs] == expected
    assert graphs.num_captured > 0
    assert graphed.engine.allocator.num_free_blocks == graphed.engine.allocator.num_blocks


def test_static_buffer_steps_serve_seeded_sampling_like_the_eager_path(tokenizer):
    plain = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    graphed = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    _with_static_buffers(graphed)
    prompts = random_prompts(4, 3, 20, seed=7)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12) for i in range(4)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


def test_hidden_states_from_static_buffer_steps_drive_eagle_like_the_eager_path(tokenizer, tmp_path):
    # the padded rows of a step map back to the packed tokens for hidden states too (`_pick`): the eagle proposer
    # drafts the same tokens from them, and the output stays plain greedy's
    from tests.strategies.test_eagle import _eagle, _random_head

    head = tmp_path / "head.safetensors"
    _random_head(tiny_model("llama"), head)
    prompts = random_prompts(3, 5, 30, seed=8)
    params = _eagle(3, head, max_tokens=16, temperature=0, ignore_eos=True)
    runs = []
    for static in (False, True):
        llm = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4)
        graphs = _with_static_buffers(llm) if static else None
        outs = llm.generate(prompts, params)
        assert all(o.error is None for o in outs)
        runs.append([(o.token_ids, o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outs])
        if graphs is not None:
            assert graphs.num_captured > 0
    plain = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB").generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert runs[1] == runs[0]
    assert [tokens for tokens, _, _ in runs[1]] == [o.token_ids for o in plain]
    assert sum(drafted for _, drafted, _ in runs[1]) > 0


def test_steps_with_long_chunks_or_too_many_sequences_run_eagerly(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    graphs = _with_static_buffers(llm, max_batch=2)
    from decodekit.execution.runner import ForwardItem

    assert graphs.accepts([ForwardItem([5], 3, [0], 1), ForwardItem([6], 9, [1], 1)])
    assert graphs.accepts([ForwardItem([5], 3, [0], 1), ForwardItem([6, 7, 8], 9, [1], 3)])  # padded to 3 rows each
    assert not graphs.accepts([ForwardItem([5], 3, [0], 1)] * 3)
    assert not graphs.accepts([ForwardItem([5] * (MAX_GRAPH_QUERY + 1), 3, [0, 1, 2, 3, 4], 1)])
    assert not graphs.accepts([ForwardItem([5], graphs.width * llm.engine.kv_cache.block_size, [0], 1)])


def test_a_failed_capture_turns_the_graphs_off_and_the_step_runs_eagerly(tokenizer, caplog):
    plain = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    graphed = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    graphs = _with_static_buffers(graphed)

    def fail(tokens, single_query, parts):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._capture = fail
    prompts = random_prompts(3, 3, 20, seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = graphed.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert all(o.error is None for o in outs)
    assert graphs.disabled is not None and "not permitted" in graphs.disabled and graphs.num_captured == 0
    assert "CUDA graphs off" in caplog.text


def test_cuda_graphs_on_a_cpu_model_are_refused_naming_the_option(tokenizer):
    with pytest.raises(ConfigError, match=r"cuda_graphs: .*CUDA device"):
        LLM(tiny_model("llama"), tokenizer, fused_decoder=True, cuda_graphs=True)


@pytest.mark.parametrize("max_tokens", [1, 9, 13, 40, 100])
def test_a_lone_greedy_request_decodes_in_graph_runs_with_the_tokens_of_the_eager_path(tokenizer, max_tokens):
    # a decode run (several steps, each argmax fed to the next on the device) from the graphs' static buffers, at
    # the GPU's default run length: runs of 32, 16, ... steps, a graph per power of two
    plain = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4,
                decode_run_steps=1)
    graphed = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", block_size=4,
                  decode_run_steps=GRAPH_RUN_STEPS)
    graphs = _with_static_buffers(graphed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in random_prompts(3, 3, 30, seed=11):
        want = plain.generate([prompt], params)[0].outputs[0].token_ids
        assert graphed.generate([prompt], params)[0].outputs[0].token_ids == want
    assert (graphed.engine.decode_run_tokens > 0) == (max_tokens > 2)
    lengths = {steps for steps, _ in graphs._runs}
    assert all(steps & (steps - 1) == 0 and steps <= GRAPH_RUN_STEPS for steps in lengths)
    assert (GRAPH_RUN_STEPS in lengths) == (max_tokens > GRAPH_RUN_STEPS)


def test_the_run_length_left_unset_is_32_at_most_on_a_cpu_as_a_graph_replays(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    assert llm.engine.config.decode_run_steps == CPU_RUN_STEPS == 32  # cut to ~0.1 s of tokens by the engine
    assert GRAPH_RUN_STEPS <= MAX_RUN_STEPS
    assert LLM(tiny_model("llama"), tokenizer, decode_run_steps=3).engine.config.decode_run_steps == 3
    # `decodekit recipe check` names the run length where graphs replay the runs
    graphed = dataclasses.replace(llm.engine.plan, cuda_graphs=True, config=llm.engine.plan.config.model_copy(
        update={"decode_run_steps": GRAPH_RUN_STEPS}))
    assert f"CUDA graphs (a lone greedy request's runs of up to {GRAPH_RUN_STEPS} tokens a replay)" in \
        graphed.describe()


def test_a_graph_run_ends_at_a_stop_id_mid_run(tokenizer):
    plain = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB", decode_run_steps=1)
    graphed = LLM(tiny_model("llama"), tokenizer, fused_decoder=True, kv_cache_memory="16MiB")
    _with_static_buffers(graphed)
    prompt = random_prompts(1, 5, 20, seed=3)[0]
    free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop = free.outputs[0].token_ids[4]  # the fifth token: inside the first run of 8
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    want = plain.generate([prompt], params)[0].outputs[0]
    got = graphed.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert graphed.engine.decode_run_tokens > 0
