"""The rows of a batch job: reading a dataset of prompts (JSONL, Parquet or text), giving every row its id, turning
a row into an engine request, and the output row written for it.

A row is a prompt or a chat conversation, with optional per-row overrides of the recipe's defaults:

    {"id": "q1", "prompt": "Name three rivers.", "sampling": {"max_tokens": 32}}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi!"}], "strategy": {"beam_search": {"num_beams": 4}}}
    {"id": "q3", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [{"type": "function",
     "function": {"name": "get_weather", "parameters": {...}}}], "tool_choice": "required"}

A chat row may offer function tools (OpenAI's shapes: `tools`, `tool_choice`, `parallel_tool_calls`, and assistant
`tool_calls` and `role: tool` messages in its conversation), else it gets the recipe's `inputs.tools`; its calls are
constrained to parse and validate, and come back in the output row's `tool_calls`.

A row without an id gets its 1-based position in the input (`"7"`). Ids join outputs to inputs, so they must be
unique. A row that cannot run (bad JSON, an unknown processor, a prompt longer than the context) gets an output
row with `error` set: no row is ever lost.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from decodekit.api.errors import RecipeError
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.core.plan import Components
from decodekit.recipe import Recipe
from decodekit.recipe_runner import InputLine, parse_line
from decodekit.tool_calling import ToolPlan, calls_row

INPUT_SUFFIXES = (".jsonl", ".parquet", ".txt")
"""The dataset kinds `decodekit batch` reads (and, but for .txt, writes)."""


class BatchRow(InputLine):
    """One input row: a `prompt` (chat-templated when the recipe says `inputs.chat`) or chat `messages` (always
    templated; the recipe's system prompt is added when they have none), an optional id, and overrides."""

    prompt: str | None = Field(None, min_length=1, description="The prompt text.")  # type: ignore[assignment]
    messages: list[dict[str, Any]] | None = Field(
        None, min_length=1, description="A chat conversation: {role, content} objects (and assistant tool_calls, "
        "role: tool results), ending with the user's or a tool's turn.")
    tools: list[dict[str, Any]] | None = Field(
        None, description="Function tools the reply may call (OpenAI's shape), instead of the recipe's inputs.tools.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="auto, required, none or {type: function, function: {name: ...}}.")
    parallel_tool_calls: bool | None = Field(None, description="false: one call at most.")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> BatchRow:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


@dataclass(frozen=True)
class InputRow:
    """A row as read from the dataset: its id, its position (0-based) and its raw value (or why it is unreadable)."""

    id: str
    index: int
    data: Any

    def to_json(self) -> str:
        """The row as one JSON line (how rows travel to Ray workers)."""
        data = {"__error__": str(self.data)} if isinstance(self.data, Exception) else self.data
        return json.dumps({"id": self.id, "index": self.index, "data": data}, ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> InputRow:
        """The inverse of `to_json`."""
        item = json.loads(text)
        data = item["data"]
        if isinstance(data, dict) and set(data) == {"__error__"}:
            data = RecipeError(data["__error__"])
        return InputRow(item["id"], item["index"], data)


def read_rows(path: str | Path) -> list[InputRow]:
    """Every row of a .jsonl, .parquet or .txt dataset, with its id (the row's `id`, else its 1-based position).

    A JSONL line that is not valid JSON is still a row (its output will be an error), so the positions of the others
    do not shift.

    Raises:
        RecipeError: the file is missing or of an unknown kind, Parquet without pyarrow installed, or two rows share
            an id (outputs are joined to inputs by id).
    """
    path = Path(path)
    if path.suffix not in INPUT_SUFFIXES:
        raise RecipeError(f"{path}: a batch input is .jsonl (one JSON object per line), .parquet or .txt (one prompt "
                          "per line)")
    if not path.is_file():
        raise RecipeError(f"{path}: no such file")
    values = list(_parquet_values(path) if path.suffix == ".parquet" else _line_values(path))
    rows = [InputRow(_row_id(value, i), i, value) for i, value in enumerate(values)]
    seen: dict[str, int] = {}
    for row in rows:
        if row.id in seen:
            raise RecipeError(f"{path}: rows {seen[row.id] + 1} and {row.index + 1} share the id {row.id!r}: ids join "
                              "outputs to inputs, so they must be unique")
        seen[row.id] = row.index
    return rows


def _line_values(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix == ".txt":
                yield {"prompt": line.rstrip("\n")}
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                yield RecipeError(f"{path.name} line {number}: not valid JSON: {exc.msg} (column {exc.colno})")


def _parquet_values(path: Path) -> Iterator[Any]:
    pq = _import_pyarrow_parquet()
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            yield without_nulls(row)


def without_nulls(value: Any) -> Any:
    """`value` with the nulls of its mappings removed, recursively: Parquet gives every row every column (and
    every struct field), and a null there means "not given"; so does a NaN, which is how a missing value comes
    through a pandas block of Ray Data."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if not _missing(item)}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _import_pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecipeError("reading or writing Parquet needs pyarrow: pip install pyarrow (or decodekit[ray], "
                          "which brings it)") from None
    return pq


def _row_id(value: Any, index: int) -> str:
    if isinstance(value, dict) and isinstance(value.get("id"), (str, int)) and not isinstance(value["id"], bool):
        return str(value["id"])
    return str(index + 1)


@dataclass
class PreparedRow:
    """A row ready for the engine: the prompt text it gets, its parameters, and its tool plan (None: no tools)."""

    row: InputRow
    text: str
    params: SamplingParams
    tools: ToolPlan | None = None


def prepare_row(recipe: Recipe, components: Components, llm: Any, row: InputRow) -> PreparedRow:
    """Validate a row and merge its overrides over the recipe's defaults; render its prompt (with its tools: the
    calls' constraint added to its parameters).

    Raises:
        DecodeKitError: the row is not an object of `BatchRow`'s shape, names an unknown plugin or bad parameters,
            offers bad tools or tool messages, or the tokenizer has no chat template for its messages.
    """
    item, params = parse_line(recipe, components, row.data, BatchRow)
    text, plan = render_row(recipe, llm, item)
    return PreparedRow(row, text, plan.constrain(params) if plan is not None else params, plan)


def render_row(recipe: Recipe, llm: Any, item: BatchRow) -> tuple[str, ToolPlan | None]:
    """The text the engine gets for a row (see `BatchRow`), and its tool plan."""
    inputs = recipe.inputs
    if item.messages is None and not inputs.chat:
        if item.tools is not None:
            raise RecipeError("tools: a prompt row calls tools only under a chat recipe (inputs.chat: true); give "
                              "the row messages")
        assert item.prompt is not None  # the validator guarantees one of the two
        return item.prompt, None
    messages = list(item.messages) if item.messages is not None else [{"role": "user", "content": item.prompt}]
    if inputs.system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": inputs.system})
    own = item.tools is not None
    tools = item.tools if own else inputs.tools
    choice = item.tool_choice if own or item.tool_choice is not None else inputs.tool_choice
    parallel = item.parallel_tool_calls if item.parallel_tool_calls is not None else inputs.parallel_tool_calls
    text, plan = llm.chat_prompt(messages, tools, choice, parallel, inputs.tool_format)
    return str(text), plan


def uses_chat_template(recipe: Recipe, row: InputRow) -> bool:
    """Whether the row's text is chat-templated (the template holds the special tokens: none are added again)."""
    return recipe.inputs.chat or (isinstance(row.data, dict) and row.data.get("messages") is not None)


OUTPUT_KEYS = ("id", "text", "token_ids", "finish_reason", "stop_reason", "usage", "tool_calls", "choices", "error",
               "reasoning_text", "reasoning_tokens")
"""Every output row has these keys (null where they do not apply), so JSONL and Parquet rows share one shape."""


def output_row(row: InputRow, output: RequestOutput | None = None, error: str | None = None) -> dict[str, Any]:
    """The output row of an input row: the generated text and tokens, finish reason, usage, the calls read back (a
    row with tools whose reply called them: `{"name", "arguments"}`, the arguments as JSON text) and (for requests
    that return several) every choice; or, for a row that could not run or failed, `error`."""
    out: dict[str, Any] = dict.fromkeys(OUTPUT_KEYS)
    out["id"] = row.id
    if output is None or output.error is not None:
        out["error"] = error if output is None else output.error
        return out
    completion_tokens = sum(len(o.token_ids) for o in output.outputs)
    out.update({
        "text": output.text,
        "token_ids": list(output.token_ids),
        "finish_reason": output.finish_reason,
        "stop_reason": None if not output.outputs or output.outputs[0].stop_reason is None
        else str(output.outputs[0].stop_reason),
        "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(output.prompt_token_ids) + completion_tokens},
        "tool_calls": calls_row(output.outputs[0].tool_calls) if output.outputs else None,
    })
    first = output.outputs[0] if output.outputs else None
    if first is not None and first.reasoning_text is not None:  # a reasoning row: `text` is the answer
        out["reasoning_text"], out["reasoning_tokens"] = first.reasoning_text, first.reasoning_token_count
    if len(output.outputs) > 1:
        out["choices"] = [{"index": o.index, "text": o.text, "token_ids": list(o.token_ids),
                           "finish_reason": o.finish_reason, "score": o.score,
                           "cumulative_logprob": o.cumulative_logprob} for o in output.outputs]
    return out


def output_schema() -> Any:
    """The Arrow schema of every output file (one schema, so that files of blocks with and without beams, errors
    or choices read back as one table)."""
    import pyarrow as pa

    tokens = pa.list_(pa.int64())
    usage = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                       ("total_tokens", pa.int64())])
    choice = pa.struct([("index", pa.int64()), ("text", pa.string()), ("token_ids", tokens),
                        ("finish_reason", pa.string()), ("score", pa.float64()),
                        ("cumulative_logprob", pa.float64())])
    fields = {"id": pa.string(), "text": pa.string(), "token_ids": tokens, "finish_reason": pa.string(),
              "stop_reason": pa.string(), "usage": usage,
              "tool_calls": pa.list_(pa.struct([("name", pa.string()), ("arguments", pa.string())])),
              "choices": pa.list_(choice), "error": pa.string(),
              "reasoning_text": pa.string(), "reasoning_tokens": pa.int64()}
    return pa.schema([(key, fields[key]) for key in OUTPUT_KEYS])
