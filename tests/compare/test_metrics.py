"""The built-in quality metrics against references on hand-made inputs: distinct-n and repetition against direct
counts, self-BLEU against nltk's `sentence_bleu` (or a value worked out by hand where nltk is missing), perplexity
and KL against their formulas; aggregation; the Pareto frontier against a brute-force one; and metrics registered
through the hook, as a third party's would be."""

from __future__ import annotations

import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import hookimpl
from decodekit.api.metrics import Metric, SampleGroup, aggregate_values, check_metric
from decodekit.compare.pareto import Scored, frontier
from decodekit.compare.quality import score_metrics
from decodekit.core.registry import Registry
from decodekit_plugins.metrics import (
    BUILT_IN,
    Distinct1,
    Distinct2,
    KlToModel,
    Length,
    Perplexity,
    Repetition,
    SelfBleu,
    bleu,
)

WORDS = st.lists(st.sampled_from(["a", "b", "c", "d", "the", "cat"]), min_size=0, max_size=12)


def group(texts=(), token_ids=None, logprobs=None, model_logprobs=None) -> SampleGroup:
    texts = list(texts)
    return SampleGroup("p", [1], texts, token_ids if token_ids is not None else [[] for _ in texts], logprobs,
                       model_logprobs)


def direct_distinct(texts: list[str], n: int) -> float | None:
    grams = []
    for text in texts:
        words = text.split()
        grams += [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def test_distinct_n_counts_distinct_word_ngrams_over_all_samples_of_a_prompt():
    texts = ["the cat sat", "the cat ran", "a dog sat"]
    # unigrams: 9, distinct {the, cat, sat, ran, a, dog} = 6; bigrams: 6, distinct {the cat, cat sat, cat ran,
    # a dog, dog sat} = 5
    assert Distinct1().score(group(texts)) == [6 / 9]
    assert Distinct2().score(group(texts)) == [5 / 6]
    assert Distinct2().score(group(["one", "two"])) == []  # no bigram at all: nothing to measure


@settings(max_examples=60, deadline=None)
@given(st.lists(WORDS, min_size=1, max_size=5))
def test_distinct_n_equals_a_direct_count(samples):
    texts = [" ".join(words) for words in samples]
    for metric, n in ((Distinct1(), 1), (Distinct2(), 2)):
        expected = direct_distinct(texts, n)
        assert metric.score(group(texts)) == ([] if expected is None else [pytest.approx(expected)])


def test_bleu_of_a_hand_made_pair_is_the_worked_out_value():
    hyp, ref = ["the", "cat", "sat", "on", "the", "mat"], ["the", "cat", "sat", "on", "a", "mat"]
    # precisions 5/6, 3/5, 2/4, 1/3; equal lengths: no brevity penalty
    expected = math.exp((math.log(5 / 6) + math.log(3 / 5) + math.log(2 / 4) + math.log(1 / 3)) / 4)
    assert bleu(hyp, [ref]) == pytest.approx(expected)
    # no 4-gram matches: method1 smoothing counts 0.1 of one; a shorter hypothesis pays the brevity penalty
    short = ["the", "cat", "sat"]
    smoothed = math.exp((math.log(3 / 3) + math.log(2 / 2) + math.log(1 / 1) + math.log(0.1 / 1)) / 4)
    assert bleu(short, [ref]) == pytest.approx(smoothed * math.exp(1 - 6 / 3))
    assert bleu(["zzz"], [ref]) == 0.0 and bleu([], [ref]) == 0.0


@settings(max_examples=150, deadline=None)
@given(st.lists(WORDS.filter(bool), min_size=2, max_size=4))
def test_self_bleu_equals_nltk_sentence_bleu_against_the_other_samples(samples):
    nltk_bleu = pytest.importorskip("nltk.translate.bleu_score")
    smoothing = nltk_bleu.SmoothingFunction().method1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk warns on zero n-gram counts, which method1 handles
        scores = [nltk_bleu.sentence_bleu(samples[:i] + samples[i + 1:], hyp, smoothing_function=smoothing)
                  for i, hyp in enumerate(samples)]
    got = SelfBleu().score(group([" ".join(words) for words in samples]))
    assert got == [pytest.approx(sum(scores) / len(scores), abs=1e-12)]


def test_self_bleu_needs_two_samples_and_is_one_for_identical_ones():
    assert SelfBleu().score(group(["the cat sat on the mat"])) == []
    assert SelfBleu().score(group(["the cat sat on the mat"] * 3)) == [pytest.approx(1.0)]


def test_repetition_is_the_share_of_repeated_token_4grams_in_each_output():
    ids = [[1, 2, 3, 4, 1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 2]]
    # output 0: 4-grams 1234 2341 3412 4123 1234 -> one of five repeats; output 1: none; output 2: no 4-gram
    assert Repetition().score(group(["", "", ""], ids)) == [pytest.approx(0.2), 0.0]


def test_length_perplexity_and_kl_follow_their_formulas():
    ids = [[1, 2, 3], [4, 5]]
    own = [[-0.1, -0.2, -0.3], [0.0, 0.0]]
    model = [[-1.0, -2.0, -0.5], [-0.7, -0.1]]
    g = group(["", ""], ids, own, model)
    assert Length().score(g) == [3.0, 2.0]
    assert Perplexity().score(g) == [pytest.approx(math.exp(3.5 / 3)), pytest.approx(math.exp(0.4))]
    assert KlToModel().score(g) == [pytest.approx((0.9 + 1.8 + 0.2) / 3), pytest.approx(0.4)]


def test_aggregates_fold_values_as_named():
    values = [1.0, 5.0, 2.0, 10.0]
    assert aggregate_values(values, "mean") == 4.5
    assert aggregate_values(values, "median") == 3.5
    assert (aggregate_values(values, "min"), aggregate_values(values, "max")) == (1.0, 10.0)
    assert aggregate_values([], "mean") is None
    with pytest.raises(ValueError, match="aggregate must be one of"):
        aggregate_values(values, "sum")  # type: ignore[arg-type]


def test_score_metrics_folds_each_metric_over_every_prompt_and_reports_left_out_ones():
    groups = [group(["a b", "a c"], [[1, 2], [1, 3]]), group(["x"], [[4, 5, 6, 7, 8]])]
    figures = score_metrics([Length(), Perplexity()], groups, {"perplexity": "no logprobs here"})
    assert figures["length"].value == pytest.approx(3.0) and figures["length"].values == [2.0, 2.0, 5.0]
    assert figures["perplexity"].value is None and figures["perplexity"].missing == "no logprobs here"


def test_a_metric_returning_nan_fails_naming_it():
    class Broken(Metric):
        name = "broken"

        def score(self, group):
            return [float("nan")]

    with pytest.raises(ValueError, match="metric 'broken' returned nan"):
        score_metrics([Broken()], [group(["a"])])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=8), st.booleans())
def test_the_pareto_frontier_is_exactly_the_undominated_points(pairs, higher):
    points = [Scored(f"p{i}", "r", float(s), float(q)) for i, (s, q) in enumerate(pairs)]
    sign = 1 if higher else -1
    brute = {p.label for p in points
             if not any(o.speed >= p.speed and sign * o.quality >= sign * p.quality
                        and (o.speed > p.speed or sign * o.quality > sign * p.quality) for o in points)}
    assert set(frontier(points, higher)) == brute


def test_the_built_in_metrics_register_through_the_hook_with_valid_declarations(plugin_manager):
    registry = Registry.from_plugin_manager(plugin_manager)
    assert [registry.metrics[m.name].factory for m in BUILT_IN] == list(BUILT_IN)
    assert {registry.metrics[m.name].plugin for m in BUILT_IN} == {"decodekit_plugins.metrics"}
    for metric in BUILT_IN:
        check_metric(metric())


class _Exclamations(Metric):
    """Exclamation marks per output (a third party's metric)."""

    name = "exclamations"
    higher_is_better = False

    def score(self, group):
        return [float(t.count("!")) for t in group.texts]


class _ExclamationsPlugin:
    @hookimpl
    def decodekit_register_metrics(self, register):
        register("exclamations", _Exclamations)


def test_a_third_party_metric_registers_and_scores_like_the_built_ins(plugin_manager):
    plugin_manager.register(_ExclamationsPlugin(), "exclaim")
    registry = Registry.from_plugin_manager(plugin_manager)
    entry = registry.get("metrics", "exclamations")
    assert entry.plugin == "exclaim" and entry.description.startswith("Exclamation marks")
    figures = score_metrics([entry.factory()], [group(["hi!", "wow!!"])])
    assert figures["exclamations"].value == 1.5


def test_a_metric_with_an_unknown_need_is_refused_naming_it():
    class Odd(Metric):
        name = "odd"
        needs = frozenset({"hidden_states"})  # type: ignore[arg-type]

        def score(self, group):
            return []

    with pytest.raises(ValueError, match=r"metric 'odd': needs \['hidden_states'\] are not among texts"):
        check_metric(Odd())
