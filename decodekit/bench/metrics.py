"""Latency figures, defined once for `decodekit run`'s summary, `decodekit bench` and `decodekit bench serve`.

- TTFT (time to first token): from a request's start to its first generated token. In-process the start is the
  request's arrival in the engine (`RequestMetrics.ttft`); over HTTP it is the send, and the first token is the
  first chunk that carries text.
- TPOT (time per output token): the time after the first token over the tokens after the first,
  `(end - first token) / (tokens - 1)`, for requests of two tokens or more (`tpot`). In-process the engine keeps
  it (`RequestMetrics.tpot`, over output positions); over HTTP it is `(e2e - ttft) / (tokens - 1)`. The peers'
  worker (`bench.peer_worker`) computes the same in the peer's own Python, which cannot import decodekit.
- Percentiles interpolate linearly between the closest ranks (numpy's default method): p50 of `[1, 2, 3, 4]` is
  2.5. A run's figures are percentiles over its requests; a benchmark of several rounds reports the median over
  the rounds of each round's percentile (`median_of_round_percentiles`).

Only the standard library is imported here, so `decodekit run` does not pay for the benchmarks' dependencies.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decodekit.api.sequence import RequestOutput


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentiles(values: Sequence[float], qs: Sequence[float]) -> tuple[float | None, ...]:
    """`percentile(values, q)` for each q in `qs`, in order."""
    return tuple(percentile(values, q) for q in qs)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_of_round_percentiles(rounds: Sequence[Sequence[float] | None],
                                qs: Sequence[float]) -> tuple[float | None, ...]:
    """For each q in `qs`, the median over `rounds` (each round's per-request values) of the round's percentile q;
    all None unless every round has values (a system that times no request in one round reports no latency)."""
    if not all(rounds):
        return (None,) * len(qs)
    return tuple(median([percentile(values or [], q) for values in rounds]) for q in qs)


def tpot(ttft_s: float | None, e2e_s: float, tokens: int) -> float | None:
    """Time per output token after the first: `(e2e_s - ttft_s) / (tokens - 1)`, both times measured from the
    request's start; None without a first token or with fewer than two tokens."""
    if ttft_s is None or tokens < 2:
        return None
    return (e2e_s - ttft_s) / (tokens - 1)


def request_latencies(outputs: Iterable[RequestOutput]) -> tuple[list[float], list[float]]:
    """The engine's TTFT and TPOT (`RequestMetrics.ttft`, `.tpot`) of the requests that have them, in order: two
    lists, since a request of one token has a TTFT and no TPOT."""
    outputs = list(outputs)
    ttfts = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    return ttfts, tpots
