"""Token selection after the processors: greedy argmax, or sampling with per-request generators.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), equivalent to a categorical draw, without
a host sync. Seeded rows draw their noise from their own `torch.Generator`, so a seeded request's tokens do not
depend on what else is in the batch. Greedy rows draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decodekit.api.processors import Stage

TINY_TEMPERATURE = 1e-5
"""Below this temperature the temperature processor shifts a row by its maximum before dividing (no overflow);
from it up, a draw at temperature T is a draw from `softmax(logits / T)` (what native draws compute)."""
TEMPERATURE_PROCESSOR = "temperature"
"""The processor that `SamplingParams.temperature` implies (the built-in one divides a row by it)."""


def draw_temperature(stages: Sequence[Stage]) -> float | None:
    """The temperature T where a pipeline of processor `stages` only divides logits by T (no stage: 1.0; the
    temperature processor alone, at T >= `TINY_TEMPERATURE`), so a draw from its output is a draw from
    `softmax(logits / T)`, which a native run can make; None for any other pipeline."""
    if not stages:
        return 1.0
    if len(stages) > 1 or stages[0].processor.name != TEMPERATURE_PROCESSOR or stages[0].options is None:
        return None
    temperature = float(getattr(stages[0].options, "temperature", 0.0))
    return temperature if temperature >= TINY_TEMPERATURE else None


def exponential_noise(rows: int, vocab: int, generators: list[torch.Generator | None],
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[rows, vocab]` draws of Exp(1) on `device`, row `i` from `generators[i]` (None: torch's default generator
    there). A seeded request's generator lives on the engine's device, so on a GPU the noise is drawn there (torch's
    own kernel, one launch per row, no copy).

    For float32 the values and the generators' states afterwards are exactly those of `Tensor.exponential_` (which
    on CPU draws a float64 uniform u per element and returns `-log1p(-u)` rounded to float32, one scalar call per
    element); drawing the uniforms with `uniform_` and taking one vectorised `log1p` is about 2.3x faster here, and
    at 49k-token vocabularies this noise was most of a sampled row's cost.
    """
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        # other dtypes keep torch's own kernel (its rounding differs per dtype), as do GPUs
        noise = torch.empty(rows, vocab, dtype=dtype, device=device)
        for i, generator in enumerate(generators):
            noise[i].exponential_(generator=generator)
        return noise
    uniform = torch.empty(rows, vocab, dtype=torch.float64)
    for i, generator in enumerate(generators):
        uniform[i].uniform_(generator=generator)
    return torch.log1p(uniform.neg_()).neg_().to(torch.float32)


def select_tokens(
    logits: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row of processed `logits` `[rows, vocab]`; returns `[rows]` long."""
    if all(greedy):
        return logits.argmax(dim=-1)
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    every_row = len(sampled_rows) == len(greedy)
    rows = logits if every_row else logits[sampled_rows]
    noise = exponential_noise(rows.shape[0], rows.shape[1], [generators[i] for i in sampled_rows], rows.dtype,
                              rows.device)
    sampled = (torch.softmax(rows, dim=-1) / noise).argmax(dim=-1)
    if every_row:
        return sampled
    chosen = logits.argmax(dim=-1)
    chosen[sampled_rows] = sampled
    return chosen
