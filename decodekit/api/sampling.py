"""Token selection after the processors: greedy argmax, or sampling with per-request generators.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), equivalent to a categorical draw, without
a host sync. Seeded rows draw their noise from their own `torch.Generator`, so a seeded request's tokens do not
depend on what else is in the batch. Greedy rows draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decodekit.api.processors import Stage

TINY_TEMPERATURE = 1e-5
"""Below this temperature the temperature processor shifts a row by its maximum before dividing (no overflow);
from it up, a draw at temperature T is a draw from `softmax(logits / T)` (what native draws compute, `DrawRule`)."""
TEMPERATURE_PROCESSOR = "temperature"
"""The processor that `SamplingParams.temperature` implies (the built-in one divides a row by it)."""


@dataclass(frozen=True)
class DrawRule:
    """A distribution a native draw samples from: `softmax(logits / temperature)`, then what the built-in `top_k`,
    `top_p` and `min_p` processors keep, in that order (0, 1.0 and 0.0: off), renormalized; what the processors
    behind `SamplingParams`' fields leave of a row, drawn by other arithmetic (a token within float rounding of an
    edge may fall the other way)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 < self.temperature < float("inf")):
            raise ValueError(f"a draw needs a positive finite temperature, not {self.temperature}")
        if self.top_k < 0 or not (0.0 < self.top_p <= 1.0) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"a draw needs top_k >= 0, 0 < top_p <= 1 and 0 <= min_p <= 1, not {self}")


DRAW_PROCESSORS = (TEMPERATURE_PROCESSOR, "top_k", "top_p", "min_p")
"""The processors a `DrawRule` stands for, in the order it applies them (the built-ins' registration order)."""


def draw_rule(stages: Sequence[Stage]) -> DrawRule | None:
    """The `DrawRule` a pipeline of processor `stages` amounts to, so that a draw from its output is a draw a native
    run can make: each stage one of `DRAW_PROCESSORS`, at most once and in that order (what `SamplingParams`'
    temperature, top_k, top_p and min_p imply), the temperature at least `TINY_TEMPERATURE` (no stage: 1.0); None for
    any other pipeline (another processor, another order, a state)."""
    fields: dict[str, float | int] = {}
    rank = -1
    for stage in stages:
        name = stage.processor.name
        if name not in DRAW_PROCESSORS or DRAW_PROCESSORS.index(name) <= rank or stage.options is None \
                or stage.processor.stateful:
            return None
        rank = DRAW_PROCESSORS.index(name)
        fields[name] = getattr(stage.options, name)
    if float(fields.get(TEMPERATURE_PROCESSOR, 1.0)) < TINY_TEMPERATURE:
        return None
    try:
        return DrawRule(**fields)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


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
