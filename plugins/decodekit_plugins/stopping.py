"""Built-in stopping criteria: EOS, stop token ids, max tokens, and stop strings across token boundaries."""

from __future__ import annotations

from typing import Any

from decodekit import hookimpl
from decodekit.core.sequence import Sequence
from decodekit.params import SamplingParams
from decodekit.stopping import StopDecision, StoppingCriterion


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


@hookimpl
def decodekit_register_stopping_criteria(register):  # type: ignore[no-untyped-def]
    """Register the built-in stopping criteria (always on; each checks only the requests that use it)."""
    for crit in (EosCriterion, StopTokenIdsCriterion, MaxTokensCriterion, StopStringsCriterion):
        register(crit.name, crit, default=True)
