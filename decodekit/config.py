"""Moved to `decodekit.core.config`; this import path stays for code written against earlier docs."""

from decodekit.core.config import EngineConfig, parse_bytes

__all__ = [
    "EngineConfig",
    "parse_bytes",
]
