"""The GPU path on a GPU: the Triton paged-attention kernel, CUDA graphs, and the engine's outputs with them.

Run on a GPU machine with `pytest -m cuda`; skipped in the default run and without CUDA. Exactness is against
transformers `generate` in float32 on tiny models. In bfloat16, every token the engine chooses must be within
`BF16_LOGIT_TOLERANCE` of the best logit of transformers' own bf16 forward over the same tokens (bf16 rounds the
products differently from one kernel to another, so exact argmax ties cannot be asked for).
"""

from __future__ import annotations

import re

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.execution.attention.gpu import TokenTable, attend_tokens, attend_tokens_reference, kernel_available
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import random_prompts

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_LOGIT_TOLERANCE = 0.05
"""How far below transformers' best bf16 logit the engine's bf16 choice may be (logits of the tiny models span
about +-20)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 64), (8, 8, 128), (4, 1, 80)])
def test_the_triton_kernel_equals_the_torch_reference_and_zeroes_padding(dtype, heads, kv_heads, dim):
    assert kernel_available(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(heads * dim)
    block_size, blocks = 16, 200
    keys = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    values = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    tables = torch.randperm(blocks, device="cuda", generator=gen)[:192].view(6, 32)
    limits = torch.tensor([1, 17, 300, 512, 0, 33, 34, 35, 0, 250], device="cuda")
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 5, 5, 0, 2], device="cuda")
    query = torch.randn(10, heads, dim, device="cuda", generator=gen).to(dtype)
    table = TokenTable(rows, limits, tables)
    out = torch.full_like(query, float("nan"))
    attend_tokens(table, query, keys, values, block_size, 0.125, out)
    reference = attend_tokens_reference(table, query.double(), keys.double(), values.double(), block_size, 0.125)
    error = (out.double() - reference).norm() / reference.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2)
    assert not out.isnan().any() and out[limits == 0].abs().max() == 0


def _engine(model, tokenizer, **options) -> LLM:
    return LLM(model, tokenizer, device="cuda", dtype=options.pop("dtype", "float32"), kv_cache_memory="64MiB",
               **options)


@pytest.mark.parametrize("fused", [True, False], ids=["fused+graphs", "transformers+kernel"])
def test_greedy_equals_transformers_generate_batched_and_alone(tokenizer, fused):
    llm = _engine(tiny_model("llama"), tokenizer, fused_decoder=fused, block_size=4)
    reference = tiny_model("llama").cuda()
    graphs = llm.engine.model.runner.graphs
    assert (graphs is not None) == fused and llm.engine.model.runner.by_token
    prompts = random_prompts(7, 3, 60, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    # alone: a run of 32 tokens from one graph replay (the GPU's default run length), then 16, 4, 2
    alone = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=56, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    ref = reference.generate(torch.tensor(prompts[:1], device="cuda"), max_new_tokens=56, min_new_tokens=56,
                             do_sample=False, pad_token_id=0)
    assert alone[0].outputs[0].token_ids == ref[0, len(prompts[0]):].tolist()
    assert not fused or llm.engine.decode_run_tokens >= 32
    if graphs is not None:
        assert graphs.num_captured >= 2  # batch 7 (bucket 8) and alone (bucket 1)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_bf16_choices_are_within_tolerance_of_transformers_bf16(tokenizer):
    llm = _engine(tiny_model("llama"), tokenizer, dtype="bfloat16", fused_decoder=True)
    reference = tiny_model("llama").to("cuda", torch.bfloat16)
    prompts = random_prompts(6, 5, 40, seed=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = torch.tensor([prompt + out.outputs[0].token_ids], device="cuda")
        with torch.no_grad():
            logits = reference(tokens).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(out.outputs[0].token_ids, device="cuda")[:, None])[:, 0]
        worst = max(worst, float((logits.max(dim=1).values - chosen).max()))
    assert worst <= BF16_LOGIT_TOLERANCE, worst


def _ends(row: list[int], eos: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(row) if t in eos]
    return row[: ends[0] + 1] if ends else row


def test_beams_and_speculation_with_graphs_equal_transformers_and_plain(tokenizer):
    llm = _engine(tiny_model("llama"), tokenizer, draft=tiny_model("llama"), fused_decoder=True, block_size=4)
    reference = tiny_model("llama").cuda()
    eos = list(llm.engine.eos_token_ids)
    prompts = random_prompts(5, 3, 40, seed=0)
    beams = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, strategy={
        "beam_search": {"num_beams": 4, "num_return_sequences": 2}}))
    for prompt, out in zip(prompts, beams):
        ref = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                                 num_beams=4, num_return_sequences=2, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)
        assert [o.token_ids for o in out.outputs] == [_ends(r, eos) for r in ref.sequences[:, len(prompt):].tolist()]
    repetitive = [(p * 4)[:30] for p in prompts]
    plain = llm.generate(repetitive, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for proposer in ("ngram", "draft"):
        spec = llm.generate(repetitive, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, strategy={
            "speculative": {"proposer": proposer, "adaptive": True}}))
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert sum(o.metrics.num_accepted_tokens for o in spec) > 0
    assert llm.engine.model.runner.graphs is not None and llm.engine.model.runner.graphs.num_captured >= 3
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_seeded_sampling_with_processors_gives_the_same_tokens_with_and_without_graphs(tokenizer):
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True,
                             processors=[{"repetition_penalty": {"penalty": 1.2}}]) for i in range(5)]
    prompts = random_prompts(5, 3, 30, seed=3)
    runs = []
    for graphs in (True, False):
        llm = _engine(tiny_model("llama"), tokenizer, fused_decoder=True, cuda_graphs=graphs)
        outs = llm.generate(prompts, params)
        assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.error for o in outs]
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_regex_constraints_hold_under_graphs(tokenizer):
    llm = _engine(tiny_model("llama"), tokenizer, fused_decoder=True)
    patterns = ["(yes|no)", "[0-9]{2,4}", "[ab]{1,5}c", "(the|a) (fox|dog)"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, processors=[{"regex": {"pattern": p}}])
              for i, p in enumerate(patterns)]
    outs = llm.generate(["The quick brown fox"] * len(params), params)
    for out, pattern in zip(outs, patterns):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, out.text), (pattern, out.text)
    assert llm.engine.model.runner.graphs is not None and llm.engine.model.runner.graphs.num_captured > 0
