"""Moved to `decodekit.api.strategy` and `decodekit.api.proposer`;
this import path stays for code written against earlier docs."""

from decodekit.api.proposer import Proposer
from decodekit.api.strategy import StepContext, Strategy, StrategyResult

__all__ = [
    "Proposer",
    "StepContext",
    "Strategy",
    "StrategyResult",
]
