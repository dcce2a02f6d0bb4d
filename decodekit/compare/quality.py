"""The quality side of one point: each prompt's `N` seeded samples made into a `SampleGroup` (texts, token ids, the
strategy's logprobs, the plain model's), and every metric scored over the groups and folded into one figure.

The same `seed`, prompt and sample number give the same seed at every point (`sample_seed`), so every recipe starts
from the same random draws, and a run repeated gives the same figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.api.metrics import Metric, SampleGroup, aggregate_values
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput


def sample_seed(seed: int, prompt: int, sample: int, samples: int) -> int:
    """The seed of sample `sample` of prompt `prompt` (both from 0): the same at every point of a run."""
    return seed * 1_000_003 + prompt * samples + sample


def sample_params(params: SamplingParams, seed: int, logprobs: bool) -> SamplingParams:
    """A request's parameters for one sample: its seed, and the logprobs of its chosen tokens under the distribution
    they were drawn from when a metric needs them."""
    update: dict[str, Any] = {"seed": seed}
    if logprobs:
        update.update(logprobs=0, logprobs_mode="processed")
    return SamplingParams.model_validate({**params.model_dump(exclude_unset=True), **update})


@dataclass(frozen=True)
class MetricFigure:
    """One metric at one point: the aggregated figure, every value it folds, and why it is missing if it is."""

    value: float | None
    values: list[float]
    missing: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out: dict[str, Any] = {"value": self.value, "values": self.values}
        if self.missing is not None:
            out["missing"] = self.missing
        return out


def chosen_logprobs(output: RequestOutput, distribution: str | None) -> list[float] | None:
    """log q of each generated token of the request's first output: 0.0 each for a deterministic strategy, the
    recorded processed logprob for a sampling one; None when they are not known."""
    choice = output.outputs[0] if output.outputs else None
    if choice is None:
        return None
    if distribution == "deterministic":
        return [0.0] * len(choice.token_ids)
    if distribution != "processed" or choice.logprobs is None or len(choice.logprobs) != len(choice.token_ids):
        return None
    return [entry[token].logprob for entry, token in zip(choice.logprobs, choice.token_ids)]


def sample_group(prompt: str, samples: Sequence[RequestOutput], logprobs: Sequence[list[float] | None] | None,
                 model_logprobs: Sequence[list[float] | None] | None) -> SampleGroup:
    """One prompt's samples as metrics read them (each request's first output). A sample whose logprobs are not
    known (its scoring failed) keeps an empty list there, which the logprob metrics skip."""
    first = [s.outputs[0] if s.outputs else None for s in samples]
    return SampleGroup(
        prompt=prompt,
        prompt_token_ids=list(samples[0].prompt_token_ids) if samples else [],
        texts=[c.text if c is not None else "" for c in first],
        token_ids=[list(c.token_ids) if c is not None else [] for c in first],
        logprobs=None if logprobs is None else [lp or [] for lp in logprobs],
        model_logprobs=None if model_logprobs is None else [lp or [] for lp in model_logprobs],
    )


def score_metrics(metrics: Sequence[Metric], groups: Sequence[SampleGroup],
                  left_out: dict[str, str] | None = None) -> dict[str, MetricFigure]:
    """Every metric over every group, folded by its `aggregate`; a metric left out (`left_out`: name -> why) is
    reported missing with its reason.

    Raises:
        ValueError: a metric returned a value that is not a finite number (the message names it).
    """
    figures = {name: MetricFigure(None, [], why) for name, why in (left_out or {}).items()}
    for metric in metrics:
        if metric.name in figures:
            continue
        values: list[float] = []
        for group in groups:
            for value in metric.score(group):
                number = float(value)
                if number != number or number in (float("inf"), float("-inf")):
                    raise ValueError(f"metric {metric.name!r} returned {value!r} for prompt {group.prompt[:40]!r}")
                values.append(number)
        figures[metric.name] = MetricFigure(aggregate_values(values, metric.aggregate), values,
                                            None if values else "nothing to measure")
    return figures
