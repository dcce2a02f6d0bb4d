"""Speculative decoding: greedy output identical to the target's own greedy output, lossless sampling, rollback."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.models.tiny import tiny_model
from decodekit_plugins.speculative import accept_sampled, ngram_proposal
from tests.helpers.reference import random_prompts


def _repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram lookup finds matches."""
    base = random_prompts(count, 4, 9, seed=seed)
    return [(p * 4)[:30] for p in base]


def _spec(proposer: str = "ngram", k: int = 4, adaptive: bool = False, **sampling) -> SamplingParams:
    return SamplingParams(strategy={"speculative": {"proposer": proposer, "num_speculative_tokens": k,
                                                    "adaptive": adaptive}}, **sampling)


def _fed_tokens(proposer, per_forward) -> list[int]:
    """Patch the draft model's runner to note `per_forward` (sum, max) of each forward's sequences' fed tokens."""
    fed: list[int] = []
    forward = proposer.model.runner.forward

    def counted(items, copies):
        fed.append(per_forward(len(item.token_ids) for item in items))
        return forward(items, copies)

    proposer.model.runner.forward = counted
    return fed


def test_ngram_proposal_continues_the_latest_earlier_occurrence():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 3) == [7, 5, 1]
    assert ngram_proposal([4, 5, 6], 2, 1, 3) == []
    assert ngram_proposal([8, 1, 8], 4, 1, 2) == [1, 8]


def _ngram_by_definition(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest n (n_max down to n_min) whose last n tokens occur earlier (ending before the last token); the k
    tokens after the latest such occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(0, 6), n_min=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_ngram_proposal_is_the_latest_occurrence_of_the_longest_matching_suffix(tokens, k, n_min, extra):
    want = _ngram_by_definition(tokens, k, n_min, n_min + extra) if len(tokens) >= 2 and k > 0 else []
    assert ngram_proposal(tokens, k, n_min, n_min + extra) == want


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_speculative_greedy_equals_plain_greedy(llama, tokenizer, batch, adaptive):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = _repetitive_prompts(batch, seed=batch)
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    spec = llm.generate(prompts, _spec("ngram", 4, adaptive, max_tokens=24, temperature=0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


@pytest.mark.parametrize("batch", [1, 8])
def test_draft_equal_to_target_is_accepted_fully_and_matches_greedy(llama, tokenizer, batch):
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(batch, 3, 30, seed=5)
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _spec("draft", 5, max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in spec) == drafted


def test_a_different_draft_model_gives_the_targets_greedy_output(llama, tokenizer):
    draft = tiny_model("qwen2", seed=3)
    llm = LLM(llama, tokenizer, draft=draft, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(8, 3, 30, seed=9)
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    spec = llm.generate(prompts, _spec("draft", 3, True, max_tokens=16, temperature=0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    assert accepted < sum(o.metrics.num_draft_tokens for o in spec)  # some drafts were rejected and rolled back
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
    proposer = llm.engine.components.get("proposers", "draft")
    assert proposer.model.allocator.num_free_blocks == proposer.model.allocator.num_blocks


@pytest.mark.parametrize("batch", [1, 6])
def test_ngram_chained_to_a_draft_model_is_lossless_and_counts_each_proposer(llama, tokenizer, batch):
    llm = LLM(llama, tokenizer, draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB", block_size=4)
    # half the prompts repeat a phrase (n-gram matches), half are random (no match of two tokens: the draft)
    prompts = [*_repetitive_prompts(3, seed=7), *random_prompts(3, 5, 20, seed=8)][:batch]
    chained = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, strategy={"speculative": {
        "proposer": "ngram", "proposer_options": {"prompt_lookup_min": 2}, "fallback": "draft",
        "num_speculative_tokens": 3}})
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, chained)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    totals: dict[str, dict[str, int]] = {}
    for out in spec:
        per = out.metrics.proposer_tokens
        assert sum(c["drafted"] for c in per.values()) == out.metrics.num_draft_tokens
        assert sum(c["accepted"] for c in per.values()) == out.metrics.num_accepted_tokens
        for name, counts in per.items():
            for key, value in counts.items():
                totals.setdefault(name, {}).setdefault(key, 0)
                totals[name][key] += value
    assert totals["draft"]["drafted"] > 0
    if batch > 1:
        assert totals["ngram"]["drafted"] > 0
    proposer = llm.engine.components.get("proposers", "draft")
    assert proposer.model.allocator.num_free_blocks == proposer.model.allocator.num_blocks


def test_a_fallback_is_checked_like_the_proposer(llama, tokenizer):
    from decodekit.api.errors import RecipeError
    from decodekit.recipe import recipe_from_data

    base = {"model": "smollm2-135m-instruct"}
    with pytest.raises(RecipeError, match=r"strategy\.speculative\.fallback: unknown proposer 'drafty'.*draft"):
        recipe_from_data({**base, "strategy": {"speculative": {"fallback": "drafty"}}})
    with pytest.raises(RecipeError, match=r"fallback_options.*prompt_lookup_max"):
        recipe_from_data({**base, "strategy": {"speculative": {"proposer": "draft", "fallback": "ngram",
                                                                "fallback_options": {"prompt_lookup_max": 0}}},
                          "draft": {"model": "target", "quantization": "int8"}})
    with pytest.raises(RecipeError, match=r"needs a draft model"):
        recipe_from_data({**base, "strategy": {"speculative": {"fallback": "draft"}}})
    with pytest.raises(RecipeError, match=r"fallback 'ngram' is the proposer itself"):
        recipe_from_data({**base, "strategy": {"speculative": {"fallback": "ngram"}}})


def test_speculation_pauses_while_the_batch_is_at_least_disable_by_batch_size(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    # k fixed: with k adapted by cost, whether a batch of 2 drafts depends on this machine's costs and the lookups' hits
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, strategy={"speculative": {
        "proposer": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 4}})
    for batch, drafts in ((6, False), (2, True)):
        prompts = _repetitive_prompts(batch, seed=batch)
        plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        spec = llm.generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert (sum(o.metrics.num_draft_tokens for o in spec) > 0) is drafts


def test_the_draft_model_reuses_the_prompt_blocks_an_earlier_request_computed(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB",
              block_size=4)
    prompt = random_prompts(1, 41, 42, seed=12)[0]
    params = _spec("draft", 3, max_tokens=12, temperature=0, ignore_eos=True)
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    llm.generate([[5, 6, 7]], params)  # opens the draft model
    proposer = llm.engine.components.get("proposers", "draft")
    fed = _fed_tokens(proposer, sum)
    first = llm.generate([prompt], params)[0]
    cold, fed[:] = sum(fed), []
    second = llm.generate([prompt], params)[0]
    assert first.token_ids == second.token_ids == plain
    assert cold - sum(fed) >= 40 - 4  # all the prompt's full blocks but the last came from the first request
    assert proposer.model.allocator.num_free_blocks == proposer.model.allocator.num_blocks


def test_a_draft_models_forward_rows_count_what_it_caught_up_on_as_its_runner_fed_them(tokenizer):
    # the adaptive cost model weighs a draft call's time against the rows its forwards fed: the first forward of a
    # request's first call feeds the whole prompt, not one row (charged as one, it made drafts look 100x dearer)
    llm = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB",
              block_size=4)
    llm.generate([[5, 6, 7]], _spec("draft", 3, max_tokens=4, temperature=0))  # opens the draft model
    proposer = llm.engine.components.get("proposers", "draft")
    fed = _fed_tokens(proposer, sum)
    reported: list[list[int]] = []
    propose = proposer.propose
    proposer.propose = lambda *args: (propose(*args), reported.append(proposer.forward_rows()))[0]
    prompts = random_prompts(2, 30, 31, seed=4)
    llm.generate(prompts, _spec("draft", 3, max_tokens=12, temperature=0, ignore_eos=True))
    assert [rows for call in reported for rows in call] == fed
    assert reported[0][0] >= 2 * 30 and reported[0][1:] == [2, 2]  # both prompts, then a token each a forward


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_self_draft_takes_the_targets_keys_and_values_instead_of_computing_them(tokenizer, quantization):
    # the target's own model as draft (as is, or in int8): its cache is filled from the target's pool, so each draft
    # forward feeds one token a sequence (the prompt is not prefilled again), and output stays the target's
    target = tiny_model("llama")
    llm = LLM(target, tokenizer, draft=target, draft_quantization=quantization, kv_cache_memory="16MiB",
              block_size=4)
    prompts = random_prompts(3, 20, 30, seed=8)
    greedy = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = llm.generate(prompts, SamplingParams(**greedy))
    llm.generate([[5, 6, 7]], _spec("draft", 3, max_tokens=4, temperature=0))  # opens the draft model
    proposer = llm.engine.components.get("proposers", "draft")
    fed = _fed_tokens(proposer, max)
    spec = llm.generate(prompts, _spec("draft", 3, **greedy))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert fed and max(fed) == 1  # never a prompt, never a catch-up: one token a sequence a forward
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    if quantization is None:  # the same model reading the same keys and values: every draft token accepted
        assert drafted > 0 and accepted == drafted
    else:
        assert accepted > drafted // 2
    assert proposer.model.allocator.num_free_blocks == proposer.model.allocator.num_blocks


def test_a_draft_of_another_model_computes_its_own_keys_and_values(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("llama", seed=5), kv_cache_memory="16MiB",
              block_size=4)
    llm.generate([[5, 6, 7]], _spec("draft", 3, max_tokens=4, temperature=0))
    proposer = llm.engine.components.get("proposers", "draft")
    assert proposer.model.kv_source is None
    fed = _fed_tokens(proposer, max)
    llm.generate(random_prompts(2, 20, 21, seed=3), _spec("draft", 3, max_tokens=8, temperature=0, ignore_eos=True))
    assert max(fed) >= 20  # its first forward prefilled the prompt


def test_speculative_requests_share_the_batch_with_plain_and_beam_requests(llama, tokenizer):
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    prompts = _repetitive_prompts(6, seed=2)
    params = [_spec("ngram", max_tokens=18, temperature=0), _spec("draft", max_tokens=18, temperature=0),
              SamplingParams(max_tokens=18, temperature=0),
              SamplingParams(max_tokens=8, temperature=0, strategy={"beam_search": {"num_beams": 3}}),
              _spec("ngram", max_tokens=10, temperature=0, stop_token_ids=[prompts[4][5]]),
              SamplingParams(max_tokens=12, seed=4)]
    mixed = llm.generate(prompts, params)
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
    plain = llm.generate(prompts[:2], SamplingParams(max_tokens=18, temperature=0))
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in plain]


def test_stop_inside_an_accepted_draft_drops_the_tokens_after_it(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompt = _repetitive_prompts(1, seed=4)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].token_ids
    stop = plain[6]
    want = plain[: plain.index(stop) + 1]
    out = llm.generate([prompt], _spec("ngram", 8, max_tokens=20, temperature=0, ignore_eos=True,
                                       stop_token_ids=[stop]))[0]
    assert out.token_ids == want and out.finish_reason == "stop"
    out = llm.generate([prompt], _spec("ngram", 8, max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == plain[:5] and out.finish_reason == "length"


@pytest.mark.parametrize("with_draft_distribution", [False, True])
def test_sampled_acceptance_rule_draws_from_the_target_distribution(with_draft_distribution):
    """Chi-square: the token the rule emits at a drafted position is distributed as the target's p."""
    vocab, draws = 6, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0] * 6])
    p = torch.softmax(logits[0], dim=-1)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.0]), dim=-1)

    draft_q = q[None] if with_draft_distribution else None
    generator = torch.Generator().manual_seed(1234)

    counts = torch.zeros(vocab)
    draft_gen = torch.Generator().manual_seed(99)
    for _ in range(draws):
        d = int(torch.multinomial(q, 1, generator=draft_gen)) if with_draft_distribution else 1
        accepted, token = accept_sampled([d], logits, draft_q, generator)
        counts[d if accepted == 1 else token] += 1
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001


def test_speculative_refuses_a_draft_proposer_without_a_draft_model_and_serves_the_others(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    outs = llm.generate([[5, 6, 7]] * 2, [_spec("ngram", n=2, max_tokens=4), _spec("draft", max_tokens=4)])
    assert outs[0].error is None and len(outs[0].outputs) == 2
    assert "needs a draft model" in outs[1].error


def _drafted_per_sequence(out) -> list[int]:
    return [sum(1 for e in c.trace if "drafts" in e) for c in out.outputs]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_parallel_greedy_sequences_under_speculation_each_draft_and_equal_plain_greedy(llama, tokenizer, proposer):
    """n > 1 under speculation: every sequence drafts and verifies on its own, and greedy forks are lossless."""
    llm = LLM(llama, tokenizer, draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB", block_size=4)
    prompts = _repetitive_prompts(3, seed=4)
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _spec(proposer, 3, max_tokens=16, temperature=0, ignore_eos=True, n=3, trace=1))
    for p_out, s_out in zip(plain, spec):
        assert [c.token_ids for c in s_out.outputs] == [p_out.token_ids] * 3
        assert all(d > 0 for d in _drafted_per_sequence(s_out))  # the forks drafted too, not only the first
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
    draft = llm.engine.components.get("proposers", "draft").model
    if draft is not None:
        assert draft.allocator.num_free_blocks == draft.allocator.num_blocks  # every fork's draft blocks freed


@pytest.mark.parametrize("proposer", ["draft", "suffix"])
def test_seeded_parallel_sampling_under_speculation_is_the_same_alone_and_batched(llama, tokenizer, proposer):
    """Each of a seeded request's n sequences draws its own tokens (seed + k, as without speculation), drafts on
    its own, and gives the same tokens alone as batched beside other requests."""
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    prompts = _repetitive_prompts(3, seed=6)
    params = _spec(proposer, 3, max_tokens=14, temperature=0.9, seed=21, ignore_eos=True, n=3, trace=1)
    alone = [llm.generate([p], params)[0] for p in prompts]
    batched = llm.generate([*prompts, prompts[0]], [params] * 3 + [SamplingParams(max_tokens=9, temperature=1.0,
                                                                                  seed=2, n=2)])[:3]
    for a, b in zip(alone, batched):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) == 3  # three different samples
        if proposer == "draft":  # the target as its own draft: every sampled draft token is accepted
            assert all(d > 0 for d in _drafted_per_sequence(a))
            assert a.metrics.num_accepted_tokens == a.metrics.num_draft_tokens > 0
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_with_repetition_penalty_equals_plain_greedy_with_it(llama, tokenizer, proposer):
    """Processors apply at every verified position, each with the history up to that position."""
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    prompts = _repetitive_prompts(8, seed=6)
    penalty = [{"repetition_penalty": {"penalty": 1.3}}]
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, processors=penalty))
    spec = llm.generate(prompts, _spec(proposer, 4, max_tokens=20, temperature=0, processors=penalty))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    unpenalized = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    assert [o.token_ids for o in plain] != [o.token_ids for o in unpenalized]  # the penalty did change the output
    if proposer == "draft":  # the draft sees the same processors, so a draft equal to the target is always right
        assert sum(o.metrics.num_accepted_tokens for o in spec) == sum(o.metrics.num_draft_tokens for o in spec)


def _with_proposer(proposer: type) -> Any:
    """A plugin manager with the built-in plugins and one more registering `proposer` under its name."""
    from decodekit import hookimpl
    from decodekit.core.plugin_manager import get_plugin_manager

    class Plugin:
        @hookimpl
        def decodekit_register_proposers(self, register):
            register(proposer.name, proposer)

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), f"{proposer.name}_plugin")
    return pm


def test_a_third_party_proposer_plugin_is_used_by_name(llama, tokenizer):
    """Proposers register through the same public hook as everything else; a wrong option names its key."""
    from decodekit.api.proposer import Proposer

    class RepeatLast(Proposer):
        name = "repeat_last"

        def propose(self, ctx, seqs, ks, options):
            return [[s.token_ids[-1]] * k for s, k in zip(seqs, ks)], [None] * len(seqs)

    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", plugin_manager=_with_proposer(RepeatLast))
    prompts = random_prompts(3, 4, 20, seed=8)
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    spec = llm.generate(prompts, _spec("repeat_last", 3, max_tokens=12, temperature=0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    bad = llm.generate(prompts[:3] + prompts[:1], [
        SamplingParams(max_tokens=4, strategy={"speculative": {"proposer": "ngrma"}}),
        SamplingParams(max_tokens=4, strategy={"speculative": {"proposer": "ngram",
                                                               "proposer_options": {"prompt_lookup_max": 0}}}),
        SamplingParams(max_tokens=4, strategy={"speculative": {"proposer": "ngram",
                                                               "proposer_options": {"prompt_lookup_mx": 2}}}),
        SamplingParams(max_tokens=4, strategy={"speculative": {"proposer": "repeat_last",
                                                               "proposer_options": {"times": 2}}})])
    assert "unknown proposer 'ngrma' (did you mean 'ngram'?)" in bad[0].error
    # option errors name the key where the request (or recipe) writes it
    assert "strategy.speculative.proposer_options.prompt_lookup_max: Input should be greater" in bad[1].error
    assert ("strategy.speculative.proposer_options.prompt_lookup_mx: unknown key 'prompt_lookup_mx' (did you mean "
            "'prompt_lookup_max'?); known keys: prompt_lookup_min, prompt_lookup_max") in bad[2].error
    assert "strategy.speculative.proposer_options: takes no parameters, got ['times']" in bad[3].error


@functools.cache
def _parallel_engine() -> LLM:
    """One engine for the property below: a tiny Llama target with a Qwen2 draft (built once)."""
    from decodekit.models.tiny import tiny_tokenizer

    return LLM(tiny_model("llama"), tiny_tokenizer(), draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB",
               block_size=4)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), proposer=st.sampled_from(["ngram", "suffix", "draft"]), greedy=st.booleans(),
       k=st.sampled_from([None, 1, 3]), others=st.integers(0, 3), seed=st.integers(0, 10_000),
       repetitive=st.booleans())
def test_parallel_sampling_under_speculation_is_plain_greedy_and_the_same_alone_or_batched(
        n, proposer, greedy, k, others, seed, repetitive):
    """Any n, proposer and draft length (fixed or adapted): greedy forks equal plain greedy; seeded forks give the
    same tokens alone and beside other requests (plain, sampled, speculative); every block is back afterwards."""
    llm = _parallel_engine()
    prompt = random_prompts(1, 5, 12, seed=seed)[0]
    prompt = (prompt * 4)[:28] if repetitive else prompt
    strategy = {"speculative": {"proposer": proposer, **({"num_speculative_tokens": k} if k else {})}}
    params = SamplingParams(n=n, max_tokens=10, ignore_eos=True, temperature=0 if greedy else 0.9, seed=seed,
                            strategy=strategy)
    alone = llm.generate([prompt], params)[0]
    neighbours = random_prompts(others, 4, 20, seed=seed + 1)
    kinds = [SamplingParams(max_tokens=7), SamplingParams(temperature=1.0, seed=seed + 2, max_tokens=9, n=2),
             SamplingParams(temperature=0, max_tokens=8, strategy={"speculative": {"proposer": "ngram"}})]
    batched = llm.generate([*neighbours, prompt], [kinds[i % 3] for i in range(others)] + [params])[-1]
    assert len(alone.outputs) == n
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in alone.outputs]
    if greedy:
        plain = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, temperature=0))[0]
        assert [c.token_ids for c in alone.outputs] == [plain.token_ids] * n
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.num_blocks
    draft = llm.engine.components.get("proposers", "draft").model
    assert draft is None or draft.allocator.num_free_blocks == draft.allocator.num_blocks


def test_a_fork_that_finishes_first_frees_its_draft_blocks_while_the_others_run_on(llama, tokenizer):
    """n > 1: a sequence that stops before its request's others gives its draft model's blocks back at the next
    step, not when the request ends; every block is back at the end."""
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    engine = llm.engine
    params = _spec("draft", 3, n=4, temperature=1.0, seed=3, max_tokens=40, stop_token_ids=list(range(3, 80)))
    request = engine.add_request(_repetitive_prompts(1, seed=3)[0], params)
    draft = engine.components.get("proposers", "draft")
    finished_before: set[int] = set()
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if request.finished:
            break
        for seq in request.sequences:
            if seq.seq_id in finished_before:  # finished a step ago or more, its request still running
                assert not draft.model.allocator.has(seq.seq_id)
                checked += 1
        finished_before |= {seq.seq_id for seq in request.sequences if seq.finished}
    lengths = sorted(len(seq.generated_ids) for seq in request.sequences)
    assert checked > 0 and lengths[0] < lengths[-1]
    assert draft.model.allocator.num_free_blocks == draft.model.allocator.num_blocks


def test_the_batch_size_proposers_and_the_chooser_see_counts_every_running_sequence(llama, tokenizer):
    """`StepContext.num_running` is the batch in sequences: a request with n = 3 and a beam search of 2 beams beside
    a plain request make 6, not 3 requests (the cost chooser sizes each step's rows by it)."""
    from decodekit.api.proposer import Proposer

    seen: list[int] = []

    class Recording(Proposer):
        name = "recording"

        def propose(self, ctx, seqs, ks, options):
            seen.append(ctx.num_running)
            return [[] for _ in seqs], [None] * len(seqs)

    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", plugin_manager=_with_proposer(Recording))
    prompts = random_prompts(3, 6, 7, seed=2)
    outs = llm.generate(prompts, [_spec("recording", 2, n=3, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True),
                           SamplingParams(max_tokens=4, strategy={"beam_search": {"num_beams": 2}}),
                           SamplingParams(max_tokens=4, ignore_eos=True)])
    assert [o.error for o in outs] == [None] * 3
    assert seen and max(seen) == 3 + 2 + 1


@pytest.mark.parametrize("fused", [True, False])
def test_a_proposer_that_reads_hidden_states_sees_every_final_position_once_as_transformers_computes_it(
        tokenizer, fused):
    """`Proposer.hidden_states`: the target's last hidden states of every verified position reach `observe`, once
    each, equal to transformers' (final norm's output), on both forwards; the requests skip the prefix cache while
    others keep it."""
    from decodekit.api.proposer import Proposer

    seen: dict[int, dict[int, torch.Tensor]] = {}

    class Echo(Proposer):  # drafts the last token again; records what it observes
        name = "echo"
        hidden_states = True

        def propose(self, ctx, seqs, ks, options):
            return [[s.token_ids[-1]] * k for s, k in zip(seqs, ks)], [None] * len(seqs)

        def observe(self, seq, states, num_valid):
            rows = seen.setdefault(seq.request.request_id, {})
            for j in range(states.states.shape[0]):
                position = states.start + j
                if position < num_valid:
                    assert position not in rows, f"position {position} observed twice"
                    rows[position] = states.states[j].clone()

    model = tiny_model("llama")
    llm = LLM(model, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=_with_proposer(Echo),
              fused_decoder=fused)
    prompts = random_prompts(3, 9, 20, seed=13)
    llm.generate(prompts, SamplingParams(max_tokens=2))  # published prompt blocks: the echo requests must not use them
    outs = llm.generate(prompts, _spec("echo", 3, max_tokens=10, temperature=0, ignore_eos=True))
    assert all(o.metrics.num_cached_prompt_tokens == 0 for o in outs)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out.token_ids
        with torch.no_grad():
            want = model.model(torch.tensor([tokens])).last_hidden_state[0]
        rows = seen[out.request_id]
        assert sorted(rows) == list(range(len(tokens) - 1))  # every final position; the last token is not computed
        got = torch.stack([rows[p] for p in range(len(tokens) - 1)])
        torch.testing.assert_close(got, want[: len(tokens) - 1], rtol=1e-4, atol=1e-4)
    again = llm.generate(prompts, SamplingParams(max_tokens=2))
    assert all(o.metrics.num_cached_prompt_tokens > 0 for o in again)  # plain requests still use the cache


class _WrappedLinear(torch.nn.Linear):
    """A projection the fused decoder does not take (it is not a plain `nn.Linear`)."""


def _unfusable_draft() -> torch.nn.Module:
    draft = tiny_model("qwen2", seed=5)
    old = draft.model.layers[0].mlp.down_proj
    new = _WrappedLinear(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    draft.model.layers[0].mlp.down_proj = new
    return draft


def test_a_draft_the_fused_decoder_cannot_take_is_refused_at_construction_when_asked_for(llama, tokenizer):
    from decodekit.api.errors import ConfigError

    with pytest.raises(ConfigError, match=r"draft_fused_decoder: a projection is not a plain torch\.nn\.Linear"):
        LLM(tiny_model("llama"), tokenizer, draft=_unfusable_draft(), kv_cache_memory="16MiB",
            draft_fused_decoder=True)


def test_an_unfusable_draft_beside_a_fused_target_runs_unfused_and_stays_lossless(tokenizer):
    target = tiny_model("llama")
    llm = LLM(target, tokenizer, draft=_unfusable_draft(), kv_cache_memory="16MiB", block_size=4,
              fused_decoder=True)
    prompts = random_prompts(6, 3, 30, seed=4)
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for _ in range(2):  # every request works, the first and the later ones
        spec = llm.generate(prompts, _spec("draft", 3, max_tokens=12, temperature=0))
        assert [o.error for o in spec] == [None] * len(prompts)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    proposer = llm.engine.components.get("proposers", "draft")
    assert llm.engine.model.runner.fused is not None and proposer.model.runner.fused is None


def test_a_draft_model_object_is_fused_when_asked_and_says_how_when_not(tokenizer, caplog):
    import logging

    prompts = random_prompts(6, 3, 30, seed=6)
    outputs = {}
    for setting in (None, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="decodekit"):
            llm = LLM(tiny_model("llama"), tokenizer, draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB",
                      block_size=4, draft_fused_decoder=setting)
        assert ("draft_fused_decoder=True" in caplog.text) is (setting is None)
        outputs[setting] = [o.token_ids for o in llm.generate(prompts, _spec("draft", 3, max_tokens=12,
                                                                                  temperature=0))]
        proposer = llm.engine.components.get("proposers", "draft")
        assert (proposer.model.runner.fused is not None) is (setting is True)
        plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
        assert outputs[setting] == [o.token_ids for o in plain]
