"""Draft trees: lossless greedy verification, the multi-branch sampling rule, and the engine's probes and blocks."""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.draft_tree import DraftTree, branch_row_starts, count_nodes
from decodekit.models.tiny import tiny_model
from decodekit.testing import check_proposer
from decodekit_plugins.draft_trees import accept_tree
from tests.helpers.reference import random_prompts

# ---- the acceptance rule on a synthetic target and draft ---------------------------------------------------------
VOCAB = 4
TARGET = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(11)) * 1.5  # logits after each token
DRAFT = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(12)) * 1.5


def _grow(last: int, path: list[int], probs: list[torch.Tensor | None], depth: int, width: int,
          gen: torch.Generator) -> list[tuple[list[int], list[torch.Tensor | None]]]:
    """A draft tree as `draft_tree` grows one: the draft's sampled chain first, and at every node its next most
    likely tokens as deterministic siblings, each drafted on to the same depth (every node is 'uncertain' here)."""
    if depth == 0:
        return [(path, probs)]
    q = torch.softmax(DRAFT[path[-1] if path else last], dim=-1)
    token = int(torch.multinomial(q, 1, generator=gen))
    out = _grow(last, [*path, token], [*probs, q], depth - 1, width, gen)
    siblings = [t for t in torch.topk(q, width).indices.tolist() if t != token][: width - 1]
    for sibling in siblings:
        out += _grow(last, [*path, sibling], [*probs, None], depth - 1, width, gen)
    return out


def _rows(last: int, branches: list[list[int]]) -> torch.Tensor:
    """The target's logits at each branch's `1 + len(branch)` positions, branch after branch."""
    return torch.stack([TARGET[([last, *branch])[j]] for branch in branches for j in range(1 + len(branch))])


@pytest.mark.parametrize(("depth", "width"), [(1, 3), (2, 2), (3, 2)])
def test_sampled_tree_acceptance_emits_tokens_distributed_as_the_target_over_two_positions(depth, width):
    """Chi-square over the joint of the first two tokens emitted, a tree per step until two are out: the rule of
    SpecInfer / EAGLE-2 (sampled child, deterministic siblings, residuals) reproduces p(t1) p(t2 | t1)."""
    draws, start = 4000, 0
    tree_gen, accept_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        emitted: list[int] = []
        while len(emitted) < 2:
            last = emitted[-1] if emitted else start
            grown = _grow(last, [], [], depth, width, tree_gen)
            tree = DraftTree([b for b, _ in grown], [p for _, p in grown])
            branch, accepted, token = accept_tree(tree, _rows(last, tree.branches), False, accept_gen)
            emitted += [*tree.branches[branch][:accepted], token]
        counts[emitted[0], emitted[1]] += 1
    p1 = torch.softmax(TARGET[start], dim=-1)
    expected = (p1[:, None] * torch.softmax(TARGET, dim=-1)) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7  # 15 degrees of freedom, p = 0.001


def test_greedy_tree_acceptance_follows_the_targets_argmax_into_the_sibling_that_has_it():
    branches = [[1, 2, 3], [1, 0], [3, 3]]
    tree = DraftTree(branches, [[None] * len(b) for b in branches])
    rows = torch.zeros(sum(1 + len(b) for b in branches), VOCAB)
    starts = branch_row_starts(branches)
    for b, branch in enumerate(branches):  # the target wants 1, then 0, then 2 after [1, 0]
        rows[starts[b], 1] = 5.0
        if branch[0] == 1:
            rows[starts[b] + 1, 0] = 5.0
        if branch[:2] == [1, 0]:
            rows[starts[b] + 2, 2] = 5.0
    assert accept_tree(tree, rows, True, None) == (1, 2, 2)
    assert count_nodes(branches) == 6


# ---- the engine: tiny models, a draft that is a perturbed copy of the target ------------------------------------
@cache
def _near_draft(noise: float = 0.02) -> torch.nn.Module:
    """The tiny target with its weights nudged: its drafts are mostly right and its second choice often is where
    its first is not, so sibling branches get accepted."""
    draft = copy.deepcopy(tiny_model("llama"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return draft


def _tree(width: int = 2, max_nodes: int = 12, threshold: float = 1.0, k: int = 4, **sampling) -> SamplingParams:
    return SamplingParams(strategy={"speculative": {"proposer": "draft", "num_speculative_tokens": k, "tree": {
        "width": width, "max_nodes": max_nodes, "threshold": threshold}}}, **sampling)


def _no_blocks_held(llm: LLM) -> None:
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
    draft = llm.engine.components.get("proposers", "draft")
    assert draft.model.allocator.num_free_blocks == draft.model.allocator.num_blocks


@pytest.fixture(scope="module")
def tree_llm(llama, tokenizer):
    return LLM(llama, tokenizer, draft=_near_draft(), kv_cache_memory="16MiB", block_size=4)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
ROW_KINDS = [
    {},
    {"processors": [{"repetition_penalty": {"penalty": 1.3}}, {"presence_penalty": {"penalty": 0.5}}]},
    {"processors": [{"logit_bias": {"bias": {7: 3.0, 11: -5.0, 40: 2.5}}}]},
    {"processors": [{"json_schema": {"schema": SCHEMA}}]},
]


@pytest.mark.parametrize(("width", "max_nodes", "threshold"), [(2, 8, 1.0), (3, 16, 0.9), (4, 24, 0.95)])
def test_greedy_with_draft_trees_equals_plain_greedy_with_penalties_bias_and_json_rows_in_one_batch(
        tree_llm, width, max_nodes, threshold):
    prompts = random_prompts(8, 3, 30, seed=9)
    kinds = [ROW_KINDS[i % len(ROW_KINDS)] for i in range(len(prompts))]
    plain = tree_llm.generate(prompts, [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **kind)
                                        for kind in kinds])
    spec = tree_llm.generate(prompts, [_tree(width, max_nodes, threshold, max_tokens=20, temperature=0,
                                             ignore_eos=True, trace=1, **kind) for kind in kinds])
    assert [o.error for o in spec] == [None] * len(prompts)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    kept = [e["drafts"]["branch"] for o in spec for e in o.outputs[0].trace if "branch" in e.get("drafts", {})]
    assert kept and max(kept) > 0  # some steps kept a sibling branch, not the draft's own chain
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0
    _no_blocks_held(tree_llm)


def test_a_kept_sibling_branch_gives_the_logprobs_plain_greedy_gives(tree_llm):
    """The accepted branch's rows (not the tree's first branch's) are the ones its tokens' logprobs read."""
    prompts = random_prompts(6, 3, 30, seed=4)
    plain = tree_llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
    spec = tree_llm.generate(prompts, _tree(3, 16, 1.0, max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_sampled_tree_speculation_in_the_engine_reproduces_the_targets_first_two_tokens(llama, tokenizer):
    """Chi-square on the engine: top-3 sampling, a width-3 tree verifies the second token (every sibling drafted),
    against p(t1) p(t2 | t1) from the model's own forward."""
    llm = LLM(llama, tokenizer, draft=_near_draft(0.5), kv_cache_memory="16MiB", block_size=4, max_num_seqs=256)
    prompt, draws = [5, 77, 190, 23, 8], 1500
    params = [_tree(3, 8, 1.0, k=2, max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, seed=1000 + i)
              for i in range(draws)]
    outs = llm.generate([prompt] * draws, params)
    with torch.no_grad():
        first = llama(torch.tensor([prompt])).logits[0, -1].float()
        top1 = torch.topk(first, 3)
        p1 = torch.softmax(top1.values, dim=-1)
        cells, expected = {}, []
        for a, pa in zip(top1.indices.tolist(), p1.tolist()):
            second = llama(torch.tensor([[*prompt, a]])).logits[0, -1].float()
            top2 = torch.topk(second, 3)
            for b, pb in zip(top2.indices.tolist(), torch.softmax(top2.values, dim=-1).tolist()):
                cells[(a, b)] = len(expected)
                expected.append(pa * pb * draws)
    counts = torch.zeros(len(expected))
    for out in outs:
        assert out.error is None
        counts[cells[tuple(out.token_ids[:2])]] += 1
    assert sum(o.metrics.num_draft_tokens for o in outs) > draws  # trees were drafted and verified
    exp = torch.tensor(expected)
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert chi2 < 26.1  # 8 degrees of freedom, p = 0.001
    _no_blocks_held(llm)


def test_a_tree_too_large_for_the_step_budget_is_verified_as_its_first_branch_and_stays_lossless(llama, tokenizer):
    llm = LLM(llama, tokenizer, draft=_near_draft(), kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=16)
    prompts = random_prompts(3, 3, 12, seed=2)
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _tree(4, 32, 1.0, k=5, max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    _no_blocks_held(llm)


def test_trees_under_preemption_stay_lossless_and_free_every_block(llama, tokenizer):
    llm = LLM(llama, tokenizer, draft=_near_draft(), kv_cache_memory="96KiB", block_size=4)
    prompts = random_prompts(8, 10, 20, seed=6)
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    spec = llm.generate(prompts, _tree(3, 16, 1.0, max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.error for o in spec] == [None] * len(prompts)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_preemptions for o in spec) > 0
    _no_blocks_held(llm)


def test_a_tree_is_refused_with_a_proposer_that_cannot_draft_one(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB")
    params = SamplingParams(max_tokens=4, strategy={"speculative": {"proposer": "ngram", "tree": {"width": 2}}})
    out = llm.generate([[5, 6, 7, 5, 6]] * 2, [params, SamplingParams(max_tokens=4)])
    assert "strategy.speculative.tree: proposer 'ngram' cannot draft a tree" in out[0].error
    assert out[1].error is None and len(out[1].token_ids) == 4


def test_bad_tree_options_are_refused_naming_the_field(llama, tokenizer):
    llm = LLM(llama, tokenizer, draft=_near_draft(), kv_cache_memory="16MiB")
    outs = llm.generate([[5, 6, 7]] * 2, [_tree(width=0, max_tokens=4), SamplingParams(max_tokens=4)])
    assert "width" in outs[0].error
    assert outs[1].error is None


@pytest.mark.parametrize("draft", ["near", "other"])
def test_the_proposer_kit_passes_the_draft_proposer_with_trees(draft):
    report = check_proposer("draft", draft=_near_draft() if draft == "near" else None,
                            strategy_options={"tree": {"width": 3, "max_nodes": 12, "threshold": 0.9}})
    assert report.draft_tokens > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), min_size=1, max_size=5),
       st.integers(0, 2**31 - 1))
def test_greedy_tree_acceptance_keeps_a_path_of_the_tree_at_least_as_long_as_its_first_branch_alone(branches, seed):
    """Whatever the tree and the target: the kept path is a prefix of the branch returned, each kept token is the
    target's argmax where it was verified, and a tree never accepts fewer tokens than its first branch would."""
    tree = DraftTree(branches, [[None] * len(b) for b in branches])
    rows = torch.randn(sum(1 + len(b) for b in branches), VOCAB, generator=torch.Generator().manual_seed(seed))
    starts = branch_row_starts(branches)
    for b, branch in enumerate(branches):  # one target: a position's row depends only on its history
        for j in range(1 + len(branch)):
            first = next(c for c, other in enumerate(branches) if other[:j] == branch[:j] and len(other) >= j)
            rows[starts[b] + j] = rows[starts[first] + j]
    kept, accepted, token = accept_tree(tree, rows, True, None)
    path = branches[kept][:accepted]
    assert all(int(rows[starts[kept] + j].argmax()) == t for j, t in enumerate(path))
    assert token == int(rows[starts[kept] + accepted].argmax())
    chain = 0
    while chain < len(branches[0]) and branches[0][chain] == int(rows[chain].argmax()):
        chain += 1
    assert accepted >= chain


def test_seeded_sampled_trees_with_stateful_processors_give_the_same_tokens_alone_and_batched(tree_llm):
    """Mirostat keeps per-position values while scoring and a JSON schema advances a matcher over each draft: every
    branch is scored with its own fork of the states, and a seeded request draws the same tokens either way."""
    prompts = random_prompts(4, 3, 20, seed=21)
    kinds = [{"processors": [{"mirostat": {"tau": 3.0, "eta": 0.2}}]},
             {"processors": [{"json_schema": {"schema": SCHEMA}}]},
             {"processors": [{"repetition_penalty": {"penalty": 1.2}}], "top_k": 20}, {}]
    params = [_tree(3, 12, 1.0, max_tokens=14, temperature=0.9, seed=70 + i, ignore_eos=True, **kind)
              for i, kind in enumerate(kinds)]
    batched = tree_llm.generate(prompts, params)
    alone = [tree_llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert [o.error for o in batched] == [None] * len(prompts)
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]
    assert sum(o.metrics.num_draft_tokens for o in batched) > 0
    _no_blocks_held(tree_llm)


def test_with_k_adapted_by_cost_a_tree_is_drafted_only_where_its_rows_are_nearly_free(tree_llm):
    # the default curve charges each row a sixteenth of a step: a branch is never within 5% of the step, so a seeded
    # request (whose choices read the curve alone) drafts the same chains with or without `tree`
    prompts = random_prompts(1, 8, 30, seed=3)
    sampled = {"max_tokens": 20, "temperature": 0.8, "seed": 5, "ignore_eos": True, "trace": 1}
    chain = {"proposer": "draft", "cost_model": "default"}
    tree = {**chain, "tree": {"width": 2, "max_nodes": 12, "threshold": 1.0}}
    (plain_chain,) = tree_llm.generate(prompts, SamplingParams(**sampled, strategy={"speculative": chain}))
    (gated,) = tree_llm.generate(prompts, SamplingParams(**sampled, strategy={"speculative": tree}))
    assert gated.error is None and gated.token_ids == plain_chain.token_ids
    assert gated.metrics.num_draft_tokens > 0
    assert not [e for e in gated.outputs[0].trace if "tree_branches" in e.get("drafts", {})]
    _no_blocks_held(tree_llm)
