"""The references decodekit is held to: transformers' greedy `generate` (plain, and with a bf16-rounding cache),
last-position logits and hidden states, seeded random prompts, and an idle engine."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def random_prompts(count: int, low: int, high: int, vocab: int = 384, seed: int = 0) -> list[list[int]]:
    """Token-id prompts with lengths drawn from [low, high), avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate` greedy continuation of one prompt (stops at EOS like decodekit)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids

def assert_batch_and_ngram_steps_match_transformers(llm, model) -> None:
    """Batch 6 with chunked prefill (3-50 token prompts), then n-gram verification steps on repeated prompts: greedy
    tokens equal transformers' `generate` on `model`, and the n-gram proposer did draft."""
    from decodekit import SamplingParams

    prompts = random_prompts(6, 3, 50, seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 16) for p in prompts]
    copies = [p * 3 for p in random_prompts(3, 4, 9, seed=3)]
    spec = llm.generate(copies, SamplingParams(max_tokens=16, temperature=0, strategy={
        "speculative": {"proposer": "ngram", "num_speculative_tokens": 4}}))
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    assert [o.token_ids for o in spec] == [hf_greedy(model, p, 16) for p in copies]


def assert_last_logits_and_hidden_match(llm, model, prompt: list[int], cap: float) -> None:
    """One engine step over `prompt` that also returns hidden states gives transformers' last-position logits (all
    within the model's logit `cap`) and its last hidden state (after the final norm: the LM head's input)."""
    from decodekit.execution.runner import ForwardItem

    engine = llm.engine
    engine.allocator.allocate(0, [])
    engine.allocator.ensure_slots(0, 0, len(prompt))
    item = ForwardItem(prompt, 0, engine.allocator.block_table(0), 1, 1)
    logits, hidden = engine.model.runner.forward_with_hidden([item], [])
    engine.allocator.free(0)
    with torch.no_grad():
        reference = model(torch.tensor([prompt]), output_hidden_states=True)
    assert float(logits.abs().max()) <= cap
    torch.testing.assert_close(logits[0], reference.logits[0, -1], rtol=1e-5, atol=1e-5)
    assert hidden is not None
    torch.testing.assert_close(hidden[0], reference.hidden_states[-1][0, -1], rtol=1e-5, atol=1e-5)


class Bf16RoundingCache(DynamicCache):
    """transformers' dynamic cache, storing (and returning) every key and value rounded to bfloat16 and widened
    back: what decodekit's bf16 KV pool holds under float32 activations (`kv_cache_dtype`)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = [s.to(torch.bfloat16).to(s.dtype) for s in (key_states, value_states)]
        return super().update(*rounded, layer_idx, *args, **kwargs)


def hf_greedy_bf16_cache(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`hf_greedy` with a `Bf16RoundingCache`."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         past_key_values=Bf16RoundingCache())
    ids = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def assert_idle(llm) -> None:
    """The engine has no request left: nothing waiting or running, no request record, every KV block free."""
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
