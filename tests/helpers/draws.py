"""The distribution a `DrawRule` describes, computed by the built-in processors it stands for (the reference native
draws are tested against)."""

from __future__ import annotations

import torch

from decodekit import SamplingParams
from decodekit.api.processors import BatchView
from decodekit.api.sampling import DrawRule
from decodekit_plugins import sampling


def processed(logits: torch.Tensor, rule: DrawRule) -> torch.Tensor:
    """`logits` [vocab] through the built-in processors `rule` stands for, in their order."""
    row = logits[None].clone()
    steps = [(sampling.TemperatureProcessor(), sampling.TemperatureProcessor.Params(temperature=rule.temperature))]
    if rule.top_k:
        steps.append((sampling.TopKProcessor(), sampling.TopKProcessor.Params(top_k=rule.top_k)))
    if rule.top_p < 1.0:
        steps.append((sampling.TopPProcessor(), sampling.TopPProcessor.Params(top_p=rule.top_p)))
    if rule.min_p > 0.0:
        steps.append((sampling.MinPProcessor(), sampling.MinPProcessor.Params(min_p=rule.min_p)))
    for processor, options in steps:
        row = processor(row, BatchView([SamplingParams()], [[1]], [0], (0,), options=[options]))
    return row[0]
