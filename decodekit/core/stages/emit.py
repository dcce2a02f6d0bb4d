"""The emit stage: build each request's output for this step (stream deltas, or the final output).

Streamed text is held back while it may still turn out to be the start of a stop string. A request that completes
(during a step, or between steps: an abort, a request refused at submission) is queued, and its final output is
built and returned by the next `emit`: built then, not when it completed, so that what the step records after a
strategy finished the request (the logprobs and trace events of beam search's last hypotheses) is in it. This
module owns what has been streamed to the caller (per sequence: characters and tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decodekit.api.sequence import CompletionOutput, Request, RequestOutput, Sequence, TokenLogprobs
from decodekit.core.phase_outputs import PhaseText, decoded_split
from decodekit.core.phases import phase_state
from decodekit.core.step_context import StepRecord


@dataclass
class _StreamCursor:
    text_len: int = 0  # characters already streamed
    token_count: int = 0  # generated tokens already streamed
    phases: PhaseText | None = None  # a reasoning request's text split so far (`decodekit.core.phase_outputs`)


class OutputEmitter:
    """Builds `RequestOutput`s.

    Args:
        tokenizer: decodes a strategy's final results (beam hypotheses).
        on_final: called with each request's final output as it is queued (the `decodekit_request_finished` hook).
    """

    def __init__(self, tokenizer: Any, on_final: Callable[[Request, RequestOutput], None]) -> None:
        self.tokenizer = tokenizer
        self.on_final = on_final
        self._finals: list[Request] = []
        self._cursors: dict[str, dict[int, _StreamCursor]] = {}  # request id -> seq id -> what was streamed

    def has_pending(self) -> bool:
        """Whether final outputs are queued for the next `emit`."""
        return bool(self._finals)

    def final(self, request: Request) -> None:
        """Queue a completed request: its final output comes with the next `emit`."""
        self._finals.append(request)

    def emit(self, record: StepRecord) -> list[RequestOutput]:
        """This step's outputs: the queued finals, then a delta for every other request that got tokens."""
        finals, self._finals = self._finals, []
        outputs = []
        for request in finals:
            output = self._output(request, final=True)
            self._cursors.pop(request.request_id, None)
            outputs.append(output)
            self.on_final(request, output)
        done = {o.request_id for o in outputs}
        for request in record.requests():
            strategy = request.plan.strategy
            if request.request_id not in done and not request.finished and not request.final_only and not (
                    strategy.handles_stopping or strategy.finalizes):
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
                CompletionOutput(i, _result_text(request, r, self.tokenizer, skip), list(r.token_ids), r.finish_reason,
                                 r.stop_reason, score=r.score, **_recorded(request, r.sequence))
                for i, r in enumerate(request.results)
            ]
            if request.plan is not None and request.plan.phases is not None:
                for out, result in zip(outputs, request.results):
                    _split_result(request, result, out, self.tokenizer)
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, final,
                                 request.metrics, request.error, [o.text for o in outputs],
                                 [o.token_ids for o in outputs], _prompt_logprobs(request),
                                 [o.reasoning_text or "" for o in outputs] if outputs and
                                 outputs[0].reasoning_text is not None else None)
        cursors = self._cursors.setdefault(request.request_id, {})
        outputs, deltas, delta_ids = [], [], []
        phased = request.plan is not None and request.plan.phases is not None
        thinking: list[str] | None = [] if phased else None
        for index, seq in enumerate(request.sequences):
            cursor = cursors.setdefault(seq.seq_id, _StreamCursor())
            visible = seq.text[: max(0, len(seq.text) - self._holdback(seq))]
            delta_ids.append(seq.generated_ids[cursor.token_count :])
            cursor.token_count = seq.num_generated
            output = CompletionOutput(index, visible if not seq.finished else seq.text, seq.generated_ids,
                                      seq.finish_reason, seq.stop_reason, **_recorded(request, seq))
            if thinking is not None:  # the answer streams as the text, the thinking apart
                split = cursor.phases = cursor.phases or PhaseText()
                reasoning, answer = split.advance(seq, seq.text if seq.finished else visible, seq.finished)
                deltas.append(answer)
                thinking.append(reasoning)
                output.text, output.reasoning_text = split.answer, split.reasoning
                output.reasoning_token_count = split.reasoning_tokens
            else:
                deltas.append(visible[cursor.text_len :])
                cursor.text_len = max(cursor.text_len, len(visible))
            outputs.append(output)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, final,
                             request.metrics, request.error, deltas, delta_ids, _prompt_logprobs(request), thinking)


def _result_text(request: Request, result: Any, tokenizer: Any, skip_special_tokens: bool) -> str:
    """A strategy result's text: its sequence's own (the stop stage detokenized it and cut stop strings) when the
    result is that sequence's output as generated by a strategy the stop stage ran for, else its tokens decoded."""
    seq = result.sequence
    if (seq is not None and seq.finished and not request.plan.strategy.handles_stopping
            and list(result.token_ids) == seq.generated_ids):
        return str(seq.text)
    return str(tokenizer.decode(result.token_ids, skip_special_tokens=skip_special_tokens))


def _split_result(request: Request, result: Any, out: CompletionOutput, tokenizer: Any) -> None:
    """A reasoning request's result split into its answer (`text`) and its thinking: from its sequence's text where
    that is the result's text (as `_result_text` decides), else by decoding each phase's tokens."""
    seq = result.sequence
    state = phase_state(seq) if seq is not None else None
    if state is None:
        return
    if out.text == seq.text and list(result.token_ids) == seq.generated_ids:
        split = PhaseText()
        split.advance(seq, seq.text, final=True)
    else:
        split = decoded_split(state, list(result.token_ids), tokenizer, request.params.skip_special_tokens)
    out.text, out.reasoning_text, out.reasoning_token_count = split.answer, split.reasoning, split.reasoning_tokens


def _recorded(request: Request, seq: Sequence | None) -> dict[str, Any]:
    """The logprobs and trace fields of an output made from `seq`: none where the request did not ask for them, or
    for a strategy's result that has no sequence."""
    if seq is None:
        return {}
    fields: dict[str, Any] = {}
    if request.params.logprobs is not None:
        fields.update(cumulative_logprob=seq.cumulative_logprob, logprobs=list(seq.logprobs or []))
    if request.params.trace is not None:
        fields["trace"] = list(seq.trace or [])
    return fields


def _prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
    if request.params.prompt_logprobs is None:
        return None
    return list(request.prompt_logprobs or [None])
