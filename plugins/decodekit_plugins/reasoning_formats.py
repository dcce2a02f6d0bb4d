"""decodekit's reasoning formats: `think_tags` (Qwen3, DeepSeek-R1, SmolLM3, QwQ) and `harmony` (gpt-oss).

`think_tags`: the thinking sits between `<think>` and `</think>`, the answer follows. Qwen3's chat template lets the
model open the thinking itself (or, with `enable_thinking: false`, writes an empty `<think>\\n\\n</think>\\n\\n`
into the prompt); DeepSeek-R1's ends the prompt with `<think>\\n`. Either way `initial_phase` reads where the output
starts from the prompt's end.

`harmony`: gpt-oss writes each message as `<|channel|>NAME<|message|>...<|end|>`, the next one opened by
`<|start|>assistant`: its `analysis` channel is the thinking, `commentary` holds tool calls and preambles, `final`
is the answer. Its template ends the prompt with `<|start|>assistant`, so the output opens its first channel itself.
"""

from __future__ import annotations

from typing import Any

from decodekit import hookimpl
from decodekit.api.reasoning import START, ReasoningFormat, Transition


class ThinkTags(ReasoningFormat):
    """`<think>` ... `</think>` then the answer (Qwen3, DeepSeek-R1, SmolLM3, QwQ)."""

    name = "think_tags"
    phases = ("thinking", "answer")
    transitions = (
        Transition("<think>", "thinking", after=(START,)),
        Transition("</think>", "answer", after=("thinking",)),
    )

    def closing(self, phase: str) -> str | None:
        return "</think>" if phase == "thinking" else None


_NEXT = "<|end|><|start|>assistant"
"""What ends one harmony message and starts the next assistant message, before its channel header."""


class Harmony(ReasoningFormat):
    """gpt-oss's harmony channels: `analysis` (thinking), `commentary` (tool calls, preambles), `final` (answer)."""

    name = "harmony"
    phases = ("thinking", "commentary", "answer")
    transitions = (
        Transition("<|channel|>analysis<|message|>", "thinking", after=(START,)),
        Transition("<|channel|>commentary", "commentary", after=(START,)),
        Transition("<|channel|>final<|message|>", "answer", after=(START,)),
        Transition(f"{_NEXT}<|channel|>final<|message|>", "answer", after=("thinking", "commentary")),
        Transition(f"{_NEXT}<|channel|>commentary", "commentary", after=("thinking",)),
        Transition(f"{_NEXT}<|channel|>analysis<|message|>", "thinking", after=("commentary",)),
    )

    def closing(self, phase: str) -> str | None:
        return f"{_NEXT}<|channel|>final<|message|>" if phase in ("thinking", "commentary") else None


@hookimpl
def decodekit_register_reasoning_formats(register: Any) -> None:
    """decodekit's reasoning formats."""
    register(ThinkTags.name, ThinkTags)
    register(Harmony.name, Harmony)
