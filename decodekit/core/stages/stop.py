"""The stop stage: detokenize each new token and run the request's stopping criteria on it.

A step can bring several tokens to one sequence (accepted drafts): each is checked in turn and the tokens after a
stop are dropped. The criteria are the request's plan (`Plan.criteria`: the default ones its parameters switch
on, then the ones it names), checked in that order; the context limit applies to every request. Strategies that
`handles_stopping` (beam search) finish their own sequences and are skipped here.

This module owns a sequence's text (`detokenizer`, `text`, `new_text_len`) and how it finishes
(`finish_sequence`: reason, stop reason, final text).
"""

from __future__ import annotations

import time

from decodekit.api.sequence import Request, Sequence
from decodekit.api.stopping import StopDecision
from decodekit.core.logprobs import trim_logprobs
from decodekit.core.phase_outputs import record_text_end
from decodekit.core.scheduler import Scheduler
from decodekit.core.stages import Failure
from decodekit.core.step_context import StepRecord
from decodekit.core.trace import record_stops


class _CriterionFailed(Exception):
    """A stopping criterion raised or returned something that is not a decision."""


def append_text(seq: Sequence) -> None:
    """Detokenize the sequence's newest token: `text` grows by it and `new_text_len` is how much it added, what the
    stopping criteria then read (the stopping kit replays sequences through this too)."""
    delta = seq.detokenizer.add(seq.token_ids[-1:])
    seq.new_text_len = len(delta)
    seq.text = seq.detokenizer.text


class StopStage:
    """Checks new tokens against stopping criteria and finishes sequences.

    Args:
        scheduler: releases a finished sequence's blocks.
        eos_token_ids: the model's end-of-sequence ids, given to every criterion.
        max_model_len: the context limit (finish reason "length").
    """

    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def run(self, record: StepRecord) -> tuple[list[Request], list[Failure]]:
        """Check every token this step appended; return the requests that are now complete, and those whose
        stopping criterion failed (it raised, or returned something that is not a decision). The logprobs and trace
        events of tokens a stop removed again go with them, and each traced sequence that finished gets its stop
        event."""
        now = time.perf_counter()
        failures: list[Failure] = []
        for seq, count in record.appended.items():
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if seq.finished or request.plan.strategy.handles_stopping:
                continue
            new_tokens = seq.token_ids[len(seq.token_ids) - count :]
            del seq.token_ids[len(seq.token_ids) - count :]
            for token in new_tokens:
                seq.token_ids.append(token)
                try:
                    if self._check(seq, record):
                        break
                except _CriterionFailed as exc:
                    failures.append((request, str(exc)))
                    break
        trim_logprobs(record.appended)
        record_stops(record.appended, record.finished_by)
        done = []
        for request in record.requests():
            request.metrics.count_outputs([len(r.token_ids) for r in request.results] if request.results is not None
                                          else [s.num_generated for s in request.sequences])
            if request.finished and request.error is None:
                done.append(request)
        return done, failures

    def _check(self, seq: Sequence, record: StepRecord) -> bool:
        request = seq.request
        append_text(seq)
        if request.plan.phases is not None:  # a reasoning request: where each token's text ends, to split it
            record_text_end(seq)
        # A stop on this token beats a length limit on the same token (vLLM's order: EOS, stop ids, stop strings,
        # then max_tokens), so a criterion's text trimming is not lost to max_tokens.
        length: tuple[StopDecision, str] | None = None
        for criterion in request.plan.criteria:
            try:
                decision = criterion.check(seq, request.params, self.eos_token_ids)
            except Exception as exc:  # a plugin's criterion fails its request, not the engine
                raise _CriterionFailed(f"stopping criterion {criterion.criterion.name!r} failed: {exc!r}") from exc
            if decision is not None and not isinstance(decision, StopDecision):
                raise _CriterionFailed(f"stopping criterion {criterion.criterion.name!r} returned "
                                       f"{type(decision).__name__}, not a StopDecision or None")
            if decision is not None and decision.finish_reason == "length":
                length = length or (decision, criterion.criterion.name)
            elif decision is not None:
                self._finish_with(seq, decision)
                record.finished_by[seq] = criterion.criterion.name
                return True
        if length is not None:
            self._finish_with(seq, length[0])
            record.finished_by[seq] = length[1]
            return True
        if len(seq.token_ids) >= self.max_model_len:
            self.finish_sequence(seq, "length")
            record.finished_by[seq] = "max_model_len"
            return True
        return False

    def _finish_with(self, seq: Sequence, decision: StopDecision) -> None:
        cut = decision.truncate_text_at
        self.finish_sequence(seq, decision.finish_reason, decision.stop_reason,
                             None if cut is None else seq.text[:cut])

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: str | int | None = None,
                        text: str | None = None) -> None:
        """Finish a sequence: its final text (the detokenizer flushed, or `text`), reasons, and its blocks freed."""
        if text is None:
            seq.detokenizer.flush()
            text = seq.detokenizer.text
        seq.text = text
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish_sequence(seq)
