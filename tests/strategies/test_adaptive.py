"""Adaptive speculation: the draft-length chooser's decisions, the step cost curve, and lossless decoding with it."""

from __future__ import annotations

import itertools
import json
import time
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams, hookimpl
from decodekit.api.proposer import Proposer
from decodekit.api.step_cost import StepCost
from decodekit.testing import check_proposer, plugin_manager
from decodekit_plugins import speculative
from decodekit_plugins.adaptive import (
    ACCEPTANCE,
    PROBE_INTERVAL,
    PROBE_TOKENS,
    SHADOW_GAP,
    Acceptance,
    Shadow,
    choose_draft_lengths,
    draft_lengths,
    expected_tokens,
)
from decodekit_plugins.cost_model import REALIZED_MIN_STEPS, VETO_BELOW
from tests.helpers.reference import random_prompts
from tests.helpers.step_costs import NEARLY_FREE, PROPORTIONAL, bare_sequences

rates = st.floats(0.0, 0.99)
batches = st.lists(rates, min_size=1, max_size=40)


def throughput(ks: list[int], rates: list[float], cost: StepCost, other_rows: int = 0) -> float:
    tokens = other_rows + sum(expected_tokens(a, k) for a, k in zip(rates, ks))
    return tokens / cost(len(ks) + other_rows + sum(ks))


@given(rate=rates, k=st.integers(0, 12))
def test_expected_tokens_is_the_geometric_sum(rate, k):
    assert expected_tokens(rate, k) == pytest.approx((1 - rate ** (k + 1)) / (1 - rate))


@settings(max_examples=200, deadline=None)
@given(batch=batches, limit=st.integers(1, 10), other=st.integers(0, 8))
def test_nothing_is_drafted_when_each_row_costs_its_share(batch, limit, other):
    assert choose_draft_lengths(batch, [limit] * len(batch), other, PROPORTIONAL) == [0] * len(batch)


def test_a_compute_bound_batch_of_32_turns_speculation_off_and_a_lone_request_keeps_it():
    # a step that costs a fixed part plus a row's share, the rows dominating at 32 sequences
    cost = StepCost((1, 8, 32, 64, 128, 256), (1.0, 1.1, 3.0, 6.0, 12.0, 24.0))
    assert choose_draft_lengths([0.6] * 32, [8] * 32, 0, cost) == [0] * 32
    assert choose_draft_lengths([0.6], [8], 0, cost)[0] > 0


@settings(max_examples=200, deadline=None)
@given(batch=st.lists(st.floats(0.5, 0.99), min_size=1, max_size=8), limit=st.integers(1, 10))
def test_every_sequence_drafts_when_rows_are_nearly_free_and_acceptance_is_high(batch, limit):
    assert all(k > 0 for k in choose_draft_lengths(batch, [limit] * len(batch), 0, NEARLY_FREE))


curves = st.lists(st.floats(0.01, 10.0), min_size=2, max_size=6).map(
    lambda ys: StepCost(tuple(2**i for i in range(len(ys))), tuple(itertools.accumulate(ys))))


@settings(max_examples=300, deadline=None)
@given(batch=batches, index=st.integers(0, 39), higher=rates, cost=curves, limit=st.integers(1, 8))
def test_a_sequence_never_drafts_less_when_its_acceptance_rises(batch, index, higher, cost, limit):
    index %= len(batch)
    lower = min(batch[index], higher)
    before, after = list(batch), list(batch)
    before[index], after[index] = lower, max(batch[index], higher)
    limits = [limit] * len(batch)
    assert choose_draft_lengths(after, limits, 0, cost)[index] >= choose_draft_lengths(before, limits, 0, cost)[index]


@settings(max_examples=200, deadline=None)
@given(batch=st.lists(rates, min_size=1, max_size=3), limit=st.integers(1, 4), cost=curves, other=st.integers(0, 4))
def test_the_chooser_finds_the_best_lengths_of_a_brute_force_search(batch, limit, cost, other):
    chosen = choose_draft_lengths(batch, [limit] * len(batch), other, cost)
    best = max(throughput(list(ks), batch, cost, other)
               for ks in itertools.product(range(limit + 1), repeat=len(batch)))
    assert throughput(chosen, batch, cost, other) == pytest.approx(best, rel=1e-9)


def test_a_draft_models_cost_shortens_the_drafts():
    free = choose_draft_lengths([0.8], [10], 0, NEARLY_FREE)[0]
    costly = choose_draft_lengths([0.8], [10], 0, NEARLY_FREE, draft=StepCost((1, 256), (0.3, 0.3)))[0]
    assert 0 < costly < free


def test_acceptance_follows_what_the_target_accepts():
    state = Acceptance()
    for _ in range(30):
        state.record(4, 4)
    assert state.rate > 0.95
    for _ in range(30):
        state.record(4, 0)
    assert state.rate < 0.05
    state.record(0, 0)  # nothing drafted: nothing learned
    assert state.rate < 0.05


@settings(max_examples=200, deadline=None)
@given(draft=st.lists(st.integers(0, 3), min_size=1, max_size=6), produced=st.lists(st.integers(0, 3), max_size=8),
       start=st.integers(0, 3))
def test_a_shadow_draft_counts_what_a_greedy_verification_would_accept_once_the_tokens_decide_it(draft, produced,
                                                                                                  start):
    outcome = Shadow(start, draft, "ngram").outcome([9] * start + produced)
    compared = produced[: len(draft)]
    matched = next((j for j, (a, b) in enumerate(zip(draft, compared)) if a != b), len(compared))
    if matched == len(compared) < len(draft):  # every token so far agrees, and more were proposed: undecided
        assert outcome is None
    else:  # verification accepts the draft's first tokens equal to the target's, up to the first that is not
        assert outcome == (len(draft), matched)


def test_a_sequence_measured_by_shadow_drafts_spends_no_rows_on_probes():
    (seq,) = bare_sequences(1, temperature=0)
    seq.stash[ACCEPTANCE] = Acceptance(accepted=0.1, rejected=0.9, shadowed=True)
    assert not any(draft_lengths([seq], [8], 0, PROPORTIONAL, None)[0] for _ in range(4 * PROBE_INTERVAL))


def test_a_sequence_kept_from_drafting_probes_again_and_can_turn_back_on():
    (seq,) = bare_sequences(1, temperature=0)
    seq_lengths = [draft_lengths([seq], [8], 0, PROPORTIONAL, None)[0] for _ in range(PROBE_INTERVAL)]
    assert seq_lengths == [0] * (PROBE_INTERVAL - 1) + [PROBE_TOKENS]
    assert draft_lengths([seq], [8], 0, NEARLY_FREE, None)[0] > 0  # rows got cheap (the batch shrank): back on


def test_a_seeded_sampled_sequence_chooses_as_if_alone():
    seeded = bare_sequences(1, temperature=0.8, seed=5)
    crowd = bare_sequences(31, temperature=0)
    cost = StepCost((1, 8, 32, 64, 128, 256), (1.0, 1.1, 3.0, 6.0, 12.0, 24.0))
    alone = draft_lengths(bare_sequences(1, temperature=0.8, seed=5), [8], 0, cost, None)
    batched = draft_lengths([*seeded, *crowd], [8] * 32, 0, cost, None)
    assert batched[0] == alone[0] > 0 and batched[1:] == [0] * 31


def test_step_cost_interpolates_and_never_falls_with_more_rows():
    cost = StepCost((1, 4, 16), (2.0, 1.0, 3.0))  # a disturbed first timing
    assert cost(1) == cost(4) == 1.0 and cost(10) == pytest.approx(2.0) and cost(32) == pytest.approx(3.0 + 16 / 6)
    with pytest.raises(ValueError, match="increasing"):
        StepCost((4, 2), (1.0, 2.0))
    with pytest.raises(ValueError, match="as many"):
        StepCost((1, 2), (1.0,))


def test_the_step_cost_is_measured_once_per_machine_and_read_from_the_cache(llama, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    cost = llm.engine.components.info.step_cost(None)
    assert cost is not None and cost.rows[0] == 1 and len(cost.rows) > 3
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks  # scratch blocks freed
    (cached,) = (tmp_path / "step_cost").iterdir()
    assert json.loads(cached.read_text())["rows"] == list(cost.rows)
    cached.write_text(json.dumps({"rows": [1, 2], "seconds": [0.5, 0.75]}))  # what a second engine finds
    again = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    assert again.engine.components.info.step_cost(None) == StepCost((1, 2), (0.5, 0.75))
    cached.write_text("{not json")  # a broken cache is measured again
    third = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    assert third.engine.components.info.step_cost(None).rows == cost.rows


@pytest.mark.parametrize("cost_model", ["default", "measured"])
def test_adaptive_speculation_is_lossless_alone_and_batched(llama, tokenizer, cost_model):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = [(p * 4)[:28] for p in random_prompts(6, 4, 9, seed=2)]
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = llm.generate(prompts, SamplingParams(**greedy))
    strategy = {"speculative": {"proposer": "suffix", "cost_model": cost_model}}
    spec = llm.generate(prompts, SamplingParams(**greedy, strategy=strategy))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


@pytest.mark.parametrize(("proposer", "cost_model"), [("ngram", "measured"), ("suffix", "measured"),
                                                      ("draft", "default")])
def test_every_lookup_and_model_proposer_passes_its_kit_with_adaptation_on(proposer, cost_model):
    # the kit's draft model is as big as its target: measured, drafting with it cannot pay and is rightly off
    report = check_proposer(proposer, num_speculative_tokens=None, strategy_options={"cost_model": cost_model})
    assert report.draft_tokens > 0


@pytest.mark.parametrize(("strategy", "error"), [
    ({"adaptive": "cost", "num_speculative_tokens": 4}, "num_speculative_tokens fixes k"),
    ({"adaptive": "sometimes"}, "strategy.speculative.adaptive"),
    ({"cost_model": "guess"}, "strategy.speculative.cost_model"),
])
def test_bad_adaptation_options_fail_their_request_alone(llama, tokenizer, strategy, error):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    bad, good = llm.generate([[5, 6, 7, 5, 6, 7]] * 2, [
        SamplingParams(max_tokens=4, strategy={"speculative": {"proposer": "ngram", **strategy}}),
        SamplingParams(max_tokens=4, temperature=0, strategy={"speculative": {"proposer": "ngram"}})])
    assert bad.error is not None and error in bad.error
    assert good.error is None and len(good.token_ids) == 4


class Oracle(Proposer):
    """Drafts what plain greedy decoding will write (known in advance, as a cache of earlier answers would), slowed
    by `delay` seconds per call: a proposer whose every draft is accepted, with a host cost we choose."""

    name = "oracle"
    answers: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    delay = 0.0
    calls = 0

    def propose(self, ctx, seqs, ks, options):
        type(self).calls += 1
        time.sleep(self.delay)
        drafts = []
        for seq, k in zip(seqs, ks):
            answer = self.answers[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            drafts.append(answer[seq.num_generated : seq.num_generated + k])
        return drafts, [None] * len(seqs)


class OraclePlugin:
    @hookimpl
    def decodekit_register_proposers(self, register):
        register(Oracle.name, Oracle)


@pytest.mark.parametrize(("delay", "on"), [(0.0, True), (0.6, False)])
def test_a_proposer_whose_host_time_costs_more_than_it_saves_is_switched_off(llama, tokenizer, delay, on):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager(OraclePlugin()))
    prompt = random_prompts(1, 6, 7, seed=4)[0]
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    (plain,) = llm.generate([prompt], SamplingParams(**greedy))
    Oracle.answers, Oracle.delay, Oracle.calls = {tuple(prompt): plain.token_ids}, delay, 0
    strategy = {"speculative": {"proposer": "oracle", "max_speculative_tokens": 2}}
    (spec,) = llm.generate([prompt], SamplingParams(**greedy, strategy=strategy))
    assert spec.token_ids == plain.token_ids
    strategy = llm.engine.components.get("strategies", "speculative")
    charged = strategy.host_costs["oracle"].per_sequence.value
    if on:  # charged what it costs; whether drafting then pays is this machine's steps' to say (a loaded machine's
        # multi-row steps can cost many single-row ones), so only the charge is checked here
        assert charged is not None and charged < 0.05
    else:  # the first call (not charged: it may build tables), one measured call, then at most one probe
        assert charged is not None and charged >= 0.3
        assert Oracle.calls <= 3 and spec.metrics.num_accepted_tokens <= 6
    assert any(c.corrections for c in strategy.calibrations.values())  # the engine's step timings reached it


def test_seeded_sampling_with_the_online_cost_model_is_the_same_alone_and_batched(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    prompts = [(p * 4)[:28] for p in random_prompts(5, 4, 9, seed=6)]
    strategy = {"speculative": {"proposer": "suffix"}}
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True, strategy=strategy)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, strategy=strategy)
    (alone,) = llm.generate(prompts[:1], seeded)
    batched = llm.generate(prompts, [seeded] + [greedy] * 4)
    assert batched[0].token_ids == alone.token_ids
    plain = llm.generate(prompts[1:], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in batched[1:]] == [o.token_ids for o in plain]


def test_the_engine_times_decode_steps_for_the_strategies(llama, tokenizer):
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4)
    strategy = llm.engine.components.get("strategies", "speculative")
    seen = []
    original = strategy.select

    def record(ctx, seqs, logits):
        seen.append((ctx.step_timing, sum(s.num_scored_positions for s in seqs)))
        return original(ctx, seqs, logits)

    strategy.select = record
    prompts = [(p * 4)[:20] for p in random_prompts(2, 4, 9, seed=8)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                         strategy={"speculative": {"proposer": "ngram", "num_speculative_tokens": 3}}))
    assert seen and all(timing is not None and timing.seconds > 0 for timing, _ in seen)
    assert not seen[0][0].decode_only  # the prompts' step
    decode = [(timing, rows) for timing, rows in seen if timing.decode_only]
    assert decode and all(timing.rows == rows for timing, rows in decode)  # every computed row was scored


class Liar(Proposer):
    """A lookup that always answers and is always wrong (each draft token one past the target's): a chain's first
    link whose drafts would preempt its draft model's on every step, as suffix decoding's often-wrong chat drafts
    do, were lengths chosen by one rate for the whole chain."""

    name = "liar"
    answers: ClassVar[dict[tuple[int, ...], list[int]]] = {}

    def propose(self, ctx, seqs, ks, options):
        drafts = []
        for seq, k in zip(seqs, ks):
            answer = self.answers[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            drafts.append([(t + 1) % 64 for t in answer[seq.num_generated : seq.num_generated + k]])
        return drafts, [None] * len(seqs)


class CheapDraftModel(Oracle):
    """The oracle's drafts at a draft model's place in a chain: it says its forwards cost a twentieth of the
    target's (`draft_cost`), so the chooser charges it as a model link, whatever the test machine's speed."""

    name = "cheap_draft_model"

    def setup(self, info):
        self.info = info

    def draft_cost(self, measured):
        target = self.info.step_cost(None) if measured and self.info.step_cost is not None else None
        return (target or StepCost.default()).scaled(0.05)


class Turncoat(Proposer):
    """A lookup wrong (each draft token one past the target's) until the answer has `right_from` tokens, right from
    there on: a text that turns copyable mid-answer (an explanation, then a quoted passage)."""

    name = "turncoat"
    answers: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    right_from = 0

    def propose(self, ctx, seqs, ks, options):
        drafts = []
        for seq, k in zip(seqs, ks):
            answer = self.answers[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            draft = answer[seq.num_generated : seq.num_generated + k]
            drafts.append(draft if seq.num_generated >= self.right_from else [(t + 1) % 64 for t in draft])
        return drafts, [None] * len(seqs)


class LookupsPlugin:
    @hookimpl
    def decodekit_register_proposers(self, register):
        for proposer in (Liar, Oracle, CheapDraftModel, Turncoat):
            register(proposer.name, proposer)


def _choose_by_the_default_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the speculative strategy choose by the cost model alone (with `cost_model: default`, the default curve),
    not by this machine's step timings, which the suite's load moves: its timing hooks do nothing."""
    for timed in ("_calibrate", "_measure", "ran_natively", "_record_host_cost"):
        monkeypatch.setattr(speculative.SpeculativeStrategy, timed, lambda *args: None)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("lookup", "by"), [("liar", "cheap_draft_model"), ("oracle", "oracle")])
def test_a_chains_draft_comes_from_the_link_whose_own_acceptance_promises_most(llama, tokenizer, batch, lookup, by,
                                                                               monkeypatch):
    # a draft model whose every draft is accepted behind a free lookup: a lookup that is always wrong is soon passed
    # over for the model (it answers every step: one rate for the whole chain let it draft on and kept the model's
    # drafts short), one that is always right is kept and the model not run. By the default curve: under the suite's
    # load the measured steps once stopped the drafting after 6 tokens of the model (liar, batch 1)
    _choose_by_the_default_curve(monkeypatch)
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager(LookupsPlugin()))
    prompts = random_prompts(batch, 6, 7, seed=12)
    greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = llm.generate(prompts, SamplingParams(**greedy))
    answers = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    Liar.answers, Oracle.answers, Oracle.delay, CheapDraftModel.delay = answers, answers, 0.0, 0.0
    strategy = {"speculative": {"proposer": lookup, "fallback": "cheap_draft_model", "cost_model": "default"}}
    spec = llm.generate(prompts, SamplingParams(**greedy, strategy=strategy))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for out in spec:
        tokens = out.metrics.proposer_tokens
        # most of the 39 tokens after the first from the right link (31-33 by the default curve)
        assert tokens.get(by, {}).get("accepted", 0) >= 24, tokens
        if lookup == "liar":  # drafted until its own rate fell: a step or two, never most of them (1)
            assert tokens.get("liar", {}).get("steps", 0) <= 2, tokens
        else:
            assert "cheap_draft_model" not in tokens, tokens


def test_the_strategy_measures_what_its_speculating_steps_really_gave_against_plain_decoding(
        llama, tokenizer, monkeypatch):
    # every draft accepted and the proposer free; but each step that drafts stalls where no part of the cost model
    # looks (before the step's timed verification, outside the proposer's timed call): the measured steps say
    # drafting ran far slower than plain decoding, and that earns a veto (`RealizedGain`, unit-tested in
    # test_cost_model.py) unless the request ends or the cost model stops drafting first
    llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4, plugin_manager=plugin_manager(OraclePlugin()))
    prompt = random_prompts(1, 6, 7, seed=4)[0]
    greedy = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
    (plain,) = llm.generate([prompt], SamplingParams(**greedy))
    Oracle.answers, Oracle.delay, Oracle.calls = {tuple(prompt): plain.token_ids}, 0.0, 0
    speculative = llm.engine.components.get("strategies", "speculative")
    lengths = speculative._lengths

    def stalled(ctx, seqs):
        chosen = lengths(ctx, seqs)
        if any(chosen[0]):
            time.sleep(0.05)
        return chosen

    monkeypatch.setattr(speculative, "_lengths", stalled)
    strategy = {"speculative": {"proposer": "oracle", "max_speculative_tokens": 2}}
    (spec,) = llm.generate([prompt], SamplingParams(**greedy, strategy=strategy))
    assert spec.token_ids == plain.token_ids
    (gain,) = speculative.realized.values()
    measured = gain.vetoes * REALIZED_MIN_STEPS + gain.steps
    assert measured >= min(REALIZED_MIN_STEPS, Oracle.calls - 1) > 0, gain
    assert gain.plain_log_rate is not None, gain  # plain steps measured alike (exploration, native runs)
    assert gain.vetoes >= 1 or (gain.ratio or 1.0) < VETO_BELOW, gain  # a stalled step gives ~0.1x plain


@pytest.mark.parametrize("batch", [1, 4])
def test_a_text_that_turns_copyable_turns_speculation_back_on_by_shadow_drafts(llama, tokenizer, batch, monkeypatch):
    # wrong drafts switch speculation off; from token 64 the lookup is right. Shadow drafts (asked while a sequence
    # drafts nothing, compared with the tokens the target then gives) measure that without a verified row, and
    # speculation turns back on within a few tokens; with shadows off (a gap longer than the answer) only probes can
    # find it, and after the wrong ones found nothing they wait twice as long each time
    prompts = random_prompts(batch, 6, 7, seed=12)
    greedy = {"max_tokens": 128, "temperature": 0, "ignore_eos": True}
    strategy = {"speculative": {"proposer": "turncoat", "cost_model": "default"}}
    # probes alone found the copyable text at once in some runs and after ~100 tokens in others, by the step timings
    _choose_by_the_default_curve(monkeypatch)

    def accepted(shadows: bool) -> list[int]:
        monkeypatch.setattr(speculative, "SHADOW_GAP", SHADOW_GAP if shadows else 10**6)
        llm = LLM(llama, tokenizer, kv_cache_memory="16MiB", block_size=4,
                  plugin_manager=plugin_manager(LookupsPlugin()))  # a new engine: nothing measured before
        plain = llm.generate(prompts, SamplingParams(**greedy))
        Turncoat.answers, Turncoat.right_from = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}, 64
        spec = llm.generate(prompts, SamplingParams(**greedy, strategy=strategy))
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        return [o.metrics.proposer_tokens.get("turncoat", {}).get("accepted", 0) for o in spec]

    with_shadows = accepted(True)
    # most of the 64 tokens from token 64 on (52 at batch 1, 50 each at batch 4, by the default curve), and more
    # than probes alone find (6; 3-8)
    assert all(n >= 32 for n in with_shadows), with_shadows
    without = accepted(False)
    assert sum(without) < sum(with_shadows), (without, with_shadows)
