"""Moved to `decodekit.core.registry`; this import path stays for code written against earlier docs."""

from decodekit.core.registry import Entry, Registry

__all__ = [
    "Entry",
    "Registry",
]
