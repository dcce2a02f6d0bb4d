"""The process stage: each request's logits processors, in its own order, over the rows of its scored positions.

A sequence scores `1 + len(draft)` positions (speculative verification); row j sees the sequence's history after
its first j draft tokens. Strategies get processed scores from the select stage (or call `ctx.process` on scores
of their own, as beam search does on log-probabilities); proposers use `process_after` for the positions they draft.

Every processor call is guarded (`decodekit.api.processors.apply_processors`), and each processed batch is checked
once for rows with nothing to choose (NaN, +inf, every logit -inf). `process` raises `ProcessorError` naming the
processor, and the select stage then fails only the requests it was serving. `process_after` never raises into a
proposer: a row whose processors fail keeps its raw logits (its draft is never used) and its request is recorded
in `faults`, which the engine fails after the propose stage.
"""

from __future__ import annotations

from typing import Any

import torch

from decodekit.api.processors import BatchView, ProcessorError, Stage, apply_processors, check_processed_rows
from decodekit.api.sequence import Request, Sequence
from decodekit.core import drafts
from decodekit.core.trace import Stages, observer_for


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
        self.trace_rows: dict[Sequence, list[Stages]] = {}
        """This step's per-stage candidates of each traced sequence's rows (`decodekit.core.trace`)."""
        self.kept: dict[Sequence, torch.Tensor] = {}
        """This step's processed rows of the sequences whose requests ask for `processed` logprobs."""
        self.faults: dict[Request, str] = {}
        """Requests whose processors failed in `process_after` since `take_faults` was last called, and why."""

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

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply each request's processors, in order, to the rows of these sequences' scored positions; raise
        `ProcessorError` (naming the processor) when one fails or leaves a row with nothing to choose."""
        view = self.batch_view(seqs)
        positions = [seq for seq in seqs for _ in range(seq.num_scored_positions)]
        pipelines, greedy, states = _pipelines(positions)
        observer = observer_for(logits, positions, self.tokenizer)
        out = apply_processors(logits, view, pipelines, greedy, states, observe=observer)
        check_processed_rows(logits, out, view, pipelines, greedy, states)
        if observer is not None:
            traced: dict[Sequence, list[Stages]] = {}
            for row, stages in sorted(observer.stages.items()):
                traced.setdefault(positions[row], []).append(stages)
            self.trace_rows.update(traced)
        start = 0
        for seq in seqs:
            count = seq.num_scored_positions
            if seq.request.params.logprobs is not None and seq.request.params.logprobs_mode == "processed":
                self.kept[seq] = out[start : start + count]
            start += count
        return out

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


def _pipelines(rows: list[Sequence]) -> tuple[list[tuple[Stage, ...]], list[bool], list[list[Any]]]:
    return ([s.request.plan.stages for s in rows], [s.greedy for s in rows], [s.processor_states for s in rows])
