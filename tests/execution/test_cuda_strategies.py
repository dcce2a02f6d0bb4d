"""The strategies on CUDA (run on a GPU machine: `pytest -m cuda`; skipped in the default run and without CUDA)."""

from __future__ import annotations

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import random_prompts

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ends(row: list[int], eos: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(row) if t in eos]
    return row[: ends[0] + 1] if ends else row


def test_beam_search_and_speculative_decoding_are_exact_on_cuda(tokenizer):
    model = tiny_model("llama")  # a fresh model: the engine moves it to the GPU
    llm = LLM(model, tokenizer, draft=model, kv_cache_memory="64MiB", block_size=4, device="cuda", dtype="float32")
    eos = list(llm.engine.eos_token_ids)
    prompts = random_prompts(6, 3, 40, seed=0)
    beams = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, strategy={
        "beam_search": {"num_beams": 4, "num_return_sequences": 2}}))
    for prompt, out in zip(prompts, beams):
        ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False, num_beams=4,
                             num_return_sequences=2, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=eos)
        assert [o.token_ids for o in out.outputs] == [_ends(r, eos) for r in ref.sequences[:, len(prompt):].tolist()]
        assert [o.score for o in out.outputs] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-3)
    repetitive = [(p * 4)[:30] for p in prompts]
    penalty = [{"repetition_penalty": {"penalty": 1.3}}]
    plain = llm.generate(repetitive, SamplingParams(max_tokens=20, temperature=0, processors=penalty))
    for proposer in ("ngram", "draft"):
        spec = llm.generate(repetitive, SamplingParams(max_tokens=20, temperature=0, processors=penalty, strategy={
            "speculative": {"proposer": proposer, "adaptive": True}}))
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
