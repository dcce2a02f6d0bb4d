"""The forward stage: one packed forward pass over every scheduled token, logits only where scores are needed.

Input: the scheduler's decision. Output: `ScoredRows`, the sequences whose pending tokens completed this step
(each with `num_scored_positions` rows of logits: one, plus one per draft token), and the requests that failed.
After the pass the scheduler advances each sequence's computed tokens.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decodekit.api.sequence import Request, Sequence
from decodekit.api.strategy import HiddenStates
from decodekit.core import drafts
from decodekit.core.scheduler import (
    ScheduledSequence,
    Scheduler,
    SchedulerOutput,
    needs_prompt_logits,
    wants_hidden_states,
)
from decodekit.core.stages import Failure
from decodekit.execution import ForwardItem, ModelExecutor

log = logging.getLogger("decodekit.engine")



@dataclass
class ScoredRows:
    """Logits for the sequences whose pending tokens completed: `seq.num_scored_positions` rows each, in order."""

    seqs: list[Sequence]
    logits: torch.Tensor
    hidden: dict[Sequence, HiddenStates] = field(default_factory=dict)
    """The last hidden states of the sequences whose strategies read them (`Strategy.hidden_states`)."""

    def __post_init__(self) -> None:
        self.starts: list[int] = []
        self.index: dict[Sequence, int] = {}
        offset = 0
        for i, seq in enumerate(self.seqs):
            self.starts.append(offset)
            self.index[seq] = i
            offset += seq.num_scored_positions

    def rows_for(self, seq: Sequence) -> torch.Tensor | None:
        """One scored sequence's rows (None if it was not scored this step)."""
        i = self.index.get(seq)
        if i is None:
            return None
        end = self.starts[i + 1] if i + 1 < len(self.seqs) else self.logits.shape[0]
        return self.logits[self.starts[i] : end]

    def rows_by_sequence(self, wanted: Callable[[Sequence], bool]) -> dict[Sequence, torch.Tensor]:
        """Each wanted sequence's rows (as scored: drafts the strategy has since cleared still count)."""
        ends = [*self.starts[1:], self.logits.shape[0]]
        return {seq: self.logits[start:end] for seq, start, end in zip(self.seqs, self.starts, ends) if wanted(seq)}

    def rows_of(self, indices: list[int]) -> torch.Tensor:
        """The logits rows of the sequences at these indices (in that order)."""
        if len(indices) == len(self.seqs):
            return self.logits
        spans = [torch.arange(self.starts[i], self.starts[i] + self.seqs[i].num_scored_positions) for i in indices]
        return self.logits[torch.cat(spans).to(self.logits.device)]


class ForwardStage:
    """Turns a `SchedulerOutput` into model inputs, runs the model, and reports progress to the scheduler.

    Args:
        model: the model and its paged KV pool; its allocator is read for block tables and pending copy-on-write
            copies.
        scheduler: told how far each sequence got.
    """

    def __init__(self, model: ModelExecutor, scheduler: Scheduler,
                 on_prompt_rows: Callable[[Request, int, torch.Tensor], None] | None = None) -> None:
        self.model = model
        self.allocator = model.allocator
        self.scheduler = scheduler
        self.on_prompt_rows = on_prompt_rows
        # hidden states of a chunked prompt's earlier chunks, until its last chunk completes: (start, [rows])
        self._chunks: weakref.WeakKeyDictionary[Sequence, tuple[int, list[torch.Tensor]]] = \
            weakref.WeakKeyDictionary()

    def run(self, sched: SchedulerOutput) -> tuple[ScoredRows | None, list[Failure]]:
        """Run the scheduled work; a failed forward fails this step's requests, not the engine."""
        if sched.empty:
            return None, []
        # a chunk of a prompt whose request wants prompt logprobs has logits at every position
        prompt_rows = [_prompt_rows(s) if self.on_prompt_rows is not None else 0 for s in sched.scheduled]
        items = [
            ForwardItem(drafts.pending_tokens(s.seq, s.seq.num_computed_tokens, s.num_tokens),
                        s.seq.num_computed_tokens, self.allocator.block_table(s.seq.seq_id),
                        s.num_tokens if rows else s.seq.num_scored_positions if s.completes else 0,
                        s.num_tokens if wants_hidden_states(s.seq.request) else 0)
            for s, rows in zip(sched.scheduled, prompt_rows)
        ]
        try:
            logits, hidden = self.model.run(items, self.allocator.take_pending_copies())
        except Exception as exc:
            log.exception("forward pass failed")
            requests = {s.seq.request.request_id: s.seq.request for s in sched.scheduled}.values()
            return None, [(request, f"model forward failed: {exc!r}") for request in requests]
        if any(prompt_rows):
            logits = self._split_prompt_rows(sched, items, prompt_rows, logits)
        states = self._hidden_states(sched, items, hidden) if hidden is not None else {}
        for s in sched.scheduled:
            self.scheduler.advance(s.seq, s.num_tokens)
        return ScoredRows(self.scheduler.scored_parents([s.seq for s in sched.scheduled if s.completes]), logits,
                          states), []

    def _hidden_states(self, sched: SchedulerOutput, items: list[ForwardItem], hidden: torch.Tensor
                       ) -> dict[Sequence, HiddenStates]:
        """Each completed sequence's hidden states: a prompt's earlier chunks joined to its last; a sequence's
        candidate probes stacked, one row per candidate."""
        out: dict[Sequence, HiddenStates] = {}
        probes: dict[Sequence, list[torch.Tensor]] = {}
        offset = 0
        for s, item in zip(sched.scheduled, items):
            rows = hidden[offset : offset + item.num_hidden]
            offset += item.num_hidden
            if not item.num_hidden:
                continue
            seq, start = s.seq, s.seq.num_computed_tokens
            parent = self.scheduler.probe_parent.get(seq)
            if parent is not None:
                probes.setdefault(parent, []).append(rows)
                continue
            earlier = self._chunks.pop(seq, None)
            if earlier is not None and earlier[0] + sum(r.shape[0] for r in earlier[1]) == start:
                start, rows = earlier[0], torch.cat([*earlier[1], rows])  # else: recomputed from the start
            if s.completes:
                out[seq] = HiddenStates(start, rows)
            else:
                self._chunks[seq] = (start, [rows])
        for parent, rows_list in probes.items():
            out[parent] = HiddenStates(parent.num_computed_tokens, torch.cat(rows_list), candidates=True)
        return out

    def _split_prompt_rows(self, sched: SchedulerOutput, items: list[ForwardItem], prompt_rows: list[int],
                           logits: torch.Tensor) -> torch.Tensor:
        """Hand each prompt chunk's rows to `on_prompt_rows`; return the rows the strategies score."""
        assert self.on_prompt_rows is not None
        keep: list[torch.Tensor] = []
        offset = 0
        for s, item, rows in zip(sched.scheduled, items, prompt_rows):
            chunk = logits[offset : offset + item.num_logits]
            offset += item.num_logits
            if rows:
                self.on_prompt_rows(s.seq.request, s.seq.num_computed_tokens, chunk[:rows])
            if s.completes:
                keep.append(chunk[chunk.shape[0] - s.seq.num_scored_positions :])
        return torch.cat(keep) if keep else logits[:0]


def _prompt_rows(s: ScheduledSequence) -> int:
    """How many leading positions of this chunk predict a prompt token the request wants the logprob of."""
    seq = s.seq
    if not needs_prompt_logits(seq.request) or seq is not seq.request.sequences[0]:
        return 0
    return max(0, min(s.num_tokens, seq.num_prompt_tokens - 1 - seq.num_computed_tokens))
