"""The process stage: each request's logits processors, in its own order, over the rows of its scored positions.

A sequence scores `1 + len(draft)` positions (speculative verification); row j sees the sequence's history after
its first j draft tokens. A sequence with a draft tree scores `1 + len(branch)` positions per branch, each branch's
rows with their own fork of the processor states (`ProcessedRows.branch_states`).
`ProcessStage.run` turns a step's `ScoredRows` into `ProcessedRows`: per strategy, the
scores its `select` receives (`Strategy.scores`: the rows after each request's processors, the processors applied
to log-probabilities, or the raw logits), the processed rows of requests asking for `processed` logprobs, and the
per-stage candidates of traced requests. A strategy with raw scores may call `ctx.process` itself, which adds to
the same output; proposers use `process_after` for the positions they draft.

Every processor call is guarded (`decodekit.api.processors.apply_processors`), and each processed batch is checked
once for rows with nothing to choose (NaN, +inf, every logit -inf). `process` raises `ProcessorError` naming the
processor, and the select stage then fails only the requests it was serving. `process_after` never raises into a
proposer: a row whose processors fail keeps its raw logits (its draft is never used) and its request is recorded
in `faults`, which the engine fails after the propose stage.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from decodekit.api.processors import (
    BatchView,
    ProcessorError,
    Stage,
    apply_processors,
    check_processed_rows,
    fork_states,
)
from decodekit.api.sequence import Request, Sequence
from decodekit.api.strategy import Strategy
from decodekit.core import drafts
from decodekit.core.stages import Failure
from decodekit.core.stages.forward import ScoredRows
from decodekit.core.trace import Stages, observer_for

log = logging.getLogger("decodekit.engine")


@dataclass
class StrategyInput:
    """One strategy call's input: the strategy, the indices of its sequences in the step's `ScoredRows`, and the
    scores it receives (`seq.num_scored_positions` rows per sequence, in that order)."""

    strategy: Strategy
    indices: list[int]
    scores: torch.Tensor

    def part(self, scored: ScoredRows, indices: list[int]) -> torch.Tensor:
        """The rows of the sequences at `indices` (a subset of this input's, in their order)."""
        offsets, start = {}, 0
        for i in self.indices:
            count = scored.seqs[i].num_scored_positions
            offsets[i] = (start, start + count)
            start += count
        spans = [torch.arange(*offsets[i]) for i in indices]
        return self.scores[torch.cat(spans).to(self.scores.device)]


@dataclass
class ProcessedRows:
    """The process stage's output for one step, read by the select stage, logprobs and the trace."""

    inputs: list[StrategyInput] = field(default_factory=list)
    """Each strategy call's scores, strategies in the order their first sequence was scored."""
    kept: dict[Sequence, torch.Tensor] = field(default_factory=dict)
    """The processed rows of the sequences whose requests ask for `processed` logprobs."""
    trace_rows: dict[Sequence, list[Stages]] = field(default_factory=dict)
    """The per-stage candidates of each traced sequence's rows (`decodekit.core.trace`)."""
    failures: list[Failure] = field(default_factory=list)
    """Requests whose processors failed (or left a row with nothing to choose), with the processor named."""
    branch_states: dict[Sequence, list[list[Any]]] = field(default_factory=dict)
    """Per sequence verified with a draft tree, the processor states each branch's rows were scored with (branch 0
    the sequence's own, the others forks of them): the sequence takes its accepted branch's
    (`StepContext.accept_branch`), so a processor that keeps per-position state while scoring sees its own branch."""


class Processing:
    """Builds processors' batch views and applies each request's pipeline.

    Args:
        eos_token_ids: the model's end-of-sequence ids (processors read them from the view).
        device: where logits live.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], device: torch.device | str, tokenizer: Any = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.tokenizer = tokenizer
        self.faults: dict[Request, str] = {}
        """Requests whose processors failed in `process_after` since `take_faults` was last called, and why."""

    def run(self, scored: ScoredRows) -> ProcessedRows:
        """The process stage: each strategy's scores for its sequences' rows. A group whose processors fail is
        processed again request by request, so only the culprits fail (the message names the processor)."""
        out = ProcessedRows()
        groups: dict[int, list[int]] = defaultdict(list)
        for i, seq in enumerate(scored.seqs):
            groups[id(seq.request.plan.strategy)].append(i)
        for indices in groups.values():
            strategy: Strategy = scored.seqs[indices[0]].request.plan.strategy
            try:
                out.inputs.append(self._input(strategy, scored, indices, out))
                continue
            except Exception:
                pass
            by_request: dict[int, list[int]] = defaultdict(list)
            for i in indices:
                by_request[id(scored.seqs[i].request)].append(i)
            for part in by_request.values():
                request = scored.seqs[part[0]].request
                try:
                    out.inputs.append(self._input(strategy, scored, part, out))
                except ProcessorError as exc:  # the message names the processor
                    log.warning("request %s failed: %s", request.request_id, exc)
                    out.failures.append((request, str(exc)))
                except Exception as exc:
                    log.warning("request %s failed in %s: %r", request.request_id, strategy.name, exc)
                    out.failures.append((request, f"{strategy.name} failed: {exc!r}"))
        return out

    def _input(self, strategy: Strategy, scored: ScoredRows, indices: list[int], out: ProcessedRows
               ) -> StrategyInput:
        logits, seqs = scored.rows_of(indices), [scored.seqs[i] for i in indices]
        if strategy.scores == "logits":
            scores = self.process(logits, seqs, out)
        elif strategy.scores == "logprobs":
            scores = self.process(torch.log_softmax(logits.float(), dim=-1), seqs, out)
        else:
            scores = logits
        return StrategyInput(strategy, indices, scores)

    def batch_view(self, seqs: list[Sequence]) -> BatchView:
        """The processors' view of these sequences: one row per scored position (drafts expand a sequence)."""
        params, histories, prompt_lens, offsets, generators = [], [], [], [], []
        for seq in seqs:
            for history, offset in drafts.scored_rows(seq):
                params.append(seq.request.params)
                histories.append(history)
                prompt_lens.append(seq.num_prompt_tokens)
                offsets.append(offset)
                generators.append(seq.generator)
        return BatchView(params, histories, prompt_lens, self.eos_token_ids, self.device,
                         draft_offsets=offsets, generators=generators)

    def process(self, logits: torch.Tensor, seqs: list[Sequence], out: ProcessedRows) -> torch.Tensor:
        """Apply each request's processors, in order, to the rows of these sequences' scored positions, recording
        the rows logprobs and the trace read in `out`; raise `ProcessorError` (naming the processor) when one fails
        or leaves a row with nothing to choose."""
        view = self.batch_view(seqs)
        positions = [seq for seq in seqs for _ in range(seq.num_scored_positions)]
        pipelines, greedy, states = _pipelines(positions)
        if any(seq.draft_branches for seq in seqs):
            states = _branch_states(seqs, out)
        observer = observer_for(logits, positions, self.tokenizer)
        processed = apply_processors(logits, view, pipelines, greedy, states, observe=observer)
        check_processed_rows(logits, processed, view, pipelines, greedy, states)
        if observer is not None:
            traced: dict[Sequence, list[Stages]] = {}
            for row, stages in sorted(observer.stages.items()):
                traced.setdefault(positions[row], []).append(stages)
            out.trace_rows.update(traced)
        start = 0
        for seq in seqs:
            count = seq.num_scored_positions
            if seq.request.params.logprobs is not None and seq.request.params.logprobs_mode == "processed":
                out.kept[seq] = processed[start : start + count]
            start += count
        return processed

    def process_after(self, logits: torch.Tensor, seqs: list[Sequence], extra: list[list[int]],
                      allow_empty_rows: bool = False) -> torch.Tensor:
        """Apply each request's processors to one row per sequence: the position after `seq.token_ids + extra[i]`
        (a proposer scoring its own draft: row i has `len(extra[i])` unverified tokens at the end). A row whose
        processors fail keeps its raw logits and its request goes to `faults`. With `allow_empty_rows`, a row left
        with nothing to choose is not a failure: the proposer's logits cover part of the vocabulary only (a draft
        head's), and a constraint may allow nothing in it."""
        view = BatchView([s.request.params for s in seqs], [s.token_ids + e for s, e in zip(seqs, extra)],
                         [s.num_prompt_tokens for s in seqs], self.eos_token_ids, logits.device,
                         draft_offsets=[len(e) for e in extra], generators=[s.generator for s in seqs])
        pipelines, greedy, states = _pipelines(seqs)
        try:
            out = apply_processors(logits, view, pipelines, greedy, states)
            if not allow_empty_rows:
                check_processed_rows(logits, out, view, pipelines, greedy, states)
            return out
        except ProcessorError:
            pass
        rows = []  # the slow path, only after a failure: row by row, so that only the culprits fail
        for r, seq in enumerate(seqs):
            one = view.select([r])
            try:
                row = apply_processors(logits[r : r + 1], one, [pipelines[r]], [greedy[r]], [states[r]])
                if not allow_empty_rows:
                    check_processed_rows(logits[r : r + 1], row, one, [pipelines[r]], [greedy[r]], [states[r]])
            except ProcessorError as exc:
                self.faults.setdefault(seq.request, str(exc))
                row = logits[r : r + 1]
            rows.append(row)
        return torch.cat(rows)

    def take_faults(self) -> list[tuple[Request, str]]:
        """The requests whose processors failed in `process_after`, and why; forgets them."""
        faults, self.faults = list(self.faults.items()), {}
        return faults


def _branch_states(seqs: list[Sequence], out: ProcessedRows) -> list[list[Any]]:
    """Each row's processor states when some sequences have draft trees: a tree's branches after the first get
    forks of the sequence's states (stateful processors group a sequence's rows by state object and keep
    per-position values in it, so each branch must have its own), recorded in `out.branch_states`."""
    states: list[list[Any]] = []
    for seq in seqs:
        if not seq.draft_branches:
            states.extend([seq.processor_states] * seq.num_scored_positions)
            continue
        stages = seq.request.plan.stages
        per_branch = [seq.processor_states] + [fork_states(stages, seq.processor_states)
                                               for _ in seq.draft_branches[1:]]
        out.branch_states[seq] = per_branch
        for branch, branch_states in zip(seq.draft_branches, per_branch):
            states.extend([branch_states] * (1 + len(branch)))
    return states


def _pipelines(rows: list[Sequence]) -> tuple[list[tuple[Stage, ...]], list[bool], list[list[Any]]]:
    return ([s.request.plan.stages for s in rows], [s.greedy for s in rows], [s.processor_states for s in rows])
