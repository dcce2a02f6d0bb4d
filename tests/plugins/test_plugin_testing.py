"""The ready-made parts of `decodekit.testing` for a plugin's own tests (a tiny `LLM` with the plugin registered,
named processors run on logits), and the engine seeding the forks of a seeded request when a plugin strategy does
not: a strategy that forks and samples gives the same tokens alone and batched."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from pydantic import BaseModel

from decodekit import SamplingParams, hookimpl, select_tokens
from decodekit.api.params import ComponentSpec
from decodekit.api.sequence import Sequence
from decodekit.api.strategy import StepContext, Strategy
from decodekit.core.plan import PlanError
from decodekit.core.step_context import fork_seed
from decodekit.testing import TINY_VOCAB_SIZE, apply_processors, tiny_llm


class ForkingSampler(Strategy):
    """A plugin strategy that forks every request into `n` samples at its first token and never seeds them."""

    name = "forking_sampler"
    scores = "logits"

    def num_sequences(self, options: BaseModel | None, params: SamplingParams) -> int:
        return params.n

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows, targets = [], []
        for i, seq in enumerate(seqs):
            rows.append(i)
            targets.append(seq)
            if seq.num_generated == 0 and len(seq.request.sequences) == 1:
                for _ in range(1, seq.request.params.n):
                    rows.append(i)
                    targets.append(ctx.fork(seq))  # no seed: the engine's to give
        logits = logits[torch.tensor(rows)]
        tokens = select_tokens(logits, [s.greedy for s in targets], [s.generator for s in targets]).tolist()
        for seq, token in zip(targets, tokens):
            ctx.append_token(seq, token)


@hookimpl
def decodekit_register_strategies(register: Callable[..., None]) -> None:
    register(ForkingSampler.name, ForkingSampler)


forking_plugin = types.ModuleType("forking_plugin")
forking_plugin.decodekit_register_strategies = decodekit_register_strategies  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def forking_llm():
    return tiny_llm(forking_plugin)


def _forked(seed: int | None) -> SamplingParams:
    return SamplingParams(n=3, seed=seed, temperature=1.0, max_tokens=12, ignore_eos=True,
                          strategy=ComponentSpec(name="forking_sampler"))


def test_a_plugin_strategys_unseeded_forks_of_a_seeded_request_are_the_same_alone_and_batched(forking_llm):
    prompt = [5, 17, 42, 9]
    alone = forking_llm.generate([prompt], _forked(7))[0]
    others = [[3 + i, 40 + i, 80 + i] for i in range(4)]
    plain = SamplingParams(temperature=1.0, max_tokens=12)
    batched = forking_llm.generate([*others[:2], prompt, *others[2:]],
                                   [plain, plain, _forked(7), _forked(11), _forked(11)])[2]
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 3, "each fork draws its own samples"
    again = forking_llm.generate([prompt], _forked(7))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in alone.outputs]


def test_fork_seeds_depend_only_on_the_request_seed_and_the_fork_number():
    assert fork_seed(7, 1) == fork_seed(7, 1)
    seeds = {fork_seed(s, k) for s in range(20) for k in range(1, 20)}
    assert len(seeds) == 20 * 19 and all(0 <= s < 2**64 for s in seeds)
    torch.Generator().manual_seed(max(seeds))  # every derived seed is one torch takes


def test_apply_processors_runs_named_and_implied_processors_like_the_engine():
    logits = torch.randn(3, TINY_VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    histories = [[1, 5, 6, 6], [1, 7], [1, 8, 9]]
    out = apply_processors(logits, SamplingParams(temperature=0.5, top_k=4), histories)
    kept = out > -float("inf")
    assert kept.sum(dim=-1).tolist() == [4, 4, 4]
    torch.testing.assert_close(out[kept], (logits / 0.5)[kept])
    assert torch.equal(kept, logits.topk(4).indices.new_zeros(kept.shape, dtype=torch.bool).scatter(
        1, logits.topk(4).indices, True))

    penalized = apply_processors(logits, SamplingParams(processors=[{"repetition_penalty": {"penalty": 2.0}}]),
                                 histories, prompt_lens=[1, 1, 1])
    for row, history in enumerate(histories):  # transformers' semantics: every id in the context, prompt included
        for token in set(history):
            value = logits[row, token]
            assert penalized[row, token] == (value / 2 if value > 0 else value * 2)
        untouched = torch.ones(TINY_VOCAB_SIZE, dtype=torch.bool)
        untouched[history] = False
        assert torch.equal(penalized[row, untouched], logits[row, untouched])


def test_apply_processors_refuses_a_bad_parameter_naming_the_key():
    with pytest.raises(PlanError, match=r"processors\[0\]\.repetition_penalty\.penalty"):
        apply_processors(torch.zeros(1, TINY_VOCAB_SIZE), SamplingParams(
            processors=[{"repetition_penalty": {"penalty": -1.0}}]), [[1, 2]])


def test_tiny_llm_runs_a_plugin_that_is_not_installed(forking_llm):
    out = forking_llm.generate([[5, 6, 7]], _forked(None))[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 12 for c in out.outputs)
    assert "forking_sampler" in forking_llm.engine.components.registry.strategies
