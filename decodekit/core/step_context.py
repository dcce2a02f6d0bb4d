"""The step context: what a strategy (and a proposer) may do to its sequences during one step.

It implements `decodekit.api.strategy.StepContext` over the engine's parts and records what each step did in a
`StepRecord`, which the stop and emit stages read next. It is the only writer of a sequence's tokens, processor
states and generator; the KV side of each action goes through the scheduler.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from decodekit.api.draft_tree import branch_row_starts, count_nodes
from decodekit.api.errors import ProcessorError
from decodekit.api.processors import BatchView, fork_states, update_states
from decodekit.api.sequence import Request, Sequence
from decodekit.api.step_cost import StepTiming
from decodekit.api.strategy import HiddenStates, StrategyResult
from decodekit.core import drafts
from decodekit.core.scheduler import Scheduler
from decodekit.core.stages.forward import ScoredRows
from decodekit.core.stages.process import ProcessedRows, Processing


@dataclass
class CandidateOrigin:
    """The row of scores a sequence's candidates were chosen from, kept until one is accepted: the model's logits,
    the processed row (requests asking for `processed` logprobs) and the trace's stages (traced requests)."""

    raw: torch.Tensor | None = None
    processed: torch.Tensor | None = None
    trace: Any = None


def _count_draft(seq: Sequence, drafted: int, accepted: int, proposer: str | None) -> None:
    """Count a verified draft (or draft tree: its nodes) in the request's metrics, per proposer when named."""
    metrics = seq.request.metrics
    metrics.num_draft_tokens += drafted
    metrics.num_accepted_tokens += accepted
    if proposer is not None and drafted:
        counts = metrics.proposer_tokens.setdefault(proposer, {"drafted": 0, "accepted": 0, "steps": 0})
        counts["drafted"] += drafted
        counts["accepted"] += accepted
        counts["steps"] += 1  # verifications: 1 + accepted / steps is the proposer's acceptance length


def fork_seed(request_seed: int, fork_number: int) -> int:
    """The seed of a seeded request's `fork_number`-th fork when the strategy names none: a 64-bit hash of both,
    so it depends on nothing outside the request (not the batch, not the step) and differs between forks."""
    digest = hashlib.blake2b(f"{request_seed}:{fork_number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class StepRecord:
    """What one step did: how many tokens each sequence got, in the order they got them."""

    appended: dict[Sequence, int] = field(default_factory=dict)
    parents: dict[Sequence, Sequence] = field(default_factory=dict)
    """Each sequence `fork` made this step, and the one it was forked from (its first token came from the parent's
    row; a failed strategy call's forks that got no token are dropped again)."""
    faults: dict[Request, str] = field(default_factory=dict)
    """Requests a processor's state hook failed for this step, and why: the select stage fails them. The strategy
    never sees the error, so it cannot leave the other requests of its batch half-done."""
    notes: dict[Sequence, dict[str, Any]] = field(default_factory=dict)
    """Facts a strategy added to the trace event of a traced sequence this step (`StepContext.note`)."""
    finished_by: dict[Sequence, str] = field(default_factory=dict)
    """Who finished each sequence that finished this step: a stopping criterion's name, `max_model_len`, or the
    strategy that finished it (the trace's stop event names it)."""
    accepted_index: dict[Sequence, int] = field(default_factory=dict)
    """Which of its candidates each sequence accepted this step."""
    accepted_from: dict[Sequence, CandidateOrigin] = field(default_factory=dict)
    """Each sequence that accepted a candidate this step, and the row of scores that candidate was chosen from (a
    step earlier): its logprobs and trace event read that row, not this step's."""
    branch_rows: dict[Sequence, tuple[int, list[int]]] = field(default_factory=dict)
    """Each sequence that accepted a branch of its draft tree this step: where that branch's rows start among the
    sequence's scored rows, and the branch's tokens (its logprobs and trace read those rows)."""

    def requests(self) -> list[Request]:
        """The requests whose sequences got tokens this step, each once, in order."""
        return list({id(s.request): s.request for s in self.appended}.values())


class EngineStepContext:
    """The engine's `StepContext` for one step.

    Args:
        scheduler: where sequences' KV state goes (rollback, fork, free).
        processing: the process stage (batch views, each request's processors).
        record: this step's record, filled by `append_token` and `accept_draft`.
        finish: finishes a sequence with a reason (the stop stage's `finish_sequence`).
        set_results: gives a request its final outputs and completes it (request lifecycle).
        eos_token_ids: the model's end-of-sequence ids.
        max_model_len: the context limit.
        vocab_size: token ids a strategy appends must be below this.
    """

    def __init__(self, scheduler: Scheduler, processing: Processing, record: StepRecord,
                 finish: Callable[[Sequence, str, str | int | None], None],
                 set_results: Callable[[Request, list[StrategyResult]], None],
                 eos_token_ids: tuple[int, ...], max_model_len: int, vocab_size: int = 2**62,
                 origins: dict[Sequence, CandidateOrigin] | None = None) -> None:
        self.scheduler = scheduler
        self.processing = processing
        self.record = record
        self._finish = finish
        self._set_results = set_results
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.scored: ScoredRows | None = None
        """This step's scored rows (set by the select stage before the strategies run)."""
        self.processed: ProcessedRows | None = None
        """This step's process-stage output (set by the select stage with `scored`); `process` adds to it."""
        self.origins: dict[Sequence, CandidateOrigin] = origins if origins is not None else {}
        """Per sequence with candidates, the row they were chosen from (lives across steps: the engine's)."""
        self.step_timing: StepTiming | None = None
        """This step's verification time and rows (set by the engine after the process stage)."""

    @property
    def num_running(self) -> int:
        """Sequences running in the engine this step, of every request and strategy (the batch size): each
        unfinished sequence of a request with several (`n > 1`, beams) counts, as each takes its rows in a step."""
        return sum(1 for request in self.scheduler.running for seq in request.sequences if not seq.finished)

    def batch_view(self, seqs: list[Sequence]) -> BatchView:
        """The processors' view of these sequences: one row per scored position (drafts expand a sequence)."""
        return self.processing.batch_view(seqs)

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply each request's processors, in order, to the rows of these sequences' scored positions."""
        # outside the select stage (a strategy's propose), the rows it keeps for logprobs and the trace go nowhere
        return self.processing.process(logits, seqs, self.processed if self.processed is not None else ProcessedRows())

    def process_after(self, logits: torch.Tensor, seqs: list[Sequence], extra: list[list[int]],
                      allow_empty_rows: bool = False) -> torch.Tensor:
        """Apply each request's processors to one row per sequence, the position after `seq.token_ids + extra[i]`;
        with `allow_empty_rows`, a row left with nothing to choose is the caller's to handle."""
        return self.processing.process_after(logits, seqs, extra, allow_empty_rows)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Append a generated token; stopping runs at the end of the step."""
        self._drop_candidates(seq)
        self._append(seq, [token_id])

    def _drop_candidates(self, seq: Sequence) -> None:
        if seq.candidate_token_ids or seq in self.scheduler.probes:
            self.scheduler.drop_candidates(seq)
        self.origins.pop(seq, None)

    def score_candidates(self, seq: Sequence, token_ids: list[int]) -> None:
        """Score sibling next tokens of `seq` side by side in the next forward (one hidden probe each)."""
        if seq.finished or seq.request in self.record.faults:
            return
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("score_candidates needs at least one candidate token")
        if seq.draft_token_ids or seq.num_computed_tokens != len(seq.token_ids):
            raise ValueError("score_candidates needs a sequence whose every token is computed and that has no draft "
                             "(call it instead of append_token, or after accept_candidate)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"candidate token ids outside the vocabulary [0, {self.vocab_size}): {bad}")
        origin = self._origin_row(seq)
        self.scheduler.add_candidates(seq, tokens)
        if origin is not None:
            self.origins[seq] = origin

    def _origin_row(self, seq: Sequence) -> CandidateOrigin | None:
        """The row of scores `seq`'s next candidates are chosen from: its only row this step, or the row of the
        candidate it accepted this step. Kept only for requests that record logprobs or a trace."""
        params = seq.request.params
        if (params.logprobs is None and params.trace is None) or self.scored is None:
            return None
        rows = self.scored.rows_for(seq)
        if rows is None:
            return None
        row = self.record.accepted_index.get(seq, 0)
        processed = self.processed if self.processed is not None else ProcessedRows()
        kept = processed.kept.get(seq)
        traced = processed.trace_rows.get(seq)
        return CandidateOrigin(rows[row : row + 1], None if kept is None else kept[row : row + 1],
                               None if traced is None or row >= len(traced) else traced[row])

    def accept_candidate(self, seq: Sequence, index: int) -> None:
        """Append candidate `index` of `seq`, keeping the key and value the forward computed for it."""
        if not seq.candidate_token_ids:
            raise ValueError("accept_candidate: the sequence has no scored candidates")
        if not 0 <= index < len(seq.candidate_token_ids):
            raise ValueError(f"accept_candidate: index {index} is not one of the {len(seq.candidate_token_ids)} "
                             "candidates")
        token = seq.candidate_token_ids[index]
        before = self.record.appended.get(seq, 0)
        origin = self.origins.pop(seq, None)
        self._append(seq, [token])
        if self.record.appended.get(seq, 0) == before:  # refused (a processor's state, a failed request)
            self.scheduler.drop_candidates(seq)
            return
        self.scheduler.accept_candidate(seq, index)
        self.record.accepted_index[seq] = index
        if origin is not None:
            self.record.accepted_from[seq] = origin

    def hidden_states(self, seq: Sequence) -> HiddenStates | None:
        """The last hidden states of the positions computed for `seq` this step (strategies that ask only)."""
        return None if self.scored is None else self.scored.hidden.get(seq)

    def accept_draft(self, seq: Sequence, num_accepted: int, token_id: int, proposer: str | None = None) -> None:
        """Keep `num_accepted` draft tokens then `token_id`; roll the rest of the draft back out of the cache."""
        if seq.draft_branches:
            raise ValueError("accept_draft: the sequence was verified with a draft tree; use accept_branch")
        self._drop_candidates(seq)
        proposed = seq.draft_token_ids
        kept = proposed[:num_accepted]
        _count_draft(seq, len(proposed), num_accepted, proposer)
        drafts.clear(seq)
        self.scheduler.rollback(seq, len(seq.token_ids) + num_accepted)
        self._append(seq, [*kept, token_id])

    def accept_branch(self, seq: Sequence, branch: int, num_accepted: int, token_id: int,
                      proposer: str | None = None) -> None:
        """Keep `num_accepted` tokens of branch `branch` of `seq`'s draft tree, then `token_id`: the sequence
        adopts that branch's blocks (cut to what it keeps) and the processor states its rows were scored with."""
        branches = seq.draft_branches
        if not branches:
            raise ValueError("accept_branch: the sequence has no draft tree")
        if not 0 <= branch < len(branches):
            raise ValueError(f"accept_branch: branch {branch} is not one of the {len(branches)} branches")
        path = branches[branch]
        if not 0 <= num_accepted <= len(path):
            raise ValueError(f"accept_branch: {num_accepted} accepted tokens, but branch {branch} has {len(path)}")
        _count_draft(seq, count_nodes(branches), num_accepted, proposer)
        scored = self.processed.branch_states.get(seq) if self.processed is not None else None
        if scored is not None:
            seq.processor_states = scored[branch]
        self.record.branch_rows[seq] = (branch_row_starts(branches)[branch], list(path))
        drafts.clear(seq)
        self.scheduler.accept_branch(seq, branch, len(seq.token_ids) + num_accepted)
        self._append(seq, [*path[:num_accepted], token_id])

    def _append(self, seq: Sequence, token_ids: list[int]) -> None:
        # States first: if a stateful processor refuses the tokens, the sequence is left as it was.
        if seq.request in self.record.faults:
            return  # the request fails at the end of the select stage; its sequences take nothing more
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:  # it would index past the logits (logprobs) and fail the next forward for the whole batch
            self.record.faults[seq.request] = (f"strategy {seq.request.plan.strategy.name!r} chose token ids "
                                               f"outside the vocabulary [0, {self.vocab_size}): {bad}")
            return
        try:
            seq.processor_states = update_states(seq.request.plan.stages, seq.processor_states, token_ids)
        except ProcessorError as exc:
            self.record.faults[seq.request] = str(exc)
            return
        seq.token_ids.extend(token_ids)
        self.record.appended[seq] = self.record.appended.get(seq, 0) + len(token_ids)

    def fork(self, seq: Sequence, seed: int | None = None) -> Sequence:
        """A new running sequence sharing `seq`'s tokens and KV blocks (copy-on-write), with its own generator.

        `seed` seeds that generator. Without one, a seeded request's fork gets a seed derived from the request's
        seed and the fork's number within the request (`fork_seed`), so a strategy that forks and samples gives the
        same tokens alone or batched without seeding children itself; an unseeded request's forks draw from the
        global RNG, as the request does."""
        request = seq.request
        request.forks += 1
        if seed is None and request.params.seed is not None:
            seed = fork_seed(request.params.seed, request.forks)
        child = Sequence(request, list(seq.token_ids), seq.num_prompt_tokens)
        # plugin code first: if a fork_state raises, no block has been shared yet
        try:
            child.processor_states = fork_states(request.plan.stages, seq.processor_states)
        except ProcessorError as exc:  # the request fails after the stage: the child only has to be well-formed
            self.record.faults.setdefault(request, str(exc))
            child.processor_states = list(seq.processor_states)
        if seed is not None:  # before any block is shared: a seed the generator refuses leaves nothing behind
            # seed + k may pass the largest seed torch takes (2**64 - 1): wrap it there, keep every other seed
            child.generator = torch.Generator(device=self.processing.device).manual_seed(
                seed - 2**64 if seed > 2**64 - 1 else seed)
        child.detokenizer = seq.detokenizer.fork()
        child.text = seq.text
        child.stash = seq.stash.copy()
        child.state = dict(seq.state)
        self.scheduler.fork(seq, child)
        if seq.logprobs is not None:
            child.logprobs, child.cumulative_logprob = list(seq.logprobs), seq.cumulative_logprob
        if seq.trace is not None:
            child.trace = list(seq.trace)
        request.sequences.append(child)
        self.record.parents[child] = seq
        return child

    def free(self, seq: Sequence) -> None:
        """Drop a sequence whose request goes on (a pruned beam): its blocks are released, it is not returned."""
        self.origins.pop(seq, None)
        self.scheduler.finish_sequence(seq)
        seq.request.sequences.remove(seq)
        self.record.appended.pop(seq, None)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish a sequence with a reason ("stop", "length")."""
        self.origins.pop(seq, None)
        self._finish(seq, reason, stop_reason)
        self.record.finished_by[seq] = seq.request.plan.strategy.name

    def note(self, seq: Sequence, **facts: Any) -> None:
        """Add facts to this step's trace event of `seq` (kept only when its request asks for the trace)."""
        if seq.request.params.trace is not None:
            self.record.notes.setdefault(seq, {}).update(facts)

    def set_results(self, request: Request, results: list[StrategyResult]) -> None:
        """A strategy's final outputs for a request; its remaining sequences are released."""
        self._set_results(request, results)
