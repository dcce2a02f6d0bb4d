"""Token selection after the processors: greedy argmax, or sampling with per-request generators.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), equivalent to a categorical draw, without
a host sync. Seeded rows draw their noise from their own `torch.Generator`, so a seeded request's tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

import torch


def select_tokens(
    logits: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row of processed `logits` `[rows, vocab]`; returns `[rows]` long."""
    if all(greedy):
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    sampled = (probs / noise).argmax(dim=-1)
    if any(greedy):
        mask = torch.tensor(greedy, device=logits.device)
        sampled = torch.where(mask, logits.argmax(dim=-1), sampled)
    return sampled
