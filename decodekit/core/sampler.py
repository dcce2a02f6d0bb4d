"""Moved to `decodekit.api.sampling`; this import path stays for code written against earlier docs."""

from decodekit.api.sampling import select_tokens

__all__ = [
    "select_tokens",
]
