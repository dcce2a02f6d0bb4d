"""Tensor parallelism (`execution/parallel`): a model split over 2 ranks of 1 thread with gloo gives the tokens
1 rank gives, for every strategy mixed in one batch; models that do not split are refused at load naming the
numbers; a worker killed mid-run fails the requests with an error and the engine stops stepping it; the
all-reduce bytes are what the Megatron split says they are.

Each 2-rank engine spawns one worker process (a few seconds to import torch there), so the exactness runs are
few and each covers a whole mixed batch.
"""

from __future__ import annotations

import os
import re
import signal
import time

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.cli import app
from decodekit.execution.parallel.shard import shard_model, shard_refusal
from decodekit.models.tiny import tiny_model
from decodekit.recipe import load_recipe
from tests.execution.test_phi3_fused import phi3
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.reference import random_prompts
from tests.helpers.served import Served

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(autouse=True)
def one_thread():
    """Each rank on 1 thread (the workers take rank 0's count), as the 2-core machine allows; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mixed_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """One batch of every kind of request: greedy, beams, n > 1 seeded sampling, speculative (n-gram, draft), a
    JSON-schema constraint."""
    prompts = [(p * 3)[:24] for p in random_prompts(6, 4, 9, seed=5)]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, strategy={"beam_search": {"num_beams": 3,
                                                                               "num_return_sequences": 2}}),
        SamplingParams(max_tokens=10, temperature=0.9, n=3, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                       strategy={"speculative": {"proposer": "ngram", "num_speculative_tokens": 3}}),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                       strategy={"speculative": {"proposer": "draft", "num_speculative_tokens": 3}}),
        SamplingParams(max_tokens=16, temperature=0, processors=[{"json_schema": {"schema": SCHEMA}}]),
    ]
    return prompts, params


def _tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decoder", "transformers-forward"])
def test_two_ranks_give_one_ranks_tokens_for_every_strategy_in_one_batch(tokenizer, fused):
    prompts, params = _mixed_batch()
    options = dict(fused_decoder=fused, kv_cache_memory="8MiB", block_size=4)
    one = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=3), **options).generate(prompts, params)
    split = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=3), tensor_parallel_size=2, **options)
    try:
        two = split.generate(prompts, params)
        comm = split.engine.model.runner.comm
    finally:
        split.close()
    assert [o.error for o in two] == [None] * len(prompts)
    assert _tokens(two) == _tokens(one)
    assert len(two[2].outputs) == 3 and len(two[1].outputs) == 2
    # Megatron's split: one all-reduce of [tokens, hidden] float32 after o and one after down, per layer
    config = split.engine.loaded.model.config
    assert comm.all_reduces == 2 * config.num_hidden_layers * comm.steps
    assert comm.all_reduce_bytes == 2 * config.num_hidden_layers * config.hidden_size * 4 * comm.tokens


def test_phi3s_fused_projections_split_over_two_ranks_give_one_ranks_tokens(tokenizer):
    """Phi-3's q/k/v and gate/up come as one linear each (cut part by part), with a 9-token sliding window; prompts
    longer than the window, chunked prefill, n-gram verification."""
    prompts = [(p * 4)[:30] for p in random_prompts(4, 4, 9, seed=2)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                             strategy={"speculative": {"proposer": "ngram", "num_speculative_tokens": 3}})] * 2
    options = dict(fused_decoder=True, kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=24)
    one = LLM(phi3(), tokenizer, **options).generate(prompts, params)
    split = LLM(phi3(), tokenizer, tensor_parallel_size=2, **options)
    try:
        assert [(layer.q_heads, layer.kv_heads, layer.intermediate, layer.window)
                for layer in split.engine.model.runner.fused.layers] == [(2, 1, 64, 9)] * 2
        two = split.generate(prompts, params)
    finally:
        split.close()
    assert _tokens(two) == _tokens(one)


def test_heads_that_do_not_divide_are_refused_at_load_naming_the_numbers(tokenizer):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3: the model's 4 attention heads, 2 key/value "
                                          r"heads and 128 MLP width \(intermediate_size\) must each divide by 3, "
                                          r"and 4 attention heads, 2 key/value heads and 128 MLP width "
                                          r"\(intermediate_size\) do not"):
        LLM(tiny_model("llama"), tokenizer, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"must each divide by 4, and 90 MLP width \(intermediate_size\) does not"):
        LLM(tiny_model("llama", num_key_value_heads=4, intermediate_size=90), tokenizer, tensor_parallel_size=4)


def test_a_quantized_split_model_is_refused_naming_the_option(tokenizer):
    with pytest.raises(ConfigError, match=r"quantization 'int8'.*tensor_parallel_size 2"):
        LLM(tiny_model("llama"), tokenizer, tensor_parallel_size=2, quantization="int8")


def test_a_killed_worker_fails_the_requests_with_an_error_and_frees_the_engine(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, tensor_parallel_size=2, kv_cache_memory="8MiB", block_size=4)
    engine = llm.engine
    try:
        for i, prompt in enumerate(random_prompts(4, 4, 9, seed=1)):
            engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                               request_id=f"r{i}")
        engine.step()
        engine.step()
        worker = engine.model.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        finals = {}
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine hung after its worker died"
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert sorted(finals) == ["r0", "r1", "r2", "r3"]
        for out in finals.values():
            assert out.outputs[0].finish_reason == "error"
            assert "tensor-parallel rank 1" in out.error and "exited with code -9" in out.error
        # the engine refuses every later step with the same error, at once
        started = time.monotonic()
        late = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        assert "tensor-parallel rank 1" in late[0].error and time.monotonic() - started < 10
    finally:
        llm.close()


def test_a_hung_worker_times_the_collective_out_and_fails_the_requests(tokenizer, monkeypatch):
    monkeypatch.setattr("decodekit.execution.parallel.group.DEFAULT_TIMEOUT_S", 5.0)
    llm = LLM(tiny_model("llama"), tokenizer, tensor_parallel_size=2, kv_cache_memory="8MiB", block_size=4)
    engine = llm.engine
    try:
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                           request_id="r0")
        engine.step()
        worker = engine.model.runner.workers[0]
        os.kill(worker.pid, signal.SIGSTOP)  # alive, but answering nothing
        started = time.monotonic()
        outputs = engine.step()
        assert time.monotonic() - started < 30
        assert [o.request_id for o in outputs if o.finished] == ["r0"]
        assert "a tensor-parallel collective failed" in outputs[0].error
        assert engine.model.runner.workers == [] and not worker.is_alive()  # the hung worker was killed
    finally:
        llm.close()


@settings(max_examples=12, deadline=None)
@given(ranks=st.sampled_from([1, 2, 4]), tokens=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_shards_put_back_together_are_the_whole_layer(ranks, tokens, seed):
    """Column-parallel q/k/v and gate/up outputs concatenated, and row-parallel o and down outputs summed, over
    the shards equal the whole layer's (the split loses and repeats nothing)."""
    whole = tiny_model("llama", num_key_value_heads=4, seed=seed % 7)
    assert shard_refusal(whole, ranks) is None
    shards = []
    for rank in range(ranks):
        shard = tiny_model("llama", num_key_value_heads=4, seed=seed % 7)
        shard_model(shard, rank, ranks)
        shards.append(shard.model.layers[0])
    layer = whole.model.layers[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=gen)
    for name in ("q_proj", "k_proj", "v_proj"):
        parts = [getattr(s.self_attn, name)(x) for s in shards]
        torch.testing.assert_close(torch.cat(parts, dim=-1), getattr(layer.self_attn, name)(x))
    for name in ("gate_proj", "up_proj"):
        parts = [getattr(s.mlp, name)(x) for s in shards]
        torch.testing.assert_close(torch.cat(parts, dim=-1), getattr(layer.mlp, name)(x))
    heads = torch.randn(tokens, 64, generator=gen)
    width = torch.randn(tokens, 128, generator=gen)
    o_parts = [s.self_attn.o_proj(h) for s, h in zip(shards, heads.chunk(ranks, dim=-1))]
    torch.testing.assert_close(torch.stack(o_parts).sum(0), layer.self_attn.o_proj(heads))
    down_parts = [s.mlp.down_proj(w) for s, w in zip(shards, width.chunk(ranks, dim=-1))]
    torch.testing.assert_close(torch.stack(down_parts).sum(0), layer.mlp.down_proj(width))


def test_one_rank_starts_no_process_and_keeps_the_plain_runner(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, tensor_parallel_size=1)
    assert type(llm.engine.model.runner).__name__ == "ModelRunner"
    assert llm.engine.plan.tensor_parallel == 1


@pytest.mark.slow
def test_three_ranks_give_one_ranks_tokens_on_the_bundled_model():
    """SmolLM2-135M has 9 heads and 3 KV heads: it splits by 3, and 2 is refused naming them."""
    with pytest.raises(ConfigError, match=r"9 attention heads, 3 key/value heads and 1536 MLP width.*divide by 2, "
                                          "and 9 attention heads and 3 key/value heads do not"):
        LLM("smollm2-135m-instruct", dtype="float32", device="cpu", tensor_parallel_size=2)
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=24, temperature=0)
    one = LLM("smollm2-135m-instruct", dtype="float32", device="cpu").generate(prompts, params)
    split = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", tensor_parallel_size=3)
    try:
        three = split.generate(prompts, params)
    finally:
        split.close()
    assert [o.error for o in three] == [None] * 3
    assert _tokens(three) == _tokens(one)


def test_serve_tensor_parallel_refuses_heads_that_do_not_divide_in_one_line(tmp_path):
    recipe = write_tiny_recipe(tmp_path)
    result = CliRunner().invoke(app, ["serve", str(recipe), "--tensor-parallel", "3"])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: tensor_parallel_size 3: the model's 4 attention heads")


def test_the_server_answers_over_a_split_model_and_says_so_when_a_worker_dies(tmp_path):
    recipe = load_recipe(write_tiny_recipe(tmp_path), ["engine.tensor_parallel_size=2"])
    served = Served(recipe)
    try:
        client = served.client()
        first = client.completions.create(model=recipe.model, prompt="hello", max_tokens=4)
        assert first.choices[0].finish_reason == "length"
        worker = served.engine.model.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(openai.APIError, match=r"tensor-parallel rank 1 .* exited with code -9"):
            client.completions.create(model=recipe.model, prompt="hello again", max_tokens=4)
    finally:
        served.stop()
    assert served.engine.model.runner.workers == []  # the server's shutdown stopped the engine's ranks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_cuda_give_one_ranks_tokens_for_every_strategy_in_one_batch(tokenizer):
    """NCCL where the machine has a GPU per rank, else both ranks on one GPU over gloo."""
    prompts, params = _mixed_batch()
    options = dict(device="cuda", dtype="float32", fused_decoder=True, kv_cache_memory="8MiB", block_size=4)
    one = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=3), **options).generate(prompts, params)
    split = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=3), tensor_parallel_size=2, **options)
    try:
        two = split.generate(prompts, params)
    finally:
        split.close()
    assert [o.error for o in two] == [None] * len(prompts)
    assert _tokens(two) == _tokens(one)


def test_ranks_as_ray_actors_give_one_ranks_tokens_and_a_killed_actor_fails_the_requests(tokenizer):
    """`tensor_parallel_backend: ray` on a local Ray cluster: the worker rank is an actor of a placement group."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'decodekit[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        prompts, params = _mixed_batch()
        options = dict(kv_cache_memory="8MiB", block_size=4)
        one = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=3), **options).generate(prompts,
                                                                                                           params)
        split = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=3), tensor_parallel_size=2,
                    tensor_parallel_backend="ray", **options)
        try:
            assert _tokens(split.generate(prompts, params)) == _tokens(one)
            ray.kill(split.engine.model.runner.workers[0].actor)
            late = split.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
            assert re.search(r"tensor-parallel rank 1 \(pid \d+\) stopped \(\w*ActorDiedError", late[0].error)
        finally:
            split.close()
        assert ray.util.placement_group_table() == {} or all(
            group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
