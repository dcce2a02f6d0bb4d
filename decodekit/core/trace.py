"""The decoding trace (`SamplingParams(trace=N)`): for each generated token, what every stage did to the candidates,
how the token was chosen and what was drafted; then why the sequence stopped.

Each event is a JSON-ready dict appended to `seq.trace`:

- a token event: `{"index": i, "token": id, "text": str, "chosen_by": "argmax" | "sampled" | "sampled, seed S" |
  "draft accepted" | "beam search", "strategy": name, "stages": [{"stage": "model" | <processor>, "top": [[id,
  text, p], ...], "p": chosen_p}, ...]}` and, on the first token of a speculative step, `"drafts": {"proposed":
  [...], "proposed_text": [...], "accepted": k, "produced": n, "proposer": name}` (`produced`: the tokens the step
  appended, accepted drafts and the target's own; a stop among them drops the events after it; a draft tree's step
  proposed its kept branch and adds `"tree_branches"`, `"branch"` (the kept one) and `"tree_nodes"`). `stages` holds
  the `N` most likely candidates (with probabilities; tokens a stage removed are left out) of the model's logits
  and after each processor stage of the row the token was chosen from, and the chosen token's own probability
  `p` there; a greedy row skips trailing argmax-invariant stages, so they do not appear. What the strategy noted
  this step (`StepContext.note`) is merged into the first event of the step: beam search adds `"beam": {"parent":
  p, "index": i, "score": s}` (this beam continues beam p of the previous step and is beam i now, with running
  score s; a finished hypothesis has `"index": null` and `"final_score"`) and `"beams": {"candidates": [{"parent",
  "token", "text", "score", "fate": "kept" | "finished" | "dropped"}, ...], "pruned": [...]}` (the request's whole
  step, shared by its beams; `pruned`: the previous step's beams with no continuation kept as a beam). A reasoning
  request's token events name the token's `"phase"` (`thinking`, `answer`, ... or `marker`) and carry `"forced":
  true` where its phase's budget (or the format's opening) forced it.
- the stop event, last: `{"finished": reason, "stop_reason": ..., "criterion": name}` (the stopping criterion, the
  strategy or `max_model_len` that finished the sequence), `{"finished": "error", "error": message}` or
  `{"finished": "abort"}`.

Only rows of traced requests are looked at; with no traced request in a batch, nothing here runs.
"""

from __future__ import annotations

from typing import Any

import torch

from decodekit.api.sequence import Sequence
from decodekit.core.logprobs import row_source, token_text
from decodekit.core.phases import PhaseState, phase_state

Stages = list[dict[str, Any]]


def wants_trace(seq: Sequence) -> bool:
    """Whether this sequence's request asks for the trace."""
    return seq.request.params.trace is not None


def top_candidates(probs: torch.Tensor, count: int, tokenizer: Any) -> list[list[Any]]:
    """The `count` most likely tokens of one row of probabilities, `[id, text, probability]` each; tokens a stage
    removed (probability 0) are left out, so a truncating stage lists fewer."""
    values, ids = probs.topk(min(count, probs.shape[-1]))
    return [[i, token_text(tokenizer, i), round(v, 6)] for v, i in zip(values.tolist(), ids.tolist()) if v > 0]


class StageObserver:
    """Collects, for the traced rows of one `apply_processors` call, the top candidates at each stage (and each
    stage's probabilities, until the chosen token's own probability is read off them in `record_tokens`)."""

    def __init__(self, raw: torch.Tensor, traced: dict[int, int], tokenizer: Any) -> None:
        self.traced = traced  # row -> candidates to keep
        self.tokenizer = tokenizer
        self.stages: dict[int, Stages] = {row: [] for row in traced}
        for row in traced:
            self._add(row, "model", raw[row])

    def _add(self, row: int, name: str, logits: torch.Tensor) -> None:
        probs = torch.softmax(logits.float(), dim=-1)
        self.stages[row].append({"stage": name, "top": top_candidates(probs, self.traced[row], self.tokenizer),
                                 _PROBS: probs})

    def __call__(self, name: str, rows: list[int], out: torch.Tensor) -> None:
        for i, row in enumerate(rows):
            if row in self.traced:
                self._add(row, name, out[i])


_PROBS = "_probs"
"""A stage's probabilities, kept in its dict until the token is chosen; never written out."""


def observer_for(raw: torch.Tensor, positions: list[Sequence], tokenizer: Any) -> StageObserver | None:
    """An observer for `apply_processors` (its `observe`) over rows `positions` (one sequence per row), or None
    when no row is traced."""
    traced = {row: seq.request.params.trace for row, seq in enumerate(positions) if wants_trace(seq)}
    if not traced:
        return None
    return StageObserver(raw, {row: int(count or 1) for row, count in traced.items()}, tokenizer)


def record_tokens(stages: dict[Sequence, list[Stages]], drafts: dict[Sequence, list[int]],
                  appended: dict[Sequence, int], parents: dict[Sequence, Sequence], tokenizer: Any,
                  notes: dict[Sequence, dict[str, Any]] | None = None) -> None:
    """Append a token event for every token a traced sequence got this step (the select stage's record), with what
    the strategy noted about the sequence (`notes`) merged into the step's first event."""
    for seq, count in appended.items():
        if not wants_trace(seq) or count == 0:
            continue
        source = row_source(seq, stages, parents)
        rows = stages.get(source, [])
        proposed = drafts.get(source, [])
        params = seq.request.params
        if seq.trace is None:
            seq.trace = []
        first_index = seq.num_generated - count
        phases = phase_state(seq)
        for j, token in enumerate(seq.token_ids[-count:]):
            if j < count - 1:
                how = "draft accepted"
            elif params.greedy:
                how = "argmax"
            else:  # a seeded request's forks draw from their own seeds (seed + k)
                how = "sampled" if seq.generator is None else f"sampled, seed {seq.generator.initial_seed()}"
            event: dict[str, Any] = {"index": first_index + j, "token": token, "text": token_text(tokenizer, token),
                                     "chosen_by": how,
                                     "strategy": seq.request.plan.strategy.name,
                                     "stages": _with_chosen(rows[j], token) if j < len(rows) else []}
            if phases is not None:
                _phase_facts(event, phases, first_index + j)
            if j == 0 and proposed:
                event["drafts"] = {"proposed": list(proposed), "proposed_text": [token_text(tokenizer, t)
                                                                                 for t in proposed],
                                   "accepted": count - 1, "produced": count}
            if j == 0 and notes and seq in notes:
                _merge(event, notes[seq])
            seq.trace.append(event)


def _phase_facts(event: dict[str, Any], state: PhaseState, index: int) -> None:
    """A reasoning request's token: the phase it was written in (or `marker`), and whether it was forced."""
    if index < len(state.labels):
        event["phase"] = state.labels[index] or "marker"
    if index in state.forced_at:
        event["forced"] = True


def _with_chosen(stages: Stages, token: int) -> Stages:
    """The stages of the row a token was chosen from, each with that token's own probability (`p`: it may be
    outside the top candidates), without the probabilities kept for reading it."""
    out = []
    for stage in stages:
        probs = stage.get(_PROBS)
        out.append({"stage": stage["stage"], "top": stage["top"],
                    "p": round(float(probs[token]), 6) if probs is not None else None})
    return out


def _merge(event: dict[str, Any], facts: dict[str, Any]) -> None:
    for key, value in facts.items():
        if isinstance(value, dict) and isinstance(event.get(key), dict):
            event[key] = {**event[key], **value}
        else:
            event[key] = value


def record_stops(appended: dict[Sequence, int], finished_by: dict[Sequence, str]) -> None:
    """After the stop stage: drop the events of tokens it removed (a stop inside a run of accepted drafts), and add
    a stop event to every traced sequence that finished this step, naming what finished it (`finished_by`)."""
    for seq in appended:
        if seq.trace is None:
            continue
        while seq.trace and seq.trace[-1].get("index", -1) >= seq.num_generated:
            seq.trace.pop()
        if seq.finished and not _ended(seq):
            seq.trace.append({"finished": seq.finish_reason, "stop_reason": seq.stop_reason,
                              "criterion": finished_by.get(seq)})


def record_end(seq: Sequence, reason: str, error: str | None = None) -> None:
    """The stop event of a traced sequence ended from outside the step's stages: `abort`, or `error` with the
    message (a request that failed)."""
    if seq.trace is None and not wants_trace(seq):
        return
    if seq.trace is None:
        seq.trace = []
    if not _ended(seq):
        seq.trace.append({"finished": reason, "error": error} if error is not None else {"finished": reason})


def _ended(seq: Sequence) -> bool:
    return bool(seq.trace) and "finished" in seq.trace[-1]  # type: ignore[index]
