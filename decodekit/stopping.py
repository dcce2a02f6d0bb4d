"""Moved to `decodekit.api.stopping`; this import path stays for code written against earlier docs."""

from decodekit.api.stopping import StopDecision, StoppingCriterion

__all__ = [
    "StopDecision",
    "StoppingCriterion",
]
