"""Whether the float32 product `dk_gemv` prefetches its weight stream in software, chosen per machine by timing it.

A batch-1 float32 token is the weights read once, and `dk_gemv` reads them one stream per thread. On a 2-core Zen 5 a
software prefetch `GEMV_PREFETCH_ROW` floats ahead carried that stream across 4 KB pages faster than the hardware
prefetcher alone; on a 2-core Zen 3 the same prefetch made a float32 token 1.16x slower (the two engines alternating in
one process, same tokens). Which is faster is the memory system's business, not the instruction set's, so it is
measured: the first time a library is loaded on a machine, one product of ~100 MB of weights (past any L3) is timed
with and without the prefetch, alternating, and the prefetch is turned off only where that is clearly faster
(`MARGIN`). The choice is cached beside the library (its name carries the source and the CPU), so later processes
read it instead of timing (a result too close to call is not cached: measured again by the next process);
`DECODEKIT_GEMV_PREFETCH` overrides it (`auto`, the default; `off`/0; or floats per row).
Only speed depends on it: a prefetch changes no value.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger("decodekit.runner")

# The weight timed: SmolLM2's widest input (1536) by 16K outputs, 100 MB of float32: more than an L3 holds.
CALIBRATION_SHAPE = (16384, 1536)
# Timed products each way, alternating (the first of each is a warm-up, not counted). 7 a way chose wrongly on a 2-core
# Zen 3 where a float32 token runs 1.15x as fast without the prefetch: single timings there moved between 3% and 18%
# apart from one library build to the next, so each pair of neighbouring products is compared and the median of
# those ratios decides (~0.2 s in all, once per library).
TRIALS = 15
# The prefetch goes off only where, in the median pair, its absence is this much faster: a machine's bandwidth moves
# by the minute, and the prefetch is the path measured on the machines this project is tuned on.
MARGIN = 0.03
ENV = "DECODEKIT_GEMV_PREFETCH"


@dataclass(frozen=True)
class GemvPrefetchChoice:
    """What `dk_gemv` was set to: `floats` per activation row ahead (None: the library's default; 0: none), and the
    timings it was chosen by (medians in ms of one product with and without the prefetch; None where not timed),
    where it came from: "measured", "cached", the environment variable's name, or "default" (timing failed), and
    whether a measurement was `decided` (one way `MARGIN` faster; only such a choice is cached)."""

    floats: int | None
    with_prefetch_ms: float | None = None
    without_ms: float | None = None
    source: str = "measured"
    decided: bool = True


class PrefetchingGemv(Protocol):
    """What this module needs of the loaded kernels (`native.NativeKernels`)."""

    path: Path
    gemv_prefetch: GemvPrefetchChoice | None

    def set_gemv_prefetch(self, floats: int | None) -> int:
        """Set the prefetch distance (None: the default); return the one before."""

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight^T` for a few float32 rows."""


def measure_gemv_prefetch(kernels: PrefetchingGemv, trials: int = TRIALS) -> GemvPrefetchChoice:
    """Time one `CALIBRATION_SHAPE` product with the default prefetch and without, alternating, on torch's current
    threads; choose none only where, in the median of the trials' ratios (each trial one product each way, back to
    back), it is `MARGIN` faster. Within `MARGIN` either way the result is not `decided`: on a machine whose memory
    is saturated by other work both ways take the same time, and that says nothing about the machine when it is
    not (one library first loaded while a test suite ran kept the prefetch this way, and its float32 token then ran
    0.84x as fast as without, on a 2-core Zen 3). Leaves the library set as it found it."""
    weight = torch.ones(CALIBRATION_SHAPE)
    x = torch.ones(1, CALIBRATION_SHAPE[1])
    times: dict[int | None, list[float]] = {None: [], 0: []}
    before = kernels.set_gemv_prefetch(None)
    try:
        for trial in range(trials + 1):
            for floats in ((None, 0) if trial % 2 == 0 else (0, None)):
                kernels.set_gemv_prefetch(floats)
                start = time.perf_counter()
                kernels.gemv(x, weight)
                if trial:
                    times[floats].append(time.perf_counter() - start)
    finally:
        kernels.set_gemv_prefetch(before)
    on, off = (statistics.median(times[key]) * 1e3 for key in (None, 0))
    ratio = statistics.median(without / with_ for with_, without in zip(times[None], times[0]))
    return GemvPrefetchChoice(0 if ratio < 1 - MARGIN else None, round(on, 3), round(off, 3),
                              decided=abs(ratio - 1) >= MARGIN)


def choice_path(kernels: PrefetchingGemv) -> Path:
    """Where the choice for `kernels`' library is cached: beside it, in the private kernel cache."""
    return Path(f"{kernels.path}.gemv-prefetch.json")


def _cached(path: Path) -> GemvPrefetchChoice | None:
    """The choice recorded at `path`, or None where there is none readable."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        record = json.loads(path.read_text())
        floats = record["floats"]
        if floats is None or (isinstance(floats, int) and floats >= 0):
            return GemvPrefetchChoice(floats, record.get("with_prefetch_ms"), record.get("without_ms"), "cached")
    return None


def _override(setting: str) -> GemvPrefetchChoice:
    """`DECODEKIT_GEMV_PREFETCH`'s choice (not `auto`).

    Raises:
        ValueError: it is neither `auto`, `off`, `on` nor a count of floats >= 0.
    """
    word = setting.strip().lower()
    if word in ("off", "no", "0", "false", "none"):
        return GemvPrefetchChoice(0, source=ENV)
    if word in ("on", "yes", "default"):
        return GemvPrefetchChoice(None, source=ENV)
    if word.isdigit():
        return GemvPrefetchChoice(int(word), source=ENV)
    raise ValueError(f"{ENV}={setting!r}: expected auto, on, off or a number of floats per row ahead")


def apply_gemv_prefetch(kernels: PrefetchingGemv) -> GemvPrefetchChoice:
    """Set `kernels`' gemv prefetch for this process: `DECODEKIT_GEMV_PREFETCH` if set, else the cached choice for
    this library, else one measured now (and cached). A bad setting is logged and the default kept."""
    setting = os.environ.get(ENV, "auto")
    if setting.strip().lower() != "auto":
        try:
            choice = _override(setting)
        except ValueError as error:
            log.warning("%s; keeping the default prefetch", error)
            choice = GemvPrefetchChoice(None, source=ENV)
    else:
        path = choice_path(kernels)
        try:
            choice = _cached(path) or measure_gemv_prefetch(kernels)
        except (RuntimeError, MemoryError) as error:  # no 100 MB to spare: the default, measured another time
            log.warning("dk_gemv's prefetch not measured (%s); keeping the default", error)
            choice = GemvPrefetchChoice(None, source="default")
        if choice.source == "measured":
            log.info("dk_gemv's software prefetch %s (one float32 product: %.2f ms with, %.2f ms without%s)",
                     "off" if choice.floats == 0 else "on", choice.with_prefetch_ms, choice.without_ms,
                     "" if choice.decided else "; too close to call: measured again next time")
            if choice.decided:
                with contextlib.suppress(OSError):  # an unwritable cache only means timing again next time
                    path.write_text(json.dumps({key: value for key, value in asdict(choice).items()
                                                if key not in ("source", "decided")}))
    kernels.set_gemv_prefetch(choice.floats)
    kernels.gemv_prefetch = choice
    return choice
