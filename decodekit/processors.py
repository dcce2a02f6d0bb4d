"""Moved to `decodekit.api.processors`; this import path stays for code written against earlier docs."""

from decodekit.api.processors import BatchView, LogitsProcessor, Stage, apply_processors

__all__ = [
    "BatchView",
    "LogitsProcessor",
    "Stage",
    "apply_processors",
]
