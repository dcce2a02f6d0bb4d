"""Phases of a reasoning request: a small state machine over each sequence's tokens, and the stage that routes
every scored row to its phase's processors.

A request with `SamplingParams.reasoning` gets one processor stage, the `PhaseRouter`, in place of its pipeline. Its
options are the request's `PhaseProgram`: for each phase of the format, the phase's own pipeline (the request's
processors, the phase's, then the ones its sampling fields imply), its budget and the tokens forced when the budget
runs out (the wrap-up message, then the format's closing marker); and the format's markers as token ids. Its state
per sequence (`PhaseState`) is where the sequence is (`Cursor`: the phase, the tokens still to force, the tokens
written per phase), the states of every phase's stateful stages, and the phase of each generated token.

Because the router is an ordinary stateful processor, phases ride on the machinery every processor has: its state
advances on accepted tokens only (`update_state`) and forks with a sequence (beams, `n > 1`), and a row that scores
a draft position walks a copy of the cursor over the row's unverified tokens, so each draft position is processed by
its own phase's pipeline and a forced position allows only its forced token (speculative verification rejects any
other draft token there; a draft proposer's own rows, `process_after`, are forced alike). A phase's stateful
stages see only the tokens the model wrote freely in that phase, and a row's `draft_offsets` for them count only
those, so a constraint on the answer starts at the answer's first token. Requests without `reasoning` have no router
and pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from decodekit.api.params import SamplingParams
from decodekit.api.processors import (
    NEG_INF,
    BatchView,
    LogitsProcessor,
    Stage,
    apply_processors,
    fork_states,
    init_states,
    update_states,
)
from decodekit.api.reasoning import ReasoningFormat

MARKER = ""
"""The label of a token that belongs to a marker (a phase's opening or closing), in no phase's text."""


@dataclass(frozen=True)
class CompiledMarker:
    """A transition's marker as token ids: written in one of the phases `after` (any when empty), it leads to `to`."""

    ids: tuple[int, ...]
    to: str
    after: tuple[str, ...]


@dataclass(frozen=True)
class PhaseRuntime:
    """One phase as a request runs it."""

    name: str
    stages: tuple[Stage, ...]
    params: SamplingParams
    budget: int | None = None
    forced_end: tuple[tuple[int, bool], ...] = ()
    """The tokens forced when the budget runs out, each with whether it is a marker token (the closing) or text
    of the phase (the wrap-up message)."""
    end_to: str | None = None
    """The phase the closing marker leads to."""


class PhaseProgram(BaseModel):
    """A request's phases (the router's options), built once when the request is planned."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    format: ReasoningFormat
    phases: dict[str, PhaseRuntime]
    markers: tuple[CompiledMarker, ...] = ()
    openings: dict[str, tuple[int, ...]] = {}
    """Per phase, the tokens that open it at the start of an output (forced when the prompt did not)."""
    tokenizer: Any = None

    def markers_in(self, phase: str) -> list[CompiledMarker]:
        """The markers that move an output out of `phase`, longest first."""
        return sorted((m for m in self.markers if not m.after or phase in m.after), key=lambda m: -len(m.ids))

    @property
    def longest(self) -> int:
        """The longest marker's token count."""
        return max((len(m.ids) for m in self.markers), default=1)


@dataclass
class Cursor:
    """Where a sequence is: its phase, the tokens still to force, the free tokens written per phase (the budgets'
    count), the current stretch's recent tokens (marker matching) and its free tokens so far (`run`)."""

    phase: str
    forced: tuple[tuple[int, bool], ...] = ()
    forced_to: str | None = None
    spent: dict[str, int] = field(default_factory=dict)
    tail: tuple[int, ...] = ()
    run: int = 0

    def copy(self) -> Cursor:
        """An independent copy (to walk over unverified tokens)."""
        return replace(self, spent=dict(self.spent))

    @property
    def forced_token(self) -> int | None:
        """The token the next position must be, or None."""
        return self.forced[0][0] if self.forced else None

    def step(self, program: PhaseProgram, token: int) -> tuple[str, int]:
        """Advance over one token. Returns the token's label (its phase, or `MARKER`) and how many tokens before it
        turned out to be the start of the marker it completes (their labels become `MARKER` too)."""
        if self.forced and self.forced[0][0] == token:
            is_marker = self.forced[0][1]
            self.forced = self.forced[1:]
            label = MARKER if is_marker else self.phase
            if not self.forced and self.forced_to is not None:
                self._enter(program, self.forced_to)
            return label, 0
        # a strategy that does not choose from the processed scores broke the forcing: follow what it wrote
        self.forced, self.forced_to = (), None
        phase = self.phase
        self.spent[phase] = self.spent.get(phase, 0) + 1
        self.run += 1
        self.tail = (*self.tail, token)[-program.longest :]
        for marker in program.markers_in(phase):
            if self.tail[-len(marker.ids) :] == marker.ids:
                self.spent[phase] -= len(marker.ids)
                self._enter(program, marker.to)
                return MARKER, len(marker.ids) - 1
        self._check_budget(program)
        return phase, 0

    def _enter(self, program: PhaseProgram, phase: str) -> None:
        self.phase, self.tail, self.run, self.forced_to = phase, (), 0, None
        self._check_budget(program)

    def _check_budget(self, program: PhaseProgram) -> None:
        runtime = program.phases.get(self.phase)
        if (runtime is not None and runtime.budget is not None and not self.forced and runtime.forced_end
                and self.spent.get(self.phase, 0) >= runtime.budget):
            self.forced, self.forced_to = runtime.forced_end, runtime.end_to

    def pending_marker(self, program: PhaseProgram) -> int:
        """How many of the newest tokens may still turn out to be the start of a marker (their labels may change)."""
        best = 0
        for marker in program.markers_in(self.phase):
            for k in range(min(len(marker.ids) - 1, len(self.tail)), best, -1):
                if self.tail[-k:] == marker.ids[:k]:
                    best = k
                    break
        return best


@dataclass
class PhaseState:
    """The router's state of one sequence: its cursor, each phase's stage states, and each generated token's label
    (its phase, or `MARKER`); `forced_at` lists the generated tokens that were forced."""

    cursor: Cursor
    inner: dict[str, list[Any]]
    program: PhaseProgram
    labels: list[str] = field(default_factory=list)
    forced_at: list[int] = field(default_factory=list)


def start_cursor(program: PhaseProgram, prompt_ids: list[int]) -> Cursor:
    """The cursor at the end of the prompt: the phase the format reads from the prompt's end, its opening forced
    when the prompt did not open it (and its closing at once under a budget of 0)."""
    tail = program.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False) if program.tokenizer else ""
    phase, opened = program.format.initial_phase(tail)
    cursor = Cursor(phase)
    opening = program.openings.get(phase, ())
    if opened or not opening:
        cursor._check_budget(program)
    else:
        cursor.forced, cursor.forced_to = tuple((t, True) for t in opening), phase
    return cursor


class PhaseRouter(LogitsProcessor):
    """Routes each row of a reasoning request to its phase's pipeline, or forces its token (the engine's own stage;
    see the module's docstring)."""

    name = "phases"
    stateful = True

    def init_state(self, options: Any, prompt_ids: list[int]) -> PhaseState:
        program: PhaseProgram = options
        return PhaseState(start_cursor(program, prompt_ids),
                          {name: init_states(rt.stages, prompt_ids) for name, rt in program.phases.items()}, program)

    def update_state(self, state: PhaseState, options: Any, token_ids: list[int]) -> PhaseState:
        program: PhaseProgram = options
        cursor, written_in = state.cursor, state.cursor.phase
        free: list[int] = []
        for token in token_ids:
            if cursor.phase != written_in:  # a new stretch: the last one's free tokens go to its phase's stages
                _feed(program, state, written_in, free)
                written_in = cursor.phase
            forced = cursor.forced_token == token
            label, back = cursor.step(program, token)
            if forced:
                state.forced_at.append(len(state.labels))
            else:
                free.append(token)
            state.labels.append(label)
            for i in range(2, back + 2):
                state.labels[-i] = MARKER
        _feed(program, state, written_in, free)
        return state

    def fork_state(self, state: PhaseState) -> PhaseState:
        program = state.program
        inner = {name: fork_states(rt.stages, state.inner[name]) for name, rt in program.phases.items()}
        return PhaseState(state.cursor.copy(), inner, program, list(state.labels), list(state.forced_at))

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        by_phase: dict[str, list[tuple[int, int, PhaseProgram, PhaseState]]] = {}
        forced: list[tuple[int, int]] = []
        row = 0
        while row < len(batch):
            state: PhaseState = batch.states[row]
            program: PhaseProgram = batch.options[row]
            end = row + 1  # the following rows scoring later draft positions of the same sequence
            while end < len(batch) and batch.states[end] is state and \
                    batch.draft_offsets[end] == batch.draft_offsets[row] + end - row:
                end += 1
            history, offset = batch.histories[row], batch.draft_offsets[row]
            cursor = state.cursor.copy()
            for unverified in history[len(history) - offset :]:
                cursor.step(program, unverified)
            for r in range(row, end):
                if r > row:
                    cursor.step(program, batch.histories[r][-1])
                must = cursor.forced_token
                if must is not None:
                    forced.append((r, must))
                else:
                    by_phase.setdefault(cursor.phase, []).append(
                        (r, min(batch.draft_offsets[r], cursor.run), program, state))
            row = end
        out = logits.clone()
        for phase, rows in by_phase.items():
            index = [r for r, _, _, _ in rows]
            view = batch.select(index)
            view.params = [p.phases[phase].params for _, _, p, _ in rows]
            view.draft_offsets = [o for _, o, _, _ in rows]
            pipelines = [p.phases[phase].stages for _, _, p, _ in rows]
            states = [s.inner[phase] for _, _, _, s in rows]
            idx = torch.tensor(index, device=logits.device)
            part = apply_processors(logits.index_select(0, idx), view, pipelines, [p.greedy for p in view.params],
                                    states)
            out.index_copy_(0, idx, part)
        if forced:
            rows_t = torch.tensor([r for r, _ in forced], device=logits.device)
            cols = torch.tensor([t for _, t in forced], device=logits.device)
            out[rows_t] = NEG_INF
            out[rows_t, cols] = 0.0
        return out


def _feed(program: PhaseProgram, state: PhaseState, phase: str, free: list[int]) -> None:
    """Advance `phase`'s stage states over the free tokens written in it (then forget them)."""
    if free and phase in program.phases:
        state.inner[phase] = update_states(program.phases[phase].stages, state.inner[phase], free)
    free.clear()


class ArgmaxProcessor(LogitsProcessor):
    """Keeps only each row's most likely token (the first of ties, as `argmax`): a greedy phase of a request that
    samples in another phase."""

    name = "greedy"
    argmax_invariant = True

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        out = torch.full_like(logits, NEG_INF)
        return out.scatter(1, logits.argmax(dim=-1, keepdim=True), 0.0)


ROUTER = PhaseRouter()
"""The engine's one router (stateless itself: every request's phases are its options and states)."""
ARGMAX = ArgmaxProcessor()
"""The greedy phase's stage."""


def usable_draft(state: PhaseState, draft: list[int]) -> int:
    """How many leading tokens of a draft to keep: up to the first forced position the draft departs from (the
    forced marker begins there, and verification could accept nothing past it), and before a second change of phase
    (a phase re-entered within one draft would have its stages see only the tokens since it was re-entered)."""
    cursor, changes = state.cursor.copy(), 0
    for i, token in enumerate(draft):
        must = cursor.forced_token
        if must is not None and must != token:
            return i
        before = cursor.phase
        cursor.step(state.program, token)
        if cursor.phase != before:
            changes += 1
            if changes > 1:
                return i
    return len(draft)


def phase_state(seq: Any) -> PhaseState | None:
    """The phase state of a sequence whose request has phases, else None."""
    plan = seq.request.plan
    if plan is None or getattr(plan, "phases", None) is None or not seq.processor_states:
        return None
    state = seq.processor_states[0]
    return state if isinstance(state, PhaseState) else None
