"""Suffix decoding: the suffix trie against a brute-force search, the proposer lossless alone and chained."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.models.tiny import tiny_model
from decodekit_plugins.suffix import SuffixParams, suffix_draft
from decodekit_plugins.suffix_tree import Node, RecentOutputs, SequenceIndex, SuffixTrie
from tests.helpers.reference import random_prompts

tokens_lists = st.lists(st.integers(0, 3), max_size=40)  # a small alphabet: many repeats, long matches
depths = st.integers(1, 7)


def brute_match(text: list[int], context: list[int], depth: int) -> tuple[int, Counter[int]]:
    """The longest suffix of `context` (under `depth` tokens) that occurs in `text` followed by a token, and the
    counts of the tokens that follow it; (0, empty) when none does."""
    for length in range(min(len(context), depth - 1), 0, -1):
        pattern = context[len(context) - length :]
        after = Counter(text[i + length] for i in range(len(text) - length) if text[i : i + length] == pattern)
        if after:
            return length, after
    return 0, Counter()


def snapshot(node: Node) -> dict[int, tuple[int, dict]]:
    """A trie's content as nested dicts: token -> (count, children)."""
    return {token: (child.count, snapshot(child)) for token, child in node.children.items()}


@settings(max_examples=200, deadline=None)
@given(text=tokens_lists, context=tokens_lists, depth=depths)
def test_the_trie_finds_the_longest_continued_suffix_and_its_continuations_counts(text, context, depth):
    trie = SuffixTrie(depth)
    trie.add(text)
    match = trie.match(context)
    length, after = brute_match(text, context, depth)
    if length == 0:
        assert match is None
        return
    assert match is not None and match.length == length
    assert {token: child.count for token, child in match.node.children.items()} == dict(after)


@settings(max_examples=100, deadline=None)
@given(text=tokens_lists, depth=depths)
def test_every_substring_up_to_the_depth_is_counted_once_per_occurrence(text, depth):
    trie = SuffixTrie(depth)
    trie.add(text)
    for start in range(len(text)):
        for end in range(start + 1, min(len(text), start + depth) + 1):
            node = trie.root
            for token in text[start:end]:
                node = node.children[token]
            pattern = text[start:end]
            assert node.count == sum(text[i : i + len(pattern)] == pattern for i in range(len(text)))


@settings(max_examples=100, deadline=None)
@given(first=tokens_lists, second=tokens_lists, depth=depths)
def test_removing_a_sequence_leaves_the_trie_of_the_others(first, second, depth):
    both, alone = SuffixTrie(depth), SuffixTrie(depth)
    both.add(first)
    both.add(second)
    both.remove(first)
    alone.add(second)
    assert snapshot(both.root) == snapshot(alone.root)
    assert both.num_nodes == alone.num_nodes
    both.remove(second)
    assert both.root.children == {} and both.num_nodes == 0


@settings(max_examples=100, deadline=None)
@given(text=tokens_lists, context=tokens_lists, k=st.integers(1, 8), factor=st.sampled_from([0.5, 1.0, 3.0]),
       min_prob=st.sampled_from([0.0, 0.3, 0.9]))
def test_a_draft_follows_the_most_frequent_continuation_within_its_length_bound(text, context, k, factor, min_prob):
    trie = SuffixTrie(8)
    trie.add(text)
    options = SuffixParams(max_spec_factor=factor, min_token_prob=min_prob)
    draft = suffix_draft([trie], context, k, options)
    length, _ = brute_match(text, context, 8)
    assert len(draft) <= min(k, int(factor * length))
    if not draft:
        return
    # it follows a suffix of the context that occurs in the text with the draft after it, within the depth, and
    # its first token is that suffix's most frequent continuation (ties to the smaller id), likely enough
    def follows(size: int) -> bool:
        after = Counter(text[i + size] for i in range(len(text) - size) if text[i : i + size] == context[-size:])
        best = max(after.items(), key=lambda item: (item[1], -item[0]))
        whole = context[-size:] + draft
        return (best[0] == draft[0] and best[1] / sum(after.values()) >= min_prob and size + len(draft) <= 8
                and any(text[i : i + len(whole)] == whole for i in range(len(text))))

    assert any(follows(size) for size in range(1, length + 1))
    tokens, probs = trie.follow(context, lambda size: min(k, int(factor * size)), min_prob)
    assert tokens == draft and all(a >= b >= min_prob for a, b in itertools.pairwise(probs))
    # never a lower score than the longest match's own continuation
    match = trie.match(context)
    assert match is not None
    _, longest_probs = trie.continuation(match, min(k, int(factor * match.length)), min_prob)
    assert sum(probs) >= sum(longest_probs)


def test_a_long_copy_drafts_its_whole_limit_though_the_longest_match_fills_the_depth():
    text = list(range(100, 160))  # 60 distinct tokens, then the first 40 again: the context copies the text
    for index in (SuffixTrie(24), SequenceIndex(24)):
        context = text + text[:40]
        if isinstance(index, SuffixTrie):
            index.add(context)
        else:
            index.extend(context)
        match = index.match(context)
        assert match is not None and match.length == 23  # the depth's longest: room for one token after it
        assert index.continuation(match, 10, 0.1)[0] == text[40:41]
        tokens, probs = index.follow(context, lambda size: min(10, size), 0.1)
        assert tokens == text[40:50] and probs == [1.0] * 10



@settings(max_examples=300, deadline=None)
@given(text=tokens_lists, more=tokens_lists, context=tokens_lists, depth=depths, limit=st.integers(0, 10),
       min_prob=st.sampled_from([0.0, 0.3, 0.9]))
def test_a_sequences_index_matches_and_continues_as_a_trie_of_it_does(text, more, context, depth, limit, min_prob):
    trie, index = SuffixTrie(depth), SequenceIndex(depth)
    trie.add(text + more)
    index.extend(text)  # grown in two parts, as a request's output grows
    index.extend(more)
    for ctx in (context, text + more):  # any context, and the sequence itself (as the proposer asks)
        by_trie, by_index = trie.match(ctx), index.match(ctx)
        assert (by_trie is None) == (by_index is None)
        if by_trie is not None and by_index is not None:
            assert by_index.length == by_trie.length
            assert index.continuation(by_index, limit, min_prob) == trie.continuation(by_trie, limit, min_prob)
        assert (index.follow(ctx, lambda size: min(limit, size), min_prob)
                == trie.follow(ctx, lambda size: min(limit, size), min_prob))




@settings(max_examples=200, deadline=None)
@given(outputs=st.lists(tokens_lists, max_size=6), evicted=st.integers(0, 6), context=tokens_lists, depth=depths,
       limit=st.integers(0, 8))
def test_recent_outputs_match_and_continue_as_a_trie_they_were_added_to_and_evicted_from(outputs, evicted, context,
                                                                                          depth, limit):
    trie, recent = SuffixTrie(depth), RecentOutputs(depth)
    for output in outputs:
        trie.add(output)
        recent.add(output)
    for output in outputs[:evicted]:  # oldest first
        trie.remove(output)
        assert recent.remove_oldest() == len(output)
    for ctx in (context, *outputs):
        by_trie, by_recent = trie.match(ctx), recent.match(ctx)
        assert (by_trie is None) == (by_recent is None)
        if by_trie is not None and by_recent is not None:
            assert by_recent.length == by_trie.length
            assert recent.continuation(by_recent, limit, 0.0) == trie.continuation(by_trie, limit, 0.0)


def test_recent_outputs_compact_what_they_evicted_and_still_match():
    recent, trie = RecentOutputs(8), SuffixTrie(8)
    outputs = [[(i * 5 + j) % 11 for j in range(300)] for i in range(40)]
    for i, output in enumerate(outputs):
        recent.add(output)
        trie.add(output)
        if i >= 3:  # keep the last 3: evictions pass the compaction threshold many times
            recent.remove_oldest()
            trie.remove(outputs[i - 3])
    assert recent.length < 3 * 301 + 4096 + 301  # compacted
    by_trie, by_recent = trie.match(outputs[-1][:50]), recent.match(outputs[-1][:50])
    assert by_trie is not None and by_recent is not None and by_recent.length == by_trie.length
    assert recent.continuation(by_recent, 8, 0.0) == trie.continuation(by_trie, 8, 0.0)


def test_an_index_grown_past_its_first_buffer_still_matches_the_trie():
    text = [(i * 7) % 13 for i in range(300)] + list(range(50)) + [(i * 7) % 13 for i in range(400)]
    trie, index = SuffixTrie(24), SequenceIndex(24)
    trie.add(text)
    for token in text:  # a token at a time, as the proposer catches up
        index.extend([token])
    by_trie, by_index = trie.match(text), index.match(text)
    assert by_trie is not None and by_index is not None and by_index.length == by_trie.length == 23
    assert index.continuation(by_index, 10, 0.1) == trie.continuation(by_trie, 10, 0.1)


def _spec(proposer: str = "suffix", options: dict | None = None, **extra) -> dict:
    return {"speculative": {"proposer": proposer, "proposer_options": options or {}, "num_speculative_tokens": 4,
                            **extra}}


def _loop_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so the request's own trie finds matches."""
    return [(p * 4)[:28] for p in random_prompts(count, 4, 9, seed=seed)]


@pytest.mark.parametrize("batch", [1, 6])
def test_suffix_speculative_greedy_equals_plain_and_frees_its_tries(llama, tokenizer, batch):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = _loop_prompts(batch, seed=batch)
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, strategy=_spec()))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.proposer_tokens.get("suffix", {}).get("accepted", 0) for o in spec) > 0
    proposer = llm.engine.components.get("proposers", "suffix")
    assert proposer._local == {}  # every finished sequence's own trie is dropped
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_recent_outputs_draft_a_repeated_answer_and_stay_under_their_cap(llama, tokenizer):
    prompt = random_prompts(1, 12, 13, seed=21)[0]
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    accepted = {}
    for use in (False, True):
        llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
        strategy = _spec(options={"global_outputs": use, "global_cache_tokens": 40})
        first = llm.generate([prompt], SamplingParams(**greedy, strategy=strategy))[0]
        again = llm.generate([prompt], SamplingParams(**greedy, strategy=strategy))[0]
        assert again.token_ids == first.token_ids
        accepted[use] = again.metrics.num_accepted_tokens
        proposer = llm.engine.components.get("proposers", "suffix")
        assert proposer.global_tokens == (24 if use else 0)
        third = llm.generate([prompt], SamplingParams(**greedy, strategy=strategy))[0]
        assert third.token_ids == first.token_ids
        assert proposer.global_tokens <= 40  # the oldest output was evicted to make room
    assert accepted[True] > accepted[False]  # the second answer is drafted from the first's



def test_forgotten_outputs_no_longer_draft_a_repeated_answer(llama, tokenizer):
    prompt = random_prompts(1, 12, 13, seed=21)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, strategy=_spec())
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    first = llm.generate([prompt], params)[0]
    remembered = llm.generate([prompt], params)[0]
    proposer = llm.engine.components.get("proposers", "suffix")
    proposer.forget_outputs()
    assert proposer.global_tokens == 0 and proposer.recent.length == 0
    forgotten = llm.generate([prompt], params)[0]
    assert forgotten.token_ids == remembered.token_ids == first.token_ids
    assert forgotten.metrics.num_accepted_tokens == first.metrics.num_accepted_tokens  # as on a fresh engine
    assert remembered.metrics.num_accepted_tokens > first.metrics.num_accepted_tokens


def test_a_chain_of_three_drafts_with_each_link_where_the_earlier_ones_find_nothing(llama, tokenizer):
    llm = LLM(llama, tokenizer, draft=tiny_model("qwen2", seed=3), kv_cache_memory="16MiB", block_size=4)
    prompts = [*_loop_prompts(3, seed=7), *random_prompts(3, 5, 20, seed=8)]
    chained = _spec("ngram", {"prompt_lookup_min": 3}, fallback=["suffix", "draft"],
                    fallback_options=[{"min_token_prob": 0.5}, {}])
    greedy = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    plain = llm.generate(prompts, SamplingParams(**greedy))
    spec = llm.generate(prompts, SamplingParams(**greedy, strategy=chained))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    drafted = Counter()
    for out in spec:
        for name, counts in out.metrics.proposer_tokens.items():
            drafted[name] += counts["drafted"]
    assert drafted["ngram"] > 0 and drafted["suffix"] > 0 and drafted["draft"] > 0


@pytest.mark.parametrize(("strategy", "error"), [
    ({"fallback": ["suffix", "suffix"]}, r"fallback 'suffix' is in the chain twice"),
    ({"fallback": ["suffix", "ngram"]}, r"fallback 'ngram' is the proposer itself"),
    ({"fallback": ["suffix"], "fallback_options": {"min_token_prob": 0.2}}, r"a list of fallbacks takes a list"),
    ({"fallback": ["suffix", "draft"], "fallback_options": [{}]}, r"1 dicts for 2 fallbacks"),
    ({"fallback": ["suffix", "draft"], "fallback_options": [{"min_token_prob": 2}, {}]},
     r"strategy\.speculative\.fallback_options\[0\].*min_token_prob"),
    ({"fallback": ["suffix", "drafty"]}, r"strategy\.speculative\.fallback\[1\]: unknown proposer 'drafty'"),
])
def test_a_bad_chain_is_refused_naming_the_link(strategy, error):
    from decodekit.api.errors import RecipeError
    from decodekit.recipe import recipe_from_data

    with pytest.raises(RecipeError, match=error):
        recipe_from_data({"model": "smollm2-135m-instruct", "draft": {"model": "target", "quantization": "int8"},
                          "strategy": {"speculative": strategy}})


def test_a_bad_suffix_option_fails_its_request_alone(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    bad = SamplingParams(max_tokens=4, strategy=_spec(options={"max_spec_factor": 0}))
    good = SamplingParams(max_tokens=4, temperature=0, strategy=_spec())
    outs = llm.generate(_loop_prompts(2, seed=3), [bad, good])
    assert outs[0].error is not None and "proposer_options.max_spec_factor" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 4
