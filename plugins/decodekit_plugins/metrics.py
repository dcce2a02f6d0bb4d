"""decodekit's own quality metrics for `decodekit compare`, registered through `decodekit_register_metrics` as a third
party's would be.

Words are the whitespace-separated pieces of a text (what distinct-n and self-BLEU count, as their papers do);
repetition counts the model's own tokens.

- `distinct_1`, `distinct_2`: distinct n-grams over all n-grams of a prompt's samples together (Li et al. 2016);
- `self_bleu`: each sample's BLEU-4 against the prompt's other samples, averaged (Zhu et al. 2018, Texygen; BLEU as
  nltk's `sentence_bleu` with its `method1` smoothing);
- `repetition`: seq-rep-4 of each output, the share of its 4-grams of tokens that repeat an earlier one (Welleck et
  al. 2019);
- `length`: tokens per output;
- `perplexity`: each output's perplexity under the plain model, `exp(-mean log p(token))`;
- `kl`: per output, the mean over its tokens of `log q(token) - log p(token)` (q: what the strategy drew the token
  from, p: the plain model), the Monte Carlo estimate of KL(q || p) at the chosen tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from decodekit import hookimpl
from decodekit.api.metrics import Metric, SampleGroup

BLEU_ORDER = 4
SMOOTHING_EPSILON = 0.1
"""nltk's `SmoothingFunction().method1`: a precision with no match counts `0.1` matches instead."""


def ngrams(items: Sequence[Any], n: int) -> list[tuple[Any, ...]]:
    """The n-grams of `items`, in order (none when there are fewer than `n` items)."""
    return [tuple(items[i : i + n]) for i in range(len(items) - n + 1)]


def bleu(hypothesis: Sequence[str], references: Sequence[Sequence[str]], order: int = BLEU_ORDER) -> float:
    """Sentence BLEU with uniform weights up to `order`, clipped counts against the references, the brevity penalty
    against the closest reference length (the shorter on a tie) and `method1` smoothing: nltk's `sentence_bleu`.
    0.0 when no unigram matches or the hypothesis is empty."""
    if not hypothesis:
        return 0.0
    log_precision = 0.0
    for n in range(1, order + 1):
        counts = Counter(ngrams(hypothesis, n))
        most = Counter[tuple[str, ...]]()
        for reference in references:
            for gram, count in Counter(ngrams(reference, n)).items():
                most[gram] = max(most[gram], count)
        matches = sum(min(count, most[gram]) for gram, count in counts.items())
        total = max(1, sum(counts.values()))
        if matches == 0:
            if n == 1:
                return 0.0
            log_precision += math.log(SMOOTHING_EPSILON / total) / order
        else:
            log_precision += math.log(matches / total) / order
    length = len(hypothesis)
    closest = min((len(r) for r in references), key=lambda r: (abs(r - length), r), default=0)
    brevity = 1.0 if length > closest else math.exp(1 - closest / length)
    return brevity * math.exp(log_precision)


class DistinctN(Metric):
    """Distinct n-grams over all n-grams of a prompt's samples (words; higher: more varied)."""

    n = 1
    higher_is_better = True

    def score(self, group: SampleGroup) -> list[float]:
        grams = [g for text in group.texts for g in ngrams(text.split(), self.n)]
        return [len(set(grams)) / len(grams)] if grams else []


class Distinct1(DistinctN):
    """Distinct unigrams over all unigrams of a prompt's samples (words; higher: more varied)."""

    name = "distinct_1"


class Distinct2(DistinctN):
    """Distinct bigrams over all bigrams of a prompt's samples (words; higher: more varied)."""

    name = "distinct_2"
    n = 2


class SelfBleu(Metric):
    """Self-BLEU: each sample's BLEU-4 against the prompt's other samples, averaged (lower: more varied)."""

    name = "self_bleu"
    higher_is_better = False

    def score(self, group: SampleGroup) -> list[float]:
        words = [text.split() for text in group.texts]
        if len(words) < 2:
            return []
        scores = [bleu(hyp, words[:i] + words[i + 1 :]) for i, hyp in enumerate(words)]
        return [sum(scores) / len(scores)]


class Repetition(Metric):
    """seq-rep-4: the share of an output's 4-grams of tokens that repeat an earlier one (lower: fewer loops)."""

    name = "repetition"
    needs = frozenset({"token_ids"})
    higher_is_better = False
    n = 4

    def score(self, group: SampleGroup) -> list[float]:
        values = []
        for ids in group.token_ids:
            grams = ngrams(ids, self.n)
            if grams:
                values.append(1.0 - len(set(grams)) / len(grams))
        return values


class Length(Metric):
    """Tokens per output."""

    name = "length"
    needs = frozenset({"token_ids"})

    def score(self, group: SampleGroup) -> list[float]:
        return [float(len(ids)) for ids in group.token_ids]


class Perplexity(Metric):
    """Each output's perplexity under the plain model (median over outputs; lower: text the model finds likelier)."""

    name = "perplexity"
    needs = frozenset({"model_logprobs"})
    aggregate = "median"
    higher_is_better = False

    def score(self, group: SampleGroup) -> list[float]:
        assert group.model_logprobs is not None, "compare gives model_logprobs to the metrics that need them"
        return [math.exp(-sum(lp) / len(lp)) for lp in group.model_logprobs if lp]


class KlToModel(Metric):
    """Mean KL(strategy || plain model) at the chosen tokens: log q - log p per token (lower: closer to the model)."""

    name = "kl"
    needs = frozenset({"logprobs", "model_logprobs"})
    higher_is_better = False

    def score(self, group: SampleGroup) -> list[float]:
        assert group.logprobs is not None and group.model_logprobs is not None
        return [sum(q - p for q, p in zip(own, model)) / len(own)
                for own, model in zip(group.logprobs, group.model_logprobs) if own]


BUILT_IN: tuple[type[Metric], ...] = (Distinct1, Distinct2, SelfBleu, Repetition, Length, Perplexity, KlToModel)


@hookimpl
def decodekit_register_metrics(register: Any) -> None:
    """decodekit's own quality metrics."""
    for metric in BUILT_IN:
        register(metric.name, metric)
