"""The `--trace` file's row, both ways: `trace_row` writes one (`decodekit run RECIPE --trace FILE.jsonl` writes
one per request, through `recipe_runner.trace_row`) and `read_trace` reads a file of them back into `TraceRequest`s,
naming the line of anything it cannot read.

A row is one JSON line per request: `{"id", "prompt", "error", "outputs": [{"index", "text", "token_ids",
"finish_reason", "score", "cumulative_logprob", "trace": [events...]}]}`, the events described in
`decodekit/core/trace.py` (one per generated token, then a stop event). The reader asks only for what the views
use: `outputs`, and in each output its `trace`; every other key may be missing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decodekit.api.errors import DecodeKitError

if TYPE_CHECKING:  # torch comes with it: `decodekit trace` reads files without loading torch
    from decodekit.api.sequence import RequestOutput

__all__ = [
    "TraceFileError",
    "TraceOutput",
    "TraceRequest",
    "TraceStep",
    "read_trace",
    "trace_row",
]


# ---------------------------------------------------------------------------------------------------- writing


def trace_row(request_id: str, prompt: str, output: RequestOutput) -> dict[str, Any]:
    """One JSON line of a trace file: the request (`request_id`, `prompt`, the error if it failed), and each returned
    sequence's text, tokens, scores and trace events (`CompletionOutput.trace`)."""
    return {"id": request_id, "prompt": prompt, "error": output.error,
            "outputs": [{"index": o.index, "text": o.text, "token_ids": list(o.token_ids),
                         "finish_reason": o.finish_reason, "score": o.score,
                         "cumulative_logprob": o.cumulative_logprob, "trace": o.trace} for o in output.outputs]}


# ---------------------------------------------------------------------------------------------------- reading


class TraceFileError(DecodeKitError):
    """A trace file that cannot be read: missing, not JSON lines, or a line that is not a `--trace` row. The
    message names the file and the line."""


@dataclass
class TraceStep:
    """One generated token's event: the token, how it was chosen, each stage's top candidates, and what the
    strategy did at this step (drafts, beams)."""

    index: int
    token: int
    text: str | None
    chosen_by: str
    strategy: str
    stages: list[dict[str, Any]]
    """`[{"stage": name, "top": [[id, text, p], ...]}, ...]`: the model first, then each processor stage."""
    drafts: dict[str, Any] | None = None
    beam: dict[str, Any] | None = None
    beams: dict[str, Any] | None = None

    @property
    def probability(self) -> float | None:
        """The chosen token's probability at the last stage (the distribution it was chosen from), or None when
        the trace does not hold it (no stage, or the token is not among the last stage's candidates)."""
        return self.stage_probability(len(self.stages) - 1) if self.stages else None

    def stage_probability(self, stage: int) -> float | None:
        """The chosen token's probability at stage `stage` (the stage's `p`; in older files, read off its
        candidates), or None when the trace does not hold it."""
        if self.stages[stage].get("p") is not None:
            return float(self.stages[stage]["p"])
        for cand in self.stages[stage]["top"]:
            if cand[0] == self.token:
                return float(cand[2])
        return None


@dataclass
class TraceOutput:
    """One returned sequence of a request: its text, its steps, and its stop event."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    steps: list[TraceStep]
    stop: dict[str, Any] | None
    """The last event, `{"finished": reason, "stop_reason": ..., "criterion": name}` (or with `"error"`), if any."""
    traced: bool = True
    """False when the row holds no trace for this output (the request did not ask, or failed first)."""


@dataclass
class TraceRequest:
    """One line of a trace file: a request and its outputs."""

    id: str
    prompt: Any
    error: str | None
    outputs: list[TraceOutput]
    line: int
    """The line of the file it came from (1-based)."""
    position: int = 0
    """Its position among the file's requests (0-based)."""
    token_texts: dict[int, str | None] = field(default_factory=dict)
    """Every token text the row names (tokens and candidates), by id: the texts of drafts the model rejected."""


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a `--trace` file: one request per non-blank line. Raises `TraceFileError` naming the line for a file
    that is missing, is not JSON lines, or holds a line that is not a trace row."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file (write one with `decodekit run RECIPE --trace {path}`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"{path}: cannot read it: {exc}") from None
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFileError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        requests.append(_request(row, where, number, len(requests)))
    if not requests:
        raise TraceFileError(f"{path}: no requests in it (an empty file)")
    return requests
def _request(row: Any, where: str, number: int, position: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise TraceFileError(f"{where}: not a trace row (a JSON {type(row).__name__}, not an object)")
    if not isinstance(row.get("outputs"), list):
        hint = " (is this an --output file? write a trace with `decodekit run RECIPE --trace FILE`)"
        raise TraceFileError(f'{where}: no "outputs" list{hint if "token_ids" in row else ""}; a trace row is '
                             '{"id", "prompt", "outputs": [{"index", "text", "token_ids", "trace"}]}')
    texts: dict[int, str | None] = {}
    outputs = [_output(out, f"{where}: outputs[{i}]", i, texts) for i, out in enumerate(row["outputs"])]
    error = row.get("error")
    return TraceRequest(id=str(row.get("id", position + 1)), prompt=row.get("prompt"),
                        error=None if error is None else str(error), outputs=outputs, line=number,
                        position=position, token_texts=texts)


def _output(out: Any, where: str, position: int, texts: dict[int, str | None]) -> TraceOutput:
    if not isinstance(out, dict):
        raise TraceFileError(f"{where}: not an object")
    events = out.get("trace")
    if events is not None and not isinstance(events, list):
        raise TraceFileError(f'{where}: "trace" is not a list of events')
    steps: list[TraceStep] = []
    stop: dict[str, Any] | None = None
    for k, event in enumerate(events or []):
        if not isinstance(event, dict):
            raise TraceFileError(f"{where}.trace[{k}]: not an object")
        if "finished" in event:
            stop = event
        elif "token" in event:
            steps.append(_step(event, f"{where}.trace[{k}]", len(steps), texts))
        else:
            raise TraceFileError(f'{where}.trace[{k}]: neither a token event ("token") nor a stop event '
                                 '("finished")')
    token_ids = out.get("token_ids") or [s.token for s in steps]
    return TraceOutput(index=int(out.get("index", position)), text=str(out.get("text") or ""),
                       token_ids=list(token_ids), finish_reason=out.get("finish_reason"), steps=steps, stop=stop,
                       traced=events is not None)


def _step(event: dict[str, Any], where: str, position: int, texts: dict[int, str | None]) -> TraceStep:
    try:
        stages = event.get("stages") or []
        for stage in stages:
            for cand in stage["top"]:
                texts.setdefault(int(cand[0]), cand[1])
                cand[2] = float(cand[2]) if math.isfinite(float(cand[2])) else 0.0  # NaN cannot go into JSON
        token = int(event["token"])
        texts.setdefault(token, event.get("text"))
        return TraceStep(index=int(event.get("index", position)), token=token, text=event.get("text"),
                         chosen_by=str(event.get("chosen_by", "?")), strategy=str(event.get("strategy", "?")),
                         stages=stages, drafts=event.get("drafts"), beam=event.get("beam"),
                         beams=event.get("beams"))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TraceFileError(f"{where}: a malformed token event ({type(exc).__name__}: {exc})") from None
