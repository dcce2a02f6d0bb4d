"""What `decodekit trace` shows of a trace: the requests `--request` names, the output `--sequence` names, and the
steps `--steps A:B` names."""

from __future__ import annotations

from dataclasses import replace

from decodekit.api.errors import ConfigError
from decodekit.trace.format import TraceRequest

__all__ = ["only_sequence", "parse_steps", "select_requests"]


def select_requests(requests: list[TraceRequest], key: str | None) -> list[TraceRequest]:
    """The requests `key` names: a request id, else a 0-based position in the file; all of them for None. Raises
    `ConfigError` listing the ids when it names none."""
    if key is None:
        return requests
    by_id = [r for r in requests if r.id == key]
    if by_id:
        return by_id
    if key.lstrip("-").isdigit() and -len(requests) <= int(key) < len(requests):
        return [requests[int(key)]]
    ids = ", ".join(r.id for r in requests[:20]) + (", ..." if len(requests) > 20 else "")
    raise ConfigError(f"no request {key!r} in the trace: its ids are {ids} (or give a position, 0 to "
                      f"{len(requests) - 1})")


def only_sequence(requests: list[TraceRequest], sequence: int | None) -> list[TraceRequest]:
    """The requests with only their output `sequence` (all of them for None); a request without one keeps none."""
    if sequence is None:
        return requests
    return [replace(r, outputs=[o for o in r.outputs if o.index == sequence]) for r in requests]


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """`A:B` (B excluded, either may be left out) or a single `I` as `(start, stop)`. Raises `ConfigError`."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            one = int(parts[0])
            return one, one + 1
        if len(parts) == 2:
            return (int(parts[0]) if parts[0].strip() else None), (int(parts[1]) if parts[1].strip() else None)
    except ValueError:
        pass
    raise ConfigError(f"--steps {text!r}: give A:B (token indices, B excluded; A: or :B for an open end) or I")
