"""Step-cost curves and bare sequences for testing adaptive speculation's chooser without an engine."""

from __future__ import annotations

from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Request, Sequence
from decodekit.api.step_cost import StepCost

PROPORTIONAL = StepCost((1, 256), (1.0, 256.0))
"""Compute-bound: every row costs the same."""
NEARLY_FREE = StepCost((1, 256), (1.0, 1.02))
"""Memory-bound: reading the weights is the step."""


def bare_sequences(count: int, **sampling) -> list[Sequence]:
    """`count` sequences of one-sequence requests (prompt [1, 2, 3], 64 tokens at most), sampled as `sampling` says."""
    out = []
    for i in range(count):
        request = Request(str(i), None, [1, 2, 3], SamplingParams(max_tokens=64, **sampling), 0)
        out.append(Sequence(request, [1, 2, 3], 3))
    return out
