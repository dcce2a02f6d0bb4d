"""Moved to `decodekit.api.sequence`; this import path stays for code written against earlier docs."""

from decodekit.api.sequence import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    Sequence,
    SequenceStatus,
)

__all__ = [
    "CompletionOutput",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "Sequence",
    "SequenceStatus",
]
