"""Reasoning models on the server: a request's reasoning settings become `SamplingParams.reasoning`, and outputs
come back with the thinking apart from the answer.

Request fields: `reasoning` (decodekit's own: a recipe's `reasoning:` mapping, merged over the recipe's),
`thinking_token_budget` (vLLM's: the thinking phase's budget), `reasoning_effort` and `chat_template_kwargs` (given to
the chat template: gpt-oss reads `reasoning_effort`, Qwen3 `enable_thinking`). When the request reasons (any of the
first two, or a recipe with `reasoning:`), the constraints of `response_format` and of tool calling apply to the
answer phase only, so the thinking stays free. Errors name the request field: `thinking_token_budget`,
`response_format`, or `reasoning`.

Responses: `message.reasoning_content` and vLLM's newer `message.reasoning` hold the thinking, `content` the
answer; streamed chunks carry the thinking in `delta.reasoning_content` (and `delta.reasoning`) apart from
`delta.content`; `usage.completion_tokens_details.reasoning_tokens` counts the thinking's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from decodekit.api.params import ComponentSpec
from decodekit.api.sequence import CompletionOutput, RequestOutput
from decodekit.recipe import Recipe
from decodekit.serve.protocol import CompletionTokensDetails, SamplingFields

ANSWER_ONLY = ("response_format", "tools")
"""The request fields whose constraint applies to the answer phase of a reasoning request."""


def apply_reasoning(request: SamplingFields, recipe: Recipe, overrides: dict[str, Any], origins: dict[str, str]
                    ) -> None:
    """Add the request's reasoning settings to its overrides (see the module's docstring), in place."""
    rules: dict[str, Any] = dict(request.reasoning or {})
    if request.reasoning is not None:
        origins["reasoning"] = "reasoning"
    if request.thinking_token_budget is not None:
        thinking = rules.get("thinking")
        rules["thinking"] = {**(thinking if isinstance(thinking, Mapping) else {}),
                             "budget": request.thinking_token_budget}
        origins["reasoning.thinking.budget"] = "thinking_token_budget"
    if not rules and recipe.reasoning is None:
        return
    specs: list[ComponentSpec] = list(overrides.get("processors", []))
    moved = [s for s in specs if origins.get(f"processors:{s.name}") in ANSWER_ONLY]
    if moved:
        overrides["processors"] = [s for s in specs if s not in moved]
        answer = rules.get("answer")
        answer = dict(answer) if isinstance(answer, Mapping) else {}
        answer["processors"] = [*answer.get("processors", []), *moved]
        rules["answer"] = answer
        origins["reasoning.answer.processors"] = origins[f"processors:{moved[0].name}"]
    overrides["reasoning"] = rules


def template_kwargs(request: Any) -> dict[str, Any]:
    """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` where the request sets it."""
    kwargs = dict(request.chat_template_kwargs or {})
    if getattr(request, "reasoning_effort", None) is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    return kwargs


def message_fields(choice: CompletionOutput) -> dict[str, Any]:
    """A choice's thinking as a message's `reasoning_content` and `reasoning` (none for a request without phases)."""
    if choice.reasoning_text is None:
        return {}
    return {"reasoning_content": choice.reasoning_text, "reasoning": choice.reasoning_text}


def delta_fields(output: RequestOutput, i: int) -> dict[str, Any]:
    """A streamed choice's new thinking as a delta's `reasoning_content` and `reasoning` (none when there is none)."""
    deltas = output.delta_reasoning_text
    text = deltas[i] if deltas is not None and i < len(deltas) else ""
    return {"reasoning_content": text, "reasoning": text} if text else {}


def token_details(outputs: Sequence[RequestOutput]) -> CompletionTokensDetails | None:
    """`usage.completion_tokens_details`: the thinking's tokens over every choice (None without phases)."""
    counts = [c.reasoning_token_count for o in outputs for c in o.outputs if c.reasoning_token_count is not None]
    return CompletionTokensDetails(reasoning_tokens=sum(counts)) if counts else None
