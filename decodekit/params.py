"""Moved to `decodekit.api.params`; this import path stays for code written against earlier docs."""

from decodekit.api.params import ComponentSpec, SamplingParams

__all__ = [
    "ComponentSpec",
    "SamplingParams",
]
