"""The reasoning-format contract: how a model family marks the phases of its output (thinking, answer, ...).

A `ReasoningFormat` is a plugin kind (`decodekit_register_reasoning_formats`). It names the phases a model's output
goes through and the marker texts that move it from one to the next (`Transition`): `<think>` / `</think>` for
Qwen3, DeepSeek-R1 and SmolLM3, the channel headers of gpt-oss's harmony format. From that the engine builds a small
state machine over each sequence's generated tokens (`decodekit.core.phases`), so that each phase decodes with its
own processors, sampling parameters, constraint and budget. A format also says where an output begins given its
prompt (`initial_phase`: a chat template may already have opened the thinking), what text ends a phase when its
budget runs out (`closing`), and how a finished text splits into its phases (`split`).

Markers are matched on the token ids of their text as the model's tokenizer encodes it: a marker that is one special
token (Qwen3's `<think>`, gpt-oss's `<|channel|>`) is always recognised; a marker the tokenizer splits into several
tokens is recognised when the model writes it in those same tokens (a forced marker always is).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

START = "start"
"""The pseudo-phase before an output's first marker: `Transition.after` names it for the markers that open an
output (never a phase a request configures)."""


@dataclass(frozen=True)
class Transition:
    """Once the model has written `marker` while in one of the phases `after` (any phase when empty), the output is
    in phase `to`. The marker's own tokens belong to no phase's text."""

    marker: str
    to: str
    after: tuple[str, ...] = ()

    def applies(self, phase: str) -> bool:
        """Whether the marker moves an output that is in `phase`."""
        return not self.after or phase in self.after


@dataclass(frozen=True)
class PhaseSegment:
    """One stretch of an output written in one phase, its markers removed."""

    phase: str
    text: str


class ReasoningFormat(ABC):
    """How one model family marks the phases of its output. Stateless: one instance serves every request.

    Attributes:
        name: the registered name (`reasoning: {format: NAME}`).
        phases: every phase an output can be in; a request may configure any of them by name.
        reasoning_phases: the phases whose text is the output's reasoning (`CompletionOutput.reasoning_text`, the
            server's `reasoning_content`); the text of the others is the answer.
        begins: the phase an output begins in when its prompt opened none (its `opening` is then forced first).
        transitions: the markers and the phases they lead to.
    """

    name: ClassVar[str] = ""
    phases: ClassVar[tuple[str, ...]] = ("thinking", "answer")
    reasoning_phases: ClassVar[frozenset[str]] = frozenset({"thinking"})
    begins: ClassVar[str] = "thinking"
    transitions: ClassVar[tuple[Transition, ...]] = ()

    @abstractmethod
    def closing(self, phase: str) -> str | None:
        """The text forced to end `phase` when its budget runs out (after the phase's wrap-up message): it must
        complete a transition out of `phase`. None: the format cannot end this phase, and a budget on it is
        refused."""

    def opening(self, phase: str) -> str:
        """The text that opens `phase` at the start of an output (forced when the prompt did not open it), or ""."""
        return next((t.marker for t in self.transitions if t.to == phase and t.applies(START)), "")

    def initial_phase(self, prompt: str) -> tuple[str, bool]:
        """The phase an output starts in after `prompt` (its text, special tokens kept), and whether the prompt
        opened it already: a prompt ending with a marker (whitespace after it aside) starts in that marker's phase
        (DeepSeek-R1's template ends with `<think>\\n`; Qwen3's with `</think>\\n\\n` when thinking is off);
        any other starts in `begins`, whose `opening` is then forced."""
        tail = prompt.rstrip()
        for transition in sorted(self.transitions, key=lambda t: -len(t.marker)):
            if tail.endswith(transition.marker.rstrip()):
                return transition.to, True
        return self.begins, False

    def split(self, text: str, start: str) -> list[PhaseSegment]:
        """`text`, an output that started in phase `start` (written with its markers), cut into the stretches of
        each phase, markers removed; empty stretches are left out."""
        segments: list[PhaseSegment] = []
        phase, at = start, 0
        while True:
            found = [(text.find(t.marker, at), -len(t.marker), t) for t in self.transitions
                     if t.applies(phase) and text.find(t.marker, at) >= 0]
            if not found:
                break
            where, _, transition = min(found, key=lambda f: (f[0], f[1]))
            if where > at:
                segments.append(PhaseSegment(phase, text[at:where]))
            phase, at = transition.to, where + len(transition.marker)
        if at < len(text):
            segments.append(PhaseSegment(phase, text[at:]))
        return segments

    def markers(self) -> list[str]:
        """Every marker text of the format (a wrap-up message must contain none of them)."""
        return sorted({t.marker for t in self.transitions}, key=len)
