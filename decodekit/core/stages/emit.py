"""The emit stage: build each request's output for this step (stream deltas, or the final output).

Streamed text is held back while it may still turn out to be the start of a stop string. Final outputs are queued
when a request completes (during a step, or between steps: an abort, a request refused at submission) and returned
by the next `emit`. This module owns what has been streamed to the caller (per sequence: characters and tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decodekit.api.sequence import CompletionOutput, Request, RequestOutput, Sequence, TokenLogprobs
from decodekit.core.step_context import StepRecord


@dataclass
class _StreamCursor:
    text_len: int = 0  # characters already streamed
    token_count: int = 0  # generated tokens already streamed


class OutputEmitter:
    """Builds `RequestOutput`s.

    Args:
        tokenizer: decodes a strategy's final results (beam hypotheses).
        on_final: called with each request's final output as it is queued (the `decodekit_request_finished` hook).
    """

    def __init__(self, tokenizer: Any, on_final: Callable[[Request, RequestOutput], None]) -> None:
        self.tokenizer = tokenizer
        self.on_final = on_final
        self._finals: list[RequestOutput] = []
        self._cursors: dict[str, dict[int, _StreamCursor]] = {}  # request id -> seq id -> what was streamed

    def has_pending(self) -> bool:
        """Whether final outputs are queued for the next `emit`."""
        return bool(self._finals)

    def final(self, request: Request) -> None:
        """Queue a completed request's final output."""
        output = self._output(request, final=True)
        self._cursors.pop(request.request_id, None)
        self._finals.append(output)
        self.on_final(request, output)

    def emit(self, record: StepRecord) -> list[RequestOutput]:
        """This step's outputs: the queued finals, then a delta for every other request that got tokens."""
        outputs, self._finals = self._finals, []
        done = {o.request_id for o in outputs}
        for request in record.requests():
            if request.request_id not in done and not request.finished and not request.plan.strategy.handles_stopping:
                outputs.append(self._output(request, final=False))
        return outputs

    @staticmethod
    def _holdback(seq: Sequence) -> int:
        # Text that may still turn out to be the start of a stop string is not streamed yet.
        stops = seq.request.params.stop
        return 0 if seq.finished or not stops else max(len(s) for s in stops) - 1

    def _output(self, request: Request, final: bool) -> RequestOutput:
        if request.results is not None:
            skip = request.params.skip_special_tokens
            outputs = [
                CompletionOutput(i, self.tokenizer.decode(r.token_ids, skip_special_tokens=skip),
                                 list(r.token_ids), r.finish_reason, r.stop_reason, score=r.score)
                for i, r in enumerate(request.results)
            ]
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, final,
                                 request.metrics, request.error, [o.text for o in outputs],
                                 [o.token_ids for o in outputs], _prompt_logprobs(request))
        cursors = self._cursors.setdefault(request.request_id, {})
        outputs, deltas, delta_ids = [], [], []
        for index, seq in enumerate(request.sequences):
            cursor = cursors.setdefault(seq.seq_id, _StreamCursor())
            visible = seq.text[: max(0, len(seq.text) - self._holdback(seq))]
            deltas.append(visible[cursor.text_len :])
            delta_ids.append(seq.generated_ids[cursor.token_count :])
            cursor.text_len = max(cursor.text_len, len(visible))
            cursor.token_count = seq.num_generated
            asked = request.params.logprobs is not None
            outputs.append(CompletionOutput(index, visible if not seq.finished else seq.text, seq.generated_ids,
                                            seq.finish_reason, seq.stop_reason,
                                            cumulative_logprob=seq.cumulative_logprob if asked else None,
                                            logprobs=list(seq.logprobs or []) if asked else None,
                                            trace=list(seq.trace or []) if request.params.trace else None))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, final,
                             request.metrics, request.error, deltas, delta_ids, _prompt_logprobs(request))


def _prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
    if request.params.prompt_logprobs is None:
        return None
    return list(request.prompt_logprobs or [None])
