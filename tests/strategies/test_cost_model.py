"""The online cost model of adaptive speculation: calibration by measured steps, proposers' host time, the chooser's
off-switch against plain decoding's predicted rate, exploration, probing and the tree gate."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import decodekit_plugins.adaptive as adaptive
from decodekit.api.draft_tree import TreeShape
from decodekit.api.step_cost import StepCost
from decodekit_plugins.adaptive import (
    ACCEPTANCE,
    HOLD_STEPS,
    HOPEFUL_RATE,
    MAX_PROBE_INTERVAL,
    MIN_GAIN,
    PROBE_INTERVAL,
    PROBE_SHARE,
    PROBE_TOKENS,
    Acceptance,
    OffSwitch,
    choose_draft_lengths,
    draft_lengths,
    expected_tokens,
    lengths_by_answer,
    tree_rows,
    tree_shape,
    worst_tree_rows,
)
from decodekit_plugins.cost_model import (
    MAX_VETO_STEPS,
    REALIZED_MIN_STEPS,
    STALE_AFTER,
    VETO_STEPS,
    Calibration,
    ChainCharge,
    ProposerCost,
    RealizedGain,
    bucket,
    draft_forwards,
    expected_cost,
)
from tests.helpers.step_costs import NEARLY_FREE, PROPORTIONAL, bare_sequences

curves = st.lists(st.floats(0.01, 10.0), min_size=2, max_size=6).map(
    lambda ys: StepCost(tuple(2**i for i in range(len(ys))), tuple(itertools.accumulate(ys))))


def predicted_rate(ks: list[int], rates: list[float], hits: list[float], other: int, target, host: ChainCharge
                   ) -> float:
    """Expected tokens per second of a step with draft lengths `ks`, computed from the definitions (not the
    chooser's incremental sums): each drafting sequence pays its lookups, its expected rows, the draft forwards."""
    tokens = other + sum(1 + h * (expected_tokens(a, k) - 1) for a, k, h in zip(rates, ks, hits))
    rows = other + len(ks) + sum(h * k for k, h in zip(ks, hits))
    seconds = target(rows) + host.per_sequence * sum(1 for k in ks if k)
    if host.draft is not None:
        seconds += sum(expected_cost(host.draft, host.draft_reach * n) for n in draft_forwards(ks))
    return tokens / seconds


charges = st.builds(
    ChainCharge, per_sequence=st.floats(0.0, 2.0),
    draft=st.one_of(st.none(), curves), draft_reach=st.floats(0.0, 1.0))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), cost=curves, host=charges, other=st.integers(0, 6), limit=st.integers(1, 6),
       min_gain=st.sampled_from([0.0, MIN_GAIN, 0.3]))
def test_the_chooser_never_picks_a_configuration_predicted_slower_than_plain(data, cost, host, other, limit, min_gain):
    n = data.draw(st.integers(1, 12))
    rates = data.draw(st.lists(st.floats(0.0, 0.99), min_size=n, max_size=n))
    hits = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    chosen = choose_draft_lengths(rates, [limit] * n, other, cost, hits=hits, host=host, min_gain=min_gain)
    plain = predicted_rate([0] * n, rates, hits, other, cost, host)
    # drafting at all takes a predicted gain of at least `min_gain` over plain decoding
    assert predicted_rate(chosen, rates, hits, other, cost, host) >= plain * (1 + (min_gain if any(chosen) else 0)) \
        * (1 - 1e-9)
    assert all(0 <= k <= limit for k in chosen)


def test_a_measured_batch_drafts_only_where_the_predicted_gain_clears_the_margin():
    # each row costs 0.3 of a one-row step: a batch of 16 at acceptance 0.9 predicts 1.5%, below the margin
    # (a calibrated row bucket wanders by more than that); a lone sequence predicts far more
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.3))
    rates, limits = [0.9] * 16, [6] * 16
    plain = predicted_rate([0] * 16, rates, [1.0] * 16, 0, curve, ChainCharge())
    any_gain = choose_draft_lengths(rates, limits, 0, curve)
    gained = predicted_rate(any_gain, rates, [1.0] * 16, 0, curve, ChainCharge())
    assert any(any_gain) and plain < gained < plain * (1 + MIN_GAIN)
    seqs = bare_sequences(16, temperature=0)
    for seq in seqs:
        seq.stash[ACCEPTANCE] = Acceptance(accepted=0.9 * 50, rejected=0.1 * 50)
    calibrated = Calibration(curve)
    for rows in (1, 16, 64):
        calibrated.record(rows, curve(rows))
        calibrated.record(rows, curve(rows))
    assert draft_lengths(seqs, limits, 0, curve, None, calibrated) == [0] * 16
    assert draft_lengths(seqs[:1], limits[:1], 0, curve, None, calibrated)[0] > 0


@settings(max_examples=150, deadline=None)
@given(batch=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=3), limit=st.integers(1, 3), cost=curves,
       host=charges, other=st.integers(0, 3))
def test_the_charged_chooser_is_within_its_greedy_order_of_a_brute_force_search(batch, limit, cost, host, other):
    # with per-sequence charges the greedy order is a heuristic: it must still never lose to plain, and it is
    # exact when nothing is charged per sequence (the test in test_adaptive.py)
    hits = [1.0] * len(batch)
    chosen = choose_draft_lengths(batch, [limit] * len(batch), other, cost, hits=hits, host=host)
    best = max(predicted_rate(list(ks), batch, hits, other, cost, host)
               for ks in itertools.product(range(limit + 1), repeat=len(batch)))
    got = predicted_rate(chosen, batch, hits, other, cost, host)
    assert got >= predicted_rate([0] * len(batch), batch, hits, other, cost, host) * (1 - 1e-9)
    if host.per_sequence == 0 and host.draft is None:
        assert got == pytest.approx(best, rel=1e-9)


def test_a_proposer_whose_host_cost_is_high_is_switched_off_for_the_whole_batch():
    rates, limits = [0.8] * 8, [6] * 8
    assert all(choose_draft_lengths(rates, limits, 0, NEARLY_FREE, host=ChainCharge(per_sequence=0.001)))
    # each lookup costs half a step: no draft pays for it
    assert choose_draft_lengths(rates, limits, 0, NEARLY_FREE, host=ChainCharge(per_sequence=0.5)) == [0] * 8


def test_a_lookup_that_rarely_finds_a_draft_is_not_asked():
    rates, limits = [0.9] * 4, [6] * 4
    charge = ChainCharge(per_sequence=0.02)
    assert all(choose_draft_lengths(rates, limits, 0, NEARLY_FREE, hits=[1.0] * 4, host=charge))
    assert choose_draft_lengths(rates, limits, 0, NEARLY_FREE, hits=[0.01] * 4, host=charge) == [0] * 4


def test_calibration_converges_to_the_measured_cost_per_row_bucket():
    curve = StepCost((1, 8, 64), (1.0, 1.1, 2.0))  # in the default curve's unit, not seconds
    calibrated = Calibration(curve)
    rng = random.Random(0)

    def truth(rows: int) -> float:  # this machine: 10 ms a step, multi-row steps dearer than the curve's shape
        return 0.010 * curve(rows) * (1.0 if rows <= 4 else 2.5)

    for _ in range(60):
        for rows in (1, 3, 8, 24):
            calibrated.record(rows, truth(rows) * rng.uniform(0.9, 1.15))  # noisy, never much faster
    for rows in (1, 3, 8, 24):
        assert calibrated(rows) == pytest.approx(truth(rows), rel=0.15)
    assert calibrated.observed(24) and not calibrated.observed(100)
    assert calibrated(100) == pytest.approx(0.010 * curve(100) * 2.5, rel=0.15)  # the nearest bucket's correction


def test_a_correction_falls_fast_and_rises_slowly_as_disturbed_timings_are_only_ever_too_high():
    calibrated = Calibration(StepCost.default())
    for _ in range(5):
        calibrated.record(4, 0.02 * calibrated.curve(4))
    calibrated.record(4, 0.01 * calibrated.curve(4))
    after_fall = calibrated.correction(4)
    calibrated.record(4, 0.02 * calibrated.curve(4))
    assert after_fall < 0.02 * 0.8 and calibrated.correction(4) - after_fall < 0.02 - after_fall
    for _ in range(40):  # a lasting change wins
        calibrated.record(4, 0.05 * calibrated.curve(4))
    assert calibrated.correction(4) == pytest.approx(0.05, rel=0.05)


def test_one_disturbed_step_moves_a_correction_by_a_bounded_factor():
    calibrated = Calibration(StepCost.default())
    for _ in range(20):
        calibrated.record(4, 0.01 * calibrated.curve(4))
    calibrated.record(4, 100.0)  # a neighbour's burst
    assert calibrated.correction(4) < 0.01 * 1.5
    calibrated.record(32, 1e-9)  # a first measurement far from its neighbours starts near them
    assert calibrated.correction(32) >= 0.01 / 3.5


def test_an_unmeasured_bucket_is_interpolated_between_measured_ones():
    calibrated = Calibration(StepCost.default())
    calibrated.record(1, 2.0 * calibrated.curve(1))
    calibrated.record(16, 2.88 * calibrated.curve(16))
    assert calibrated.correction(4) == pytest.approx(2.4)  # halfway between buckets 0 and 4, in log rows
    assert Calibration(StepCost.default()).correction(4) == 1.0
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def test_a_proposer_cost_skips_its_first_call_and_learns_per_sequence_and_model_costs():
    lookup = ProposerCost()
    lookup.record(5.0, 4, 4, None)  # the first call builds tables: not its cost
    assert lookup.per_sequence.value is None
    for _ in range(30):
        lookup.record(0.004, 4, 1, None)
    assert lookup.per_sequence.value == pytest.approx(0.001, rel=0.01) and lookup.hit == pytest.approx(0.25, abs=0.01)
    model = ProposerCost()
    for _ in range(30):
        model.record(0.03, 2, 2, 0.01)
    assert model.model_factor.value == pytest.approx(3.0, rel=0.01)


def test_a_chain_charges_each_link_for_the_sequences_that_reach_it():
    ngram, suffix, draft = ProposerCost(), ProposerCost(), ProposerCost()
    ngram.per_sequence.add(0.001)
    ngram.hit = 0.5
    suffix.per_sequence.add(0.002)
    suffix.hit = 0.5
    draft.model_factor.add(2.0)
    curve = StepCost((1, 8), (0.01, 0.02))
    charge = ChainCharge.of([(ngram, None), (suffix, None), (draft, curve)])
    assert charge.per_sequence == pytest.approx(0.001 + 0.5 * 0.002)
    assert charge.draft_reach == pytest.approx(0.25) and charge.draft is not None
    assert charge.draft(8) == pytest.approx(0.04)


def test_a_batch_size_whose_plain_step_was_never_measured_runs_plain_to_measure_it():
    seqs = bare_sequences(4, temperature=0)
    calibrated = Calibration(NEARLY_FREE)
    assert draft_lengths(seqs, [6] * 4, 0, NEARLY_FREE, None, calibrated) == [0] * 4  # exploring
    calibrated.record(4, 0.01)
    assert draft_lengths(seqs, [6] * 4, 0, NEARLY_FREE, None, calibrated) == [0] * 4  # a second timing
    calibrated.record(4, 0.01)
    assert all(draft_lengths(seqs, [6] * 4, 0, NEARLY_FREE, None, calibrated))
    # a context that never reports timings stops exploring after its tries
    never = Calibration(NEARLY_FREE)
    tries = [draft_lengths(seqs, [6] * 4, 0, NEARLY_FREE, None, never) for _ in range(never.explore_tries + 1)]
    assert tries[:-1] == [[0] * 4] * never.explore_tries and all(tries[-1])


def test_a_plain_step_measured_long_ago_is_measured_again():
    calibrated = Calibration(NEARLY_FREE)
    calibrated.record(4, 0.01)
    calibrated.record(4, 0.01)
    assert not calibrated.explore(4)
    for _ in range(STALE_AFTER):
        calibrated.record(24, 0.02)  # speculating steps, never plain ones
    assert calibrated.explore(4)
    calibrated.record(4, 0.01)
    assert not calibrated.explore(4)


def test_a_compute_bound_batch_spends_no_rows_on_probes():
    seqs = bare_sequences(16, temperature=0)
    calibrated = Calibration(PROPORTIONAL)
    calibrated.record(16, 0.01)
    steps = [draft_lengths(seqs, [6] * 16, 0, PROPORTIONAL, None, calibrated) for _ in range(3 * PROBE_INTERVAL)]
    assert steps == [[0] * 16] * (3 * PROBE_INTERVAL)


def test_a_seeded_sequence_ignores_exploration_and_host_charges():
    (seeded,) = bare_sequences(1, temperature=0.8, seed=3)
    expensive = ChainCharge(per_sequence=100.0)
    alone = draft_lengths(bare_sequences(1, temperature=0.8, seed=3), [6], 0, NEARLY_FREE, None)
    batched = draft_lengths([seeded, *bare_sequences(3, temperature=0)], [6] * 4, 0, NEARLY_FREE, None,
                            Calibration(NEARLY_FREE), expensive)
    assert batched[0] == alone[0] > 0 and batched[1:] == [0] * 3


def test_probes_take_turns_and_back_off_while_speculation_stays_off():
    seqs = bare_sequences(16, temperature=0)
    for seq in seqs:  # a low acceptance: off, though one sequence's high one would pay (a row costs 0.02 of a step)
        seq.stash[ACCEPTANCE] = Acceptance(accepted=0.1, rejected=0.9)
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.02))
    calibrated = Calibration(curve)
    calibrated.record(16, 0.01)
    probes_per_step = []
    for _ in range(PROBE_INTERVAL + 4):
        lengths = draft_lengths(seqs, [6] * 16, 0, curve, None, calibrated)
        probes_per_step.append(sum(1 for k in lengths if k))
    assert max(probes_per_step) == 16 // PROBE_SHARE and sum(probes_per_step) == 16 // PROBE_SHARE * 5
    states = [s.stash[ACCEPTANCE] for s in seqs]
    probed = [state for state in states if state.idle_steps < PROBE_INTERVAL]
    assert len(probed) == 10 and all(state.probe_interval == 2 * PROBE_INTERVAL for state in probed)


def test_a_probe_that_could_not_change_the_batchs_choice_is_skipped_until_the_longest_interval():
    # each row costs 0.2 of a step: drafting would pay only if most of the 16 sequences accepted highly, so one
    # sequence's probe cannot turn anything on: it backs off as a probe that found nothing would, and runs only
    # once its interval has reached MAX_PROBE_INTERVAL (so a batch whose text turned copyable is still found)
    seqs = bare_sequences(16, temperature=0)
    for seq in seqs:
        seq.stash[ACCEPTANCE] = Acceptance(accepted=0.1, rejected=0.9)
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.2))
    calibrated = Calibration(curve)
    calibrated.record(16, 0.01)
    # not hopeless: were all 16 hopeful, drafting would pay (so the batch's own check lets probes through)
    assert any(choose_draft_lengths([HOPEFUL_RATE] * 16, [6] * 16, 0, calibrated, min_gain=MIN_GAIN))
    first_due = PROBE_INTERVAL + 2 * PROBE_INTERVAL + 4 * PROBE_INTERVAL + MAX_PROBE_INTERVAL
    probes = [sum(1 for k in draft_lengths(seqs, [6] * 16, 0, curve, None, calibrated) if k)
              for _ in range(first_due + 16)]
    assert not any(probes[:first_due - 1]) and 0 < sum(probes) <= 16
    assert all(seq.stash[ACCEPTANCE].probe_interval == MAX_PROBE_INTERVAL for seq in seqs)


def test_a_lone_sequence_still_probes_on_time_where_its_high_acceptance_would_pay():
    # batch 1: the probed sequence is the batch, so a probe that could pay runs after PROBE_INTERVAL idle steps
    (seq,) = bare_sequences(1, temperature=0)
    seq.stash[ACCEPTANCE] = Acceptance(accepted=0.1, rejected=0.9)
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.2))
    calibrated = Calibration(curve)
    calibrated.record(1, 0.01)
    calibrated.record(1, 0.01)
    lengths = [draft_lengths([seq], [6], 0, curve, None, calibrated)[0] for _ in range(PROBE_INTERVAL)]
    assert lengths == [0] * (PROBE_INTERVAL - 1) + [PROBE_TOKENS]


@pytest.mark.parametrize(("curve", "kept"), [(NEARLY_FREE, True), (PROPORTIONAL, False)])
def test_a_draft_tree_is_kept_only_where_its_rows_are_nearly_free(curve, kept):
    shape = TreeShape(width=2, max_nodes=16, threshold=0.8)
    k = 6
    extra = tree_rows(curve, 1 + k, worst_tree_rows(shape, k))
    gated = tree_shape(shape, k, extra)
    assert (gated is not None) is kept
    if gated is not None:
        assert gated.max_nodes == shape.max_nodes  # nearly free: the whole tree fits
        assert curve(1 + k + worst_tree_rows(gated, k)) <= 1.05 * curve(1 + k)


def test_a_tree_is_cut_to_the_branches_that_fit():
    shape = TreeShape(width=3, max_nodes=20, threshold=1.0)
    assert tree_shape(shape, 4, 12).max_nodes == 4 + 2  # two more branches of up to 5 rows
    assert tree_shape(shape, 4, 4) is None
    assert tree_shape(TreeShape(width=1), 4, 100) is None
    curve = StepCost((1, 16, 64), (1.0, 1.04, 4.0))
    assert tree_rows(curve, 1, 200) == 15 + int((1.05 - 1.04) / ((4.0 - 1.04) / 48))


def test_a_new_sequence_starts_from_its_chains_running_acceptance_unless_seeded():
    prior = Acceptance(decay=0.99)
    for _ in range(200):  # the chain's earlier sequences: a quarter of their draft tokens accepted, rarely a draft
        prior.record(4, 1)
        prior.record_ask(False)
    greedy, seeded = bare_sequences(1, temperature=0)[0], bare_sequences(1, temperature=0.8, seed=1)[0]
    draft_lengths([greedy, seeded], [6, 6], 0, NEARLY_FREE, None, Calibration(NEARLY_FREE), None, prior)
    assert greedy.stash[ACCEPTANCE].rate == pytest.approx(prior.rate) and greedy.stash[ACCEPTANCE].hit < 0.01
    assert seeded.stash[ACCEPTANCE].rate == pytest.approx(Acceptance().rate) and seeded.stash[ACCEPTANCE].hit == 1.0


def test_a_chains_high_running_acceptance_does_not_raise_a_new_sequences_start_above_the_fixed_prior():
    prior = Acceptance(decay=0.99)
    for _ in range(200):  # the chain's earlier sequences copied their prompts: every draft token accepted
        prior.record(6, 6)
        prior.record_ask(True)
    assert prior.rate > Acceptance().rate
    greedy = bare_sequences(1, temperature=0)[0]
    draft_lengths([greedy], [6], 0, NEARLY_FREE, None, Calibration(NEARLY_FREE), None, prior)
    assert greedy.stash[ACCEPTANCE].rate == pytest.approx(Acceptance().rate)
    assert greedy.stash[ACCEPTANCE].hit == pytest.approx(prior.hit)


def run_chooser(seqs, steps: int, curve: StepCost, off: OffSwitch | None) -> list[list[int]]:
    """`steps` steps of the chooser on `seqs` (none of them verified: what a switched-off batch sees)."""
    calibrated = Calibration(curve)
    for rows in (1, len(seqs)):
        calibrated.record(rows, curve(rows))
        calibrated.record(rows, curve(rows))
    return [draft_lengths(seqs, [6] * len(seqs), 0, curve, None, calibrated, off=off) for _ in range(steps)]


@settings(max_examples=30, deadline=None)
@given(rates=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=24),
       slope=st.sampled_from([0.0005, 0.05, 0.2, 1.0]))
def test_the_off_switch_changes_no_choice_and_no_probe(rates, slope):
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * slope))
    runs = []
    for off in (None, OffSwitch()):
        seqs = bare_sequences(len(rates), temperature=0)
        for seq, rate in zip(seqs, rates):
            seq.stash[ACCEPTANCE] = Acceptance(accepted=rate * 10, rejected=(1 - rate) * 10)
        runs.append(run_chooser(seqs, 3 * PROBE_INTERVAL, curve, off))
    assert runs[0] == runs[1]


def test_a_switched_off_batch_is_searched_once_per_hold_and_again_when_it_changes(monkeypatch):
    searches = []
    search = adaptive.choose_draft_lengths
    monkeypatch.setattr(adaptive, "choose_draft_lengths", lambda *a, **k: searches.append(len(a[0])) or search(*a, **k))
    seqs, off = bare_sequences(16, temperature=0), OffSwitch()
    for seq in seqs:  # a low acceptance on a compute-bound curve: nothing pays, nor would a probe
        seq.stash[ACCEPTANCE] = Acceptance(accepted=0.1, rejected=0.9)
    steps = 2 * HOLD_STEPS - 1
    assert steps < PROBE_INTERVAL  # no probe falls due (its check is one more search)
    assert run_chooser(seqs, steps, PROPORTIONAL, off) == [[0] * 16] * steps
    assert searches == [16, 16]
    run_chooser(seqs[1:], 1, PROPORTIONAL, off)  # a sequence left the batch: searched again (then its probe check)
    assert searches[:3] == [16, 16, 15]


def test_new_sequences_of_a_measured_batch_are_all_probed_on_their_first_step_then_wait_their_interval():
    # a batch of 8 on a curve where the prior's acceptance does not pay but a high one would (each row costs 0.2 of
    # a step): the new sequences probe together at once, not one a step after PROBE_INTERVAL idle steps
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.2))
    seqs = bare_sequences(8, temperature=0)
    steps = run_chooser(seqs, PROBE_INTERVAL, curve, OffSwitch())
    assert steps[0] == [PROBE_TOKENS] * 8
    assert all(not any(step) for step in steps[1:])  # nothing verified (a probe found nothing): the usual wait
    states = [seq.stash[ACCEPTANCE] for seq in seqs]
    assert not any(state.fresh for state in states) and all(s.probe_interval == PROBE_INTERVAL for s in states)


def test_new_sequences_of_a_compute_bound_batch_are_not_probed():
    seqs = bare_sequences(16, temperature=0)
    assert run_chooser(seqs, 4, PROPORTIONAL, OffSwitch()) == [[0] * 16] * 4
    assert all(seq.stash[ACCEPTANCE].fresh for seq in seqs)  # still unmeasured: probed once rows get cheap


def test_a_seeded_sequence_is_not_probed_early_for_being_new():
    (seeded,) = bare_sequences(1, temperature=0.8, seed=9)
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.2))
    alone = [draft_lengths([seeded], [6], 0, curve, None)[0] for _ in range(3)]
    (again,) = bare_sequences(1, temperature=0.8, seed=9)
    batched = run_chooser([again, *bare_sequences(7, temperature=0)], 3, curve, OffSwitch())
    assert [step[0] for step in batched] == alone


def test_a_draft_models_measured_cost_is_charged_by_the_rows_of_the_forward_not_one_factor_for_all():
    # lone sequences' calls cost 3x the curve (a forward's fixed Python), batches of 8 cost 1.2x: a batch of 8 is
    # charged its own factor, a lone sequence its own, and a size never measured the factor over all calls; each
    # size's first call (a new shape's kernels built) is left out of its own factor
    curve = StepCost((1, 8, 64), (0.004, 0.006, 0.04))
    cost = ProposerCost()
    cost.record(1.0, 1, 1, 1.0)  # the first call opens the model: not kept
    cost.record(50 * curve(8), 8, 8, curve(8))  # the first call of 8: not kept for 8 rows
    for _ in range(6):
        cost.record(3 * curve(1), 1, 1, curve(1))
        cost.record(1.2 * curve(8), 8, 8, curve(8))
    charge = ChainCharge.of([(cost, curve)])
    assert charge.draft is not None
    assert charge.draft(8) == pytest.approx(1.2 * curve(8), rel=0.02)
    assert charge.draft(1) == pytest.approx(3 * curve(1), rel=0.02)
    overall = cost.model_factor.value
    assert overall is not None and charge.draft(64) == pytest.approx(overall * curve(64))
    rows = np.array([1.0, 8.0, 64.0])
    assert charge.draft.many(rows) == pytest.approx([charge.draft(r) for r in rows])  # type: ignore[attr-defined]


def rate_with_reach(ks: list[int], rates: list[float], reach: list[float], other: int, target, draft) -> float:
    """Expected tokens per second of a step with draft lengths `ks`, from the definitions: each sequence adds
    `reach` of a row to each draft forward it drafts in (0: its lookup's draft is already there)."""
    tokens = other + sum(expected_tokens(a, k) for a, k in zip(rates, ks))
    seconds = target(other + len(ks) + sum(ks))
    if draft is not None:
        seconds += sum(expected_cost(draft, sum(r for k, r in zip(ks, reach) if k > j)) for j in range(max(ks)))
    return tokens / seconds


@settings(max_examples=200, deadline=None)
@given(data=st.data(), cost=curves, draft=curves, other=st.integers(0, 4), limit=st.integers(1, 5))
def test_a_sequence_whose_draft_is_in_hand_is_not_charged_the_draft_models_forwards(data, cost, draft, other, limit):
    n = data.draw(st.integers(1, 4))
    rates = data.draw(st.lists(st.floats(0.0, 0.99), min_size=n, max_size=n))
    reach = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    chosen = choose_draft_lengths(rates, [limit] * n, other, cost, host=ChainCharge(draft=draft), reach=reach)
    got = rate_with_reach(chosen, rates, reach, other, cost, draft)
    assert got >= rate_with_reach([0] * n, rates, reach, other, cost, draft) * (1 - 1e-9)
    if not any(reach):  # nobody runs the model: the chooser is exact, as with free drafts
        best = max(rate_with_reach(list(ks), rates, reach, other, cost, draft)
                   for ks in itertools.product(range(limit + 1), repeat=n))
        assert got == pytest.approx(best, rel=1e-9)


def test_a_lookups_draft_is_kept_only_where_its_own_rate_promises_as_much_as_the_draft_model():
    draft = StepCost((1, 256), (0.25, 0.3))  # a quarter of a nearly-free step per draft forward
    # a lookup answering at suffix decoding's chat rate is passed over for a draft model accepted 85% of the time;
    # one answering at 85% (free) is kept and cut to its own best length; without an answer the model drafts
    lengths, keep = lengths_by_answer([(0.15, 8), (0.85, 8), None], [0.85] * 3, [8] * 3, 0, NEARLY_FREE, draft)
    assert keep == [False, True, False]
    assert lengths[0] == lengths[2] >= 4 and lengths[1] >= lengths[0]
    # a model-free chain: an unanswered sequence drafts nothing, a kept draft is never longer than the lookup's
    lengths, keep = lengths_by_answer([None, (0.9, 3)], [0.0, 0.0], [8, 8], 0, NEARLY_FREE, None)
    assert keep == [False, True] and lengths[0] == 0 and 0 < lengths[1] <= 3
    # every row its share of the step: nothing pays, whichever link answered
    assert lengths_by_answer([(0.5, 8), None], [0.6] * 2, [8] * 2, 0, PROPORTIONAL, draft)[0] == [0, 0]


def test_each_link_keeps_its_own_acceptance_and_a_new_sequence_starts_from_the_chains_capped():
    state = Acceptance()
    for _ in range(30):
        state.record(4, 0, "suffix")
        state.record(6, 6, "draft")
    assert state.link_rate("suffix") < 0.05 and state.link_rate("draft") > 0.95
    assert 0.05 < state.rate < 0.95  # the chain's rate mixes them
    assert state.link_rate("ngram") == Acceptance().rate  # a link that never drafted: the fixed prior
    new = Acceptance.starting_from(state)
    assert new.link_rate("suffix") == pytest.approx(state.link_rate("suffix"))
    assert new.link_rate("draft") == pytest.approx(Acceptance().rate)  # never above the fixed prior


def test_nothing_is_vetoed_before_plain_decoding_was_measured_alike():
    gain = RealizedGain()
    for _ in range(3 * REALIZED_MIN_STEPS):
        gain.record(0.1)
    assert not gain.vetoed() and gain.ratio is None
    gain.record_plain(1.0)
    gain.record(0.1)
    assert gain.vetoed()


def test_a_batch_size_whose_drafting_measures_slower_than_plain_is_vetoed_for_longer_each_time():
    gain = RealizedGain()
    gain.record_plain(1.0)  # tokens per second of plain steps, measured alike
    for _ in range(REALIZED_MIN_STEPS - 1):
        gain.record(0.8)
    assert not gain.vetoed()  # too few steps to judge
    gain.record(0.8)
    assert [gain.vetoed() for _ in range(VETO_STEPS + 1)] == [True] * VETO_STEPS + [False]
    for _ in range(REALIZED_MIN_STEPS):  # measured afresh: still slower, twice as long
        gain.record(0.9)
    assert sum(gain.vetoed() for _ in range(4 * VETO_STEPS)) == 2 * VETO_STEPS
    for _ in range(REALIZED_MIN_STEPS):  # now it pays: the next veto starts short again
        gain.record(1.3)
    assert not gain.vetoed() and gain.veto_length == VETO_STEPS
    for _ in range(20):
        for _ in range(REALIZED_MIN_STEPS):
            gain.record(0.5)
        while gain.vetoed():
            pass
    assert gain.veto_length == MAX_VETO_STEPS and gain.vetoes == 22


def test_a_sequence_joining_the_batch_ends_a_veto_and_starts_the_measurement_afresh():
    gain = RealizedGain()
    gain.record_plain(1.0)
    batch = frozenset({1, 2})
    gain.vetoed(batch)
    for _ in range(REALIZED_MIN_STEPS):
        gain.record(0.5)
    assert gain.vetoed(batch) and gain.vetoed(frozenset({2}))  # one finished: the rest stay vetoed
    assert not gain.vetoed(frozenset({2, 3}))  # a new one: its text was never measured
    for _ in range(REALIZED_MIN_STEPS - 1):
        gain.record(0.5)
    assert not gain.vetoed(frozenset({2, 3}))


def test_drafting_that_pays_is_never_vetoed():
    gain = RealizedGain()
    gain.record_plain(1.0)
    for ratio in [1.5, 0.9, 1.4, 0.95, 1.6] * 20:  # noisy, but faster than plain on average
        gain.record(ratio)
        assert not gain.vetoed()


def test_a_vetoed_batch_drafts_and_probes_nothing_but_a_seeded_sequence_still_chooses_alone():
    curve = StepCost((1, 256), (1.0, 1.0 + 255 * 0.2))
    seqs = bare_sequences(7, temperature=0)  # new: they would all probe at once
    (seeded,) = bare_sequences(1, temperature=0.8, seed=3)
    calibrated = Calibration(curve)
    for rows in (1, 8):
        calibrated.record(rows, curve(rows))
        calibrated.record(rows, curve(rows))
    alone = draft_lengths([seeded], [6], 0, curve, None)[0]
    (again,) = bare_sequences(1, temperature=0.8, seed=3)
    lengths = draft_lengths([*seqs, again], [6] * 8, 0, curve, None, calibrated, vetoed=True)
    assert lengths == [0] * 7 + [alone]
    assert all(seq.stash[ACCEPTANCE].fresh for seq in seqs)  # not probed: their first probe waits for the veto's end
