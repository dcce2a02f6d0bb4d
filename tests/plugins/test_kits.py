"""The kits for plugins that run inside the engine (`decodekit.testing`: `check_stopping_criterion`,
`check_proposer`, `check_strategy`): every shipped stopping criterion, proposer and strategy passes its kit (the
registry's lists, so a component added later is checked too), and deliberately broken ones are caught, each with
one `ConformanceError` saying what is wrong."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from decodekit import SamplingParams, StopDecision, StoppingCriterion, hookimpl
from decodekit.api.sequence import Sequence
from decodekit.api.strategy import StepContext
from decodekit.core.registry import Registry
from decodekit.testing import (
    ConformanceError,
    KitReport,
    check_proposer,
    check_stopping_criterion,
    check_strategy,
    plugin_manager,
)
from decodekit_plugins.speculative import DraftModelProposer, SpeculativeStrategy
from decodekit_plugins.strategies import SampleStrategy

REGISTRY = Registry.from_plugin_manager(plugin_manager())

# Per component: the kit's keyword arguments. Criteria get options that make them stop on the tiny model (the kit
# then checks where and how they stop); a component missing here is checked with the kit's defaults.
STOPPING: dict[str, dict[str, Any]] = {
    # EOS made likely (and suppressed for the first two tokens, so min_tokens is exercised too)
    "eos": {"params": {"min_tokens": 2, "processors": [{"logit_bias": {"bias": {"2": 100.0}}}]}},
    "stop_token_ids": {"params": {"stop_token_ids": list(range(3, 384, 7))}},
    "max_tokens": {"params": {"max_tokens": 10}},
    "stop_strings": {"params": {"stop": ["e", " t"], "include_stop_str_in_output": True}},
    "time_limit": {"options": {"seconds": 1e-9}},  # past at the first token: stops there every time
}
STRATEGIES: dict[str, dict[str, Any]] = {
    "beam_search": {"options": {"num_beams": 3, "num_return_sequences": 2},
                    "num_outputs": lambda options, params: options.num_return_sequences},
    "speculative": {"options": {"proposer": "ngram", "num_speculative_tokens": 3}, "lossless": True},
}
PROPOSERS: dict[str, dict[str, Any]] = {
    "ngram": {"options": {"prompt_lookup_max": 3}},
    "draft": {},  # the kit gives it a draft model of its own
}


@pytest.mark.parametrize("name", sorted(REGISTRY.stopping_criteria))
def test_every_shipped_stopping_criterion_passes_its_kit(name):
    kit = dict(STOPPING.get(name, {}))
    params = dict(kit.pop("params", {}))
    max_tokens = params.pop("max_tokens", 16)
    report = check_stopping_criterion(name, params=params, max_tokens=max_tokens, **kit)
    assert isinstance(report, KitReport) and report.requests > 0
    if name in STOPPING:  # its options are chosen so that it stops: the kit did check stops
        assert report.stops > 0, report
    assert report.accepted_tokens == report.draft_tokens  # under speculation the target drafts for itself


def _repeating_head(folder: Path) -> Path:
    """A draft head for the kits' tiny target that passes the hidden state through unchanged (fc = [0 | I], the
    layer's products zero): it drafts the last token again, which the tiny model's greedy loops sometimes accept."""
    from decodekit.models.draft_head import DraftHead, DraftHeadConfig, save_head
    from decodekit.models.tiny import tiny_model

    config = tiny_model("llama", seed=0).config
    head = DraftHead(DraftHeadConfig.for_target(config, config.vocab_size, target="kit"))
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.dim() == 2:
                parameter.zero_()
        head.fc.weight[:, config.hidden_size :] = torch.eye(config.hidden_size)
    path = folder / "repeating_head.safetensors"
    save_head(head, path)
    return path


@pytest.mark.parametrize("name", sorted(REGISTRY.proposers))
def test_every_shipped_proposer_passes_its_kit(name, tmp_path):
    kit = PROPOSERS.get(name, {})
    if name == "eagle":  # a draft head fitted to the kit's tiny target (the shipped one is the bundled model's)
        kit = {"options": {"head": str(_repeating_head(tmp_path))}}
    report = check_proposer(name, **kit)
    assert report.draft_tokens > 0 and 0 < report.accepted_tokens <= report.draft_tokens


@pytest.mark.parametrize("name", sorted(REGISTRY.strategies))
def test_every_shipped_strategy_passes_its_kit(name):
    report = check_strategy(name, **STRATEGIES.get(name, {}))
    assert report.requests > 0


# ---- broken stopping criteria -------------------------------------------------------------------------------------
class MutatesTokens(StoppingCriterion):
    """Rewrites the newest token while checking it."""

    name = "mutates_tokens"

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        if seq.token_ids[-1] % 3 == 0:
            seq.token_ids[-1] = 4
        return None


class CoinFlip(StoppingCriterion):
    """Stops at random (the global RNG)."""

    name = "coin_flip"

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        return StopDecision("stop", "coin") if random.random() < 0.3 else None


class CutsPastTheText(StoppingCriterion):
    """Asks to cut the text beyond its end."""

    name = "cuts_past_the_text"

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        return StopDecision("stop", "x", len(seq.text) + 5) if seq.num_generated >= 3 else None


class CountsAcrossRequests(StoppingCriterion):
    """Stops every fifth call, whichever sequence it is: one request's stop depends on the others'."""

    name = "counts_across_requests"

    def __init__(self) -> None:
        self.calls = 0

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        self.calls += 1
        return StopDecision("stop", "count") if self.calls % 5 == 0 else None


@pytest.mark.parametrize(("criterion", "message"), [
    (MutatesTokens, r"stopping criterion 'mutates_tokens' changed the sequence it was checking \(token_ids"),
    (CoinFlip, r"stopping criterion 'coin_flip' is not deterministic: two replays of the same tokens got different "
               r"decisions"),
    (CutsPastTheText(), r"stopping criterion 'cuts_past_the_text' returned a truncate_text_at outside the text"),
    (CountsAcrossRequests, r"stopping criterion 'counts_across_requests' is not deterministic"),
])
def test_a_broken_stopping_criterion_is_caught(criterion, message):
    with pytest.raises(ConformanceError, match=message):
        check_stopping_criterion(criterion, max_tokens=12)


# ---- broken proposers and a lossy speculative strategy ------------------------------------------------------------
class GlobalRngDraft(DraftModelProposer):
    """The draft-model proposer sampling its drafts from the global RNG instead of each request's generator: the
    acceptance rule keeps the output distribution right, but a seeded request's tokens depend on what else ran."""

    name = "global_rng_draft"

    def propose(self, ctx: StepContext, seqs: list[Sequence], ks: list[int],
                options: list[Any]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        generators = [seq.generator for seq in seqs]
        for seq in seqs:
            seq.generator = None
        try:
            return super().propose(ctx, seqs, ks, options)
        finally:
            for seq, generator in zip(seqs, generators):
                seq.generator = generator


class KeepsDraftBlocks(DraftModelProposer):
    """The draft-model proposer, forgetting to release a finished sequence's blocks in its own model."""

    name = "keeps_draft_blocks"

    def release(self, seq: Sequence) -> None:
        pass


class BlindSpeculative(SpeculativeStrategy):
    """Speculative decoding that keeps every draft token without verifying it."""

    name = "blind_speculative"

    def check_compatible(self, options, params, stages) -> None:
        if params.n > 1:  # it keeps one sequence a request (the kit then skips its n > 1 kind)
            raise ValueError("blind_speculative runs one sequence a request")
        super().check_compatible(options, params, stages)

    def num_sequences(self, options, params) -> int:
        return 1

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        argmax = logits.argmax(dim=-1).tolist()
        offset = 0
        for seq in seqs:
            draft = list(seq.draft_token_ids)
            token = argmax[offset + len(draft)]
            offset += len(draft) + 1
            valid = len(seq.token_ids) + len(draft)
            ctx.accept_draft(seq, len(draft), token)
            for proposer in self.proposers.values():
                proposer.rollback(seq, valid)


# ---- broken strategies ---------------------------------------------------------------------------------------------
class ForgetsAFork(SampleStrategy):
    """Forks a look-ahead copy of each new sequence, then drops it without `ctx.free`: its blocks stay held."""

    name = "forgets_a_fork"

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for seq in seqs:
            if seq.num_generated == 0:
                probe = ctx.fork(seq)
                seq.request.sequences.remove(probe)
        super().select(ctx, seqs, logits)


class GlobalRngSample(SampleStrategy):
    """Samples from the global RNG, ignoring each sequence's seeded generator."""

    name = "global_rng_sample"

    def select(self, ctx: StepContext, seqs: list[Sequence], logits: torch.Tensor) -> None:
        probs = torch.softmax(logits.float(), dim=-1)
        for seq, row in zip(seqs, probs):
            ctx.append_token(seq, int(row.argmax()) if seq.greedy else int(torch.multinomial(row, 1)))


class Broken:
    """Registers every broken component above."""

    @hookimpl
    def decodekit_register_proposers(self, register: Callable[..., None]) -> None:
        register(GlobalRngDraft.name, GlobalRngDraft)
        register(KeepsDraftBlocks.name, KeepsDraftBlocks)

    @hookimpl
    def decodekit_register_strategies(self, register: Callable[..., None]) -> None:
        for strategy in (BlindSpeculative, ForgetsAFork, GlobalRngSample):
            register(strategy.name, strategy)


BROKEN = Broken()


def test_a_proposer_drafting_from_the_global_rng_is_caught():
    with pytest.raises(ConformanceError, match=r"proposer 'global_rng_draft' gives (a seeded sampled request "
                                               r"different tokens alone and batched|different tokens on a second "
                                               r"run)"):
        check_proposer("global_rng_draft", plugins=[BROKEN], draft="target")


def test_a_proposer_keeping_its_models_blocks_is_caught():
    with pytest.raises(ConformanceError, match=r"proposer 'keeps_draft_blocks' did not free every KV block: \d+ of "
                                               r"the proposer's own model's \(#0\)"):
        check_proposer("keeps_draft_blocks", plugins=[BROKEN])


def test_a_strategy_keeping_drafts_without_verifying_them_is_caught():
    with pytest.raises(ConformanceError, match=r"proposer 'ngram' is not lossless: speculative greedy decoding "
                                               r"\(blind_speculative\) gives other tokens than plain greedy"):
        check_proposer("ngram", plugins=[BROKEN], strategy="blind_speculative")
    with pytest.raises(ConformanceError, match=r"strategy 'blind_speculative' is not lossless"):
        # k fixed: adapted by cost, the blind k would also differ alone and batched, and be caught for that first
        check_strategy("blind_speculative", {"num_speculative_tokens": 4}, plugins=[BROKEN], lossless=True)


def test_a_strategy_forking_without_freeing_is_caught():
    with pytest.raises(ConformanceError, match=r"strategy 'forgets_a_fork' did not free every KV block: \d+ of the "
                                               r"engine's"):
        check_strategy("forgets_a_fork", plugins=[BROKEN])


def test_a_strategy_sampling_from_the_global_rng_is_caught():
    with pytest.raises(ConformanceError, match=r"strategy 'global_rng_sample' (is not deterministic|gives different "
                                               r"outputs batched than alone)"):
        check_strategy("global_rng_sample", plugins=[BROKEN], params=[{"temperature": 0.8, "seed": 7}])


def test_a_strategy_breaking_its_promise_of_n_outputs_is_caught():
    with pytest.raises(ConformanceError, match=r"strategy 'global_rng_sample' returned another number of outputs "
                                               r"than promised: .* 1 outputs, expected 2"):
        check_strategy("global_rng_sample", plugins=[BROKEN], params=[{"temperature": 0.0, "n": 2}])


def test_a_component_given_as_a_class_or_instance_is_registered_by_the_kit():
    report = check_strategy(type("renamed_sample", (SampleStrategy,), {"name": "renamed_sample"}),
                            params=[{"temperature": 0.0}])
    assert report.requests > 0
    with pytest.raises(ConformanceError, match="refused every kind of request"):
        check_strategy("contrastive_search", params=[{"temperature": 0.8, "seed": 1, "n": 2}])
