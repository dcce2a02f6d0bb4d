"""A reasoning request's text split into its reasoning and its answer, from the phase of each token.

The stop stage records, for each token of a sequence with phases, where its text ends in `seq.text`
(`record_text_end`); the router's state labels each token with its phase or as a marker. A `PhaseText` walks the
two side by side, appending each token's piece of text to the reasoning (the format's `reasoning_phases`) or to the
answer (every other phase), and dropping markers. Streaming walks only what is new, and holds back the tokens that
may still turn out to start a marker (their labels can change), so a partial `</think>` never reaches the client as
reasoning. A strategy's result that is no sequence's text as detokenized (beam search's hypotheses) is split by
decoding each run of same-labelled tokens instead (`decoded_split`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decodekit.api.sequence import Sequence
from decodekit.api.stash import StashKey
from decodekit.core.phases import MARKER, PhaseState, phase_state


@dataclass
class _TextEnds:
    owner: int  # the sequence the list belongs to: a fork's stash shares it until the fork writes (then copies)
    ends: list[int] = field(default_factory=list)


_ENDS = StashKey[_TextEnds]()


def record_text_end(seq: Sequence) -> None:
    """After the stop stage detokenized the sequence's newest token: where that token's text ends."""
    track = seq.stash.get(_ENDS, None)
    if track is None or track.owner != seq.seq_id:
        track = _TextEnds(seq.seq_id, list(track.ends) if track is not None else [])
        seq.stash[_ENDS] = track
    del track.ends[seq.num_generated - 1 :]  # tokens a stop dropped were recorded before: forget them
    track.ends.append(len(seq.text))


@dataclass
class PhaseText:
    """How far a sequence's text has been split: the reasoning and the answer so far, the tokens and characters
    consumed."""

    reasoning: str = ""
    answer: str = ""
    tokens: int = 0
    chars: int = 0
    reasoning_tokens: int = 0

    def advance(self, seq: Sequence, text: str, final: bool) -> tuple[str, str]:
        """Split what is new in `text` (the sequence's text as far as it may be shown; all of it when `final`);
        returns the reasoning and answer added."""
        state = phase_state(seq)
        track = seq.stash.get(_ENDS, None)
        if state is None or track is None:
            return "", ""
        labels, ends = state.labels, track.ends
        count = min(len(labels), len(ends), seq.num_generated)
        if not final:
            count = min(count, len(labels) - state.cursor.pending_marker(state.program))
        thinking = state.program.format.reasoning_phases
        reasoning: list[str] = []
        answer: list[str] = []
        i = self.tokens
        while i < count:
            end = min(ends[i], len(text))
            if end < ends[i] and not final:
                break  # this token's text is held back (it may start a stop string)
            piece = text[self.chars : end]
            label = labels[i]
            if label in thinking:
                reasoning.append(piece)
            elif label != MARKER:
                answer.append(piece)
            if label in thinking or label == MARKER:
                self.reasoning_tokens += 1
            self.chars = max(self.chars, end)
            i += 1
        self.tokens = i
        if final and self.chars < len(text) and count:  # the detokenizer's flush: the last token's text
            (reasoning if labels[count - 1] in thinking else answer).append(text[self.chars :])
            self.chars = len(text)
        new_reasoning, new_answer = "".join(reasoning), "".join(answer)
        self.reasoning += new_reasoning
        self.answer += new_answer
        return new_reasoning, new_answer


def decoded_split(state: PhaseState, token_ids: list[int], tokenizer: Any, skip_special_tokens: bool
                  ) -> PhaseText:
    """A result's reasoning and answer by decoding each run of same-labelled tokens (no text was detokenized)."""
    out = PhaseText()
    thinking = state.program.format.reasoning_phases
    labels = state.labels[: len(token_ids)]
    start = 0
    for i in range(1, len(labels) + 1):
        if i < len(labels) and labels[i] == labels[start]:
            continue
        label, run = labels[start], token_ids[start:i]
        if label == MARKER or label in thinking:
            out.reasoning_tokens += len(run)
        if label != MARKER:
            text = str(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
            if label in thinking:
                out.reasoning += text
            else:
                out.answer += text
        start = i
    out.tokens = len(labels)
    return out
