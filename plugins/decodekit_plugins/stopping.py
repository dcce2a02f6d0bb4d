"""Built-in stopping criteria: EOS, stop token ids, max tokens, stop strings across token boundaries (all on by
default, reading `SamplingParams`), and a per-request time limit that requests name (`stopping: [time_limit]`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from decodekit import hookimpl
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Sequence
from decodekit.api.stopping import StopDecision, StoppingCriterion


class EosCriterion(StoppingCriterion):
    """Stop at the model's EOS token (unless `ignore_eos`), once `min_tokens` are generated."""

    name = "eos"

    def is_active(self, params: SamplingParams) -> bool:
        return not params.ignore_eos

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        if seq.token_ids[-1] in eos_token_ids and seq.num_generated > params.min_tokens - 1:
            return StopDecision("stop", None)
        return None


class StopTokenIdsCriterion(StoppingCriterion):
    """Stop at any of the request's `stop_token_ids` (the token stays in `token_ids`, as in vLLM)."""

    name = "stop_token_ids"

    def is_active(self, params: SamplingParams) -> bool:
        return bool(params.stop_token_ids)

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        last = seq.token_ids[-1]
        if last in params.stop_token_ids and seq.num_generated >= params.min_tokens:
            return StopDecision("stop", last)
        return None


class MaxTokensCriterion(StoppingCriterion):
    """Stop with finish reason "length" after `max_tokens` generated tokens."""

    name = "max_tokens"

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        return StopDecision("length") if seq.num_generated >= params.max_tokens else None


class StopStringsCriterion(StoppingCriterion):
    """Stop when the decoded text contains a stop string; cut the text before it unless asked to keep it.

    Only the tail that the newest token can have changed is searched, so a match spanning several tokens is found
    on the token that completes it.
    """

    name = "stop_strings"

    def is_active(self, params: SamplingParams) -> bool:
        return bool(params.stop)

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        if seq.num_generated < params.min_tokens:
            return None
        text = seq.text
        new_chars = seq.new_text_len
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        return StopDecision("stop", stop, idx + len(stop) if params.include_stop_str_in_output else idx)


class TimeLimitCriterion(StoppingCriterion):
    """Stop a request `seconds` after it arrived (finish reason "length", stop reason "time_limit").

    The clock starts at arrival, so time spent queued counts: the limit bounds what the caller waits. It is checked
    after each new token, so a request stops on its first token after the deadline.

    Example (recipe): `stopping: [{time_limit: {seconds: 30}}]`
    """

    name = "time_limit"
    example: ClassVar[dict[str, Any]] = {"seconds": 600}

    class Params(BaseModel):
        """Parameters of `time_limit`."""

        model_config = ConfigDict(extra="forbid")

        seconds: float = Field(gt=0, description="Wall-clock seconds from the request's arrival.")

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        if time.perf_counter() - seq.request.arrival_time >= options.seconds:
            return StopDecision("length", "time_limit")
        return None


@hookimpl
def decodekit_register_stopping_criteria(register: Callable[..., None]) -> None:
    """Register the built-in stopping criteria: the default ones (always on; each checks only the requests whose
    parameters use it) and `time_limit`, which applies to the requests that name it."""
    for crit in (EosCriterion, StopTokenIdsCriterion, MaxTokensCriterion, StopStringsCriterion):
        register(crit.name, crit, default=True)
    register(TimeLimitCriterion.name, TimeLimitCriterion)
