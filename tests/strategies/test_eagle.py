"""The `eagle` proposer (a trained draft head over the target's hidden states) on tiny models: lossless greedy and
sampled decoding, the head's catch-up aligned with transformers' hidden states, the head file's checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from decodekit import LLM, SamplingParams
from decodekit.models.draft_head import DraftHead, DraftHeadConfig, HeadCache, load_head, save_head
from decodekit.models.tiny import tiny_model
from tests.helpers.reference import random_prompts


def _eagle(k: int = 3, head: Path | None = None, **sampling) -> SamplingParams:
    options = {} if head is None else {"head": str(head)}
    return SamplingParams(strategy={"speculative": {"proposer": "eagle", "num_speculative_tokens": k,
                                                    "proposer_options": options}}, **sampling)


def _random_head(model, path: Path, draft_vocab: int = 200, seed: int = 0) -> DraftHead:
    """A random head fitted to `model`'s shapes, with a shuffled draft vocabulary of `draft_vocab` ids."""
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.for_target(model.config, draft_vocab, target="tiny"))
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
        head.draft_vocab.copy_(torch.randperm(model.config.vocab_size)[:draft_vocab])
    save_head(head, path)
    return head


def _record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Make the engine's eagle proposer record (the sequence's tokens, its draft) of every proposal."""
    proposer = llm.engine.components.get("proposers", "eagle")
    seen: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    def record(ctx, seqs, ks, options):
        drafts, qs = original(ctx, seqs, ks, options)
        seen.extend((list(seq.token_ids), draft) for seq, draft in zip(seqs, drafts))
        return drafts, qs

    proposer.propose = record
    return seen


@pytest.fixture(scope="module")
def head_file(llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("head") / "tiny.safetensors"
    _random_head(llama, path)
    return path


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("k", [1, 4])
def test_eagle_speculative_greedy_equals_plain_greedy(llama, tokenizer, head_file, batch, k):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(batch, 5, 30, seed=3)
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _eagle(k, head_file, max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.error is None for o in spec)
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    assert all(set(o.metrics.proposer_tokens) <= {"eagle"} for o in spec)


def test_eagle_chained_after_ngram_and_beside_plain_requests_is_lossless(llama, tokenizer, head_file):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(4, 5, 30, seed=5)
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    chained = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, strategy={"speculative": {
        "proposer": "ngram", "proposer_options": {"prompt_lookup_min": 2}, "fallback": "eagle",
        "fallback_options": {"head": str(head_file)}, "num_speculative_tokens": 3}})
    mixed = [chained, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 2
    outs = llm.generate(prompts, mixed)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs[0].metrics.proposer_tokens.get("eagle", {}).get("drafted", 0) > 0


def test_the_first_draft_token_is_the_heads_prediction_from_transformers_hidden_states(llama, tokenizer, head_file):
    """The catch-up feeds the head (f_i, embedding of t_{i+1}) at every verified position: its first draft token is
    what the head, run on transformers' own last hidden states of the whole sequence, predicts."""
    head, _ = load_head(head_file)
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompt = random_prompts(1, 12, 13, seed=9)[0]
    seen = _record_drafts(llm)
    llm.generate([prompt], _eagle(2, head_file, max_tokens=6, temperature=0, ignore_eos=True))
    assert len(seen) >= 2
    embedding = llama.get_input_embeddings().weight
    lm_rows = llama.get_output_embeddings().weight[head.draft_vocab]
    for tokens, draft in seen:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            states = llama.model(input_ids=ids).last_hidden_state
            predicted, _ = head(embedding[ids[:, 1:]], states[:, :-1])
            want = int(head.draft_vocab[(predicted[0, -1] @ lm_rows.T).argmax()])
        assert draft[0] == want


def test_a_prompt_from_the_prefix_cache_keeps_eagle_lossless_and_drafting_from_its_first_computed_position(
        llama, tokenizer, head_file):
    """The second request with the same prompt takes its leading blocks from the prefix cache; the head then starts
    at the first computed position, and its first draft is what the head predicts from transformers' states of the
    positions from there on (RoPE is relative: the head runs from there as from position 0)."""
    head, _ = load_head(head_file)
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompt = random_prompts(1, 22, 23, seed=11)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    seen = _record_drafts(llm)
    out = llm.generate([prompt], _eagle(2, head_file, max_tokens=12, temperature=0, ignore_eos=True))[0]
    cached = out.metrics.num_cached_prompt_tokens
    assert out.token_ids == plain.token_ids and out.error is None
    assert 0 < cached < len(prompt) and out.metrics.num_draft_tokens > 0
    embedding = llama.get_input_embeddings().weight
    lm_rows = llama.get_output_embeddings().weight[head.draft_vocab]
    tokens, draft = seen[0]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        states = llama.model(input_ids=ids).last_hidden_state
        predicted, _ = head(embedding[ids[:, cached + 1:]], states[:, cached:-1])
        assert draft[0] == int(head.draft_vocab[(predicted[0, -1] @ lm_rows.T).argmax()])


def test_eagle_sampling_keeps_the_targets_distribution(tokenizer, tmp_path):
    """Chi-square: the second generated token (drafted by the head, accepted or resampled by the lossless rule) is
    distributed as the target's marginal over the first, computed exactly with transformers."""
    model = tiny_model("llama", vocab_size=64, seed=2)
    with torch.no_grad():  # soften the widened tiny logits so that many tokens are likely
        model.get_output_embeddings().weight.mul_(0.05)
    head_path = tmp_path / "head.safetensors"
    _random_head(model, head_path, draft_vocab=40, seed=1)
    prompt = [5, 9, 12, 7]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
        pairs = torch.tensor([[*prompt, t] for t in range(64)])
        second = torch.softmax(model(pairs).logits[:, -1], dim=-1)
    marginal = (first[:, None] * second).sum(0)
    draws = 3000
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4, max_num_seqs=256)
    params = [_eagle(2, head_path, max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(draws)]
    outs = llm.generate([prompt] * draws, params)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 100  # both branches of the rule ran
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=64).double()
    expected = marginal.double() * draws
    big = expected >= 5  # the rest is merged into one category
    observed, want = counts[big], expected[big]
    if not bool(big.all()):
        observed = torch.cat((observed, counts[~big].sum()[None]))
        want = torch.cat((want, expected[~big].sum()[None]))
    chi2 = float(((observed - want) ** 2 / want).sum())
    dof = len(want) - 1
    # Wilson-Hilferty: the chi-square quantile at p = 0.001 without scipy
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


def test_a_head_that_does_not_fit_the_target_is_refused_by_name(tokenizer, tmp_path, head_file):
    other = tiny_model("llama", hidden_size=32, intermediate_size=64)
    llm = LLM(other, tokenizer, kv_cache_memory="16MiB")
    out = llm.generate([[5, 6, 7]], _eagle(2, head_file, max_tokens=4))[0]
    assert "does not fit model" in out.error and "hidden size 64" in out.error
    missing = llm.generate([[5, 6, 7]], _eagle(2, tmp_path / "none.safetensors", max_tokens=4))[0]
    assert "is not a file" in missing.error and "proposer_options" in missing.error
    no_head = llm.generate([[5, 6, 7]], _eagle(2, None, max_tokens=4))[0]
    assert "no draft head ships for model" in no_head.error
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].error is None  # the engine serves on


def test_a_file_that_is_not_a_head_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not a decodekit draft head"):
        load_head(path)


@pytest.mark.parametrize("fused", [False, True])
def test_the_head_cache_step_equals_the_whole_sequence_forward_for_both_draft_steps(fused):
    config = DraftHeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                             rms_norm_eps=1e-5, rope_theta=1e4, vocab_size=100, draft_vocab_size=50)
    torch.manual_seed(0)
    head = DraftHead(config).eval()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
        embeds, states = torch.randn(1, 12, 64), torch.randn(1, 12, 64)
        whole, kv = head(embeds, states)
        if fused:
            head.fuse()
        cache = HeadCache(config, torch.float32, torch.device("cpu"), capacity=2)  # grows on the way
        parts = [head.step(embeds[0, a:b], states[0, a:b], torch.arange(a, b), cache) for a, b in ((0, 5), (5, 6),
                                                                                               (6, 12))]
        torch.testing.assert_close(torch.cat(parts), whole[0], rtol=1e-4, atol=1e-4)
        second = head.forward_second(embeds, states, whole, kv)
        cache.truncate(7)
        step2 = head.step(embeds[0, 7:8], whole[0, 6:7], torch.tensor([7]), cache)
        torch.testing.assert_close(step2[0], second[0, 7], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inside", [0, 3], ids=["only ids outside the draft vocabulary", "a few inside it"])
def test_a_processor_allowing_only_ids_outside_the_draft_vocabulary_stops_the_draft_not_the_request(
        llama, tokenizer, head_file, inside):
    """The head scores its draft vocabulary only; a constraint that allows no id in it leaves the draft row with
    nothing to choose. That ends the draft there (the target still decodes), as plain decoding would go on."""
    vocab = set(load_head(head_file)[0].draft_vocab.tolist())
    outside = [t for t in range(3, 384) if t not in vocab][:12]
    allowed = outside + sorted(vocab)[:inside]
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(3, 5, 30, seed=4)
    processors = [{"allowed_token_ids": {"token_ids": allowed}}]
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, processors=processors))
    spec = llm.generate(prompts, _eagle(3, head_file, max_tokens=12, temperature=0, processors=processors))
    assert [o.error for o in spec] == [None] * 3
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(set(o.token_ids) <= set(allowed) for o in spec)
