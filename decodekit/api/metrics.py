"""The quality-metric contract: what `decodekit compare` measures about the outputs of a recipe.

A `Metric` is a plugin kind (`decodekit_register_metrics`). It declares what it reads (`needs`), scores the `N`
samples one recipe produced for one prompt (a `SampleGroup`) as a list of values (one per sample for a metric of
each output, one for the group for a metric across the samples, such as self-BLEU), and says how the values of every
prompt are folded into the one figure the report shows (`aggregate`), and which way is better (`higher_is_better`,
which the report's Pareto view needs). decodekit's own metrics (distinct-n, self-BLEU, repetition, length,
perplexity, KL to the plain model) are in `decodekit_plugins.metrics` and register through the same hook.

What a metric may need (`Need`):

- `texts`: the samples' texts;
- `token_ids`: the samples' token ids;
- `logprobs`: per token, the log-probability of the chosen token under the distribution the strategy chose it from
  (the request's processed distribution for a sampling strategy; 0.0 for a deterministic one, whose choice is
  certain). `compare` refuses, before anything runs, a metric that needs them on a strategy that cannot say what that
  distribution is (`Strategy.token_distribution` is None: best-of-n ranks finished samples);
- `model_logprobs`: per token, its log-probability under the plain model (the raw logits), from one scoring pass of
  prompt + output through the same engine.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

Need = Literal["texts", "token_ids", "logprobs", "model_logprobs"]
"""What a metric reads of a `SampleGroup` (see the module's docstring)."""

Aggregate = Literal["mean", "median", "min", "max"]
"""How the values of every prompt become the report's figure."""

NEEDS: tuple[str, ...] = get_args(Need)
AGGREGATES: tuple[str, ...] = get_args(Aggregate)


@dataclass(frozen=True)
class SampleGroup:
    """The `N` samples one recipe produced for one prompt, and what metrics may read of them.

    `logprobs` and `model_logprobs` are given only when some metric of the run needs them (None otherwise); each
    holds one list per sample with one value per generated token.
    """

    prompt: str
    prompt_token_ids: list[int]
    texts: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    model_logprobs: list[list[float]] | None = None


class Metric(ABC):
    """Base class of quality metrics. Stateless: one instance scores every group of a run.

    Subclasses set `name`, `needs`, `aggregate` and `higher_is_better`, and implement `score`; the first line of the
    class docstring is the metric's description in `decodekit plugins` and the report.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[Need]] = frozenset({"texts"})
    aggregate: ClassVar[Aggregate] = "mean"
    higher_is_better: ClassVar[bool | None] = None  # None: no better side (length); left out of the Pareto view

    @abstractmethod
    def score(self, group: SampleGroup) -> list[float]:
        """The group's values: one per sample, or one for the whole group; an empty list when there is nothing to
        measure (every sample empty). Values are finite floats."""


def aggregate_values(values: Sequence[float], how: Aggregate) -> float | None:
    """Fold the values of every prompt into one figure; None when there are none.

    Raises:
        ValueError: `how` is not one of `AGGREGATES`.
    """
    if how not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {how!r}")
    if not values:
        return None
    if how == "mean":
        return statistics.fmean(values)
    if how == "median":
        return float(statistics.median(values))
    return float(min(values) if how == "min" else max(values))


def check_metric(metric: Metric) -> None:
    """Refuse a metric whose declarations are not ones `compare` understands (at registration).

    Raises:
        ValueError: an unknown need or aggregate, or no name (the message names the metric's class).
    """
    label = type(metric).__name__
    if not metric.name:
        raise ValueError(f"metric {label}: `name` is empty")
    unknown = sorted(set(metric.needs) - set(NEEDS))
    if unknown:
        raise ValueError(f"metric {metric.name!r}: needs {unknown} are not among {', '.join(NEEDS)}")
    if metric.aggregate not in AGGREGATES:
        raise ValueError(f"metric {metric.name!r}: aggregate {metric.aggregate!r} is not one of "
                         f"{', '.join(AGGREGATES)}")
