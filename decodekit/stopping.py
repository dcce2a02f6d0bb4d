"""The stopping-criterion contract: plugins decide, after each new token, whether a sequence is done."""

from __future__ import annotations

from dataclasses import dataclass

from decodekit.core.sequence import Sequence
from decodekit.params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    """Why a sequence stops: `finish_reason` ("stop" or "length"), what matched, and where to cut the text."""

    finish_reason: str
    stop_reason: str | int | None = None
    truncate_text_at: int | None = None


class StoppingCriterion:
    """Base class of stopping criteria. Built once per engine; `check` runs after every token of active rows."""

    name: str = "criterion"

    def is_active(self, params: SamplingParams) -> bool:
        """Whether a request with these parameters uses this criterion."""
        return True

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> StopDecision | None:
        """Return a decision to stop `seq` (whose newest token is `seq.token_ids[-1]`), or None to go on."""
        raise NotImplementedError
