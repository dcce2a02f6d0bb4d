"""Tool calling from recipes and batch rows, end to end on a tiny model: a recipe's `inputs.tools` make `decodekit
run` write calls that validate (the same calls `LLM.chat` gives); batch rows offer their own tools (or get the
recipe's), name a function, refuse tools with `none`, continue a conversation with calls and results, and come back
with `tool_calls` in JSONL and Parquet; a row with bad tools is an error row naming the field while the others run;
a recipe with bad tools is refused when it loads, naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from decodekit import SamplingParams
from decodekit.api.errors import RecipeError
from decodekit.batch import run_batch
from decodekit.cli import app
from decodekit.recipe import load_recipe, recipe_from_data
from tests.helpers.batch_cases import read_jsonl, write_jsonl, write_tiny_tools_recipe

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
INPUTS = {"chat": True, "prompts": ["What is the weather in Paris?", "And in Oslo?"], "tools": [WEATHER],
          "tool_choice": "required", "parallel_tool_calls": False, "tool_format": "json"}


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    return write_tiny_tools_recipe(tmp_path_factory.mktemp("tools-recipe"),
                                   extra=yaml.safe_dump({"inputs": INPUTS}))


def _valid(calls: list[dict[str, str]] | None) -> list[tuple[str, dict[str, Any]]]:
    assert calls, "no calls"
    found = []
    for call in calls:
        arguments = json.loads(call["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["name"]])
        found.append((call["name"], arguments))
    return found


def test_decodekit_run_with_a_recipes_tools_writes_the_calls_llm_chat_gives(recipe_path, tmp_path):
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(app, ["run", str(recipe_path), "--output", str(out)])
    assert result.exit_code == 0, result.output
    rows = read_jsonl(out)
    assert [r["finish_reason"] for r in rows] == ["tool_calls", "tool_calls"]
    llm = load_recipe(recipe_path).build_llm()
    for row, prompt in zip(rows, INPUTS["prompts"]):
        calls = _valid(row["tool_calls"])
        assert len(calls) == 1 and calls[0][0] == "get_weather"
        alone = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=96),
                         tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                         tool_format="json")[0].outputs[0]
        assert [(c.name, c.arguments) for c in alone.tool_calls or []] == calls


def test_the_shipped_tool_calls_recipe_runs_end_to_end_on_a_tiny_model(recipe_path, tmp_path):
    shipped = Path(__file__).parents[2] / "recipes" / "tool_calls.yaml"
    out = tmp_path / "shipped.jsonl"
    result = CliRunner().invoke(app, ["run", str(shipped), "--set", f"model={recipe_path.parent / 'tiny'}",
                                      "--set", "sampling.max_tokens=200", "--output", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    tools = yaml.safe_load(shipped.read_text())["inputs"]["tools"]
    for row in read_jsonl(out):
        assert row["finish_reason"] == "tool_calls" and len(row["tool_calls"]) == 1
        call = row["tool_calls"][0]
        jsonschema.validate(json.loads(call["arguments"]), tools[0]["function"]["parameters"])


ROWS: list[Any] = [
    {"id": "own", "messages": ASK, "tools": [WEATHER, CLOCK],
     "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {"id": "inherits", "messages": ASK},
    {"id": "prompt-row", "prompt": "Weather in Rome?"},
    {"id": "none", "messages": ASK, "tool_choice": "none", "sampling": {"max_tokens": 6}},
    {"id": "history", "tool_choice": "none", "sampling": {"max_tokens": 6}, "messages": [
        *ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]},
    {"id": "bad-tool", "messages": ASK, "tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"id": "bad-choice", "messages": ASK, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"id": "bad-history", "messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "?"}]},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_batch_rows_call_their_tools_or_the_recipes_and_bad_tools_fail_alone(recipe_path, tmp_path, suffix):
    pytest.importorskip("pyarrow")
    out = tmp_path / f"out{suffix}"
    run_batch(load_recipe(recipe_path), write_jsonl(tmp_path / "rows.jsonl", ROWS), out)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    else:
        rows = {r["id"]: r for r in read_jsonl(out)}
    assert list(rows) == [r["id"] for r in ROWS]
    assert {name for name, _ in _valid(rows["own"]["tool_calls"])} == {"get_time"}
    for row_id in ("inherits", "prompt-row"):  # the recipe's tools and tool_choice: required
        assert rows[row_id]["finish_reason"] == "tool_calls"
        assert [name for name, _ in _valid(rows[row_id]["tool_calls"])] == ["get_weather"]
    for row_id in ("none", "history"):
        assert rows[row_id]["error"] is None and rows[row_id]["tool_calls"] is None
        assert rows[row_id]["finish_reason"] in ("stop", "length")
    assert "tools[0]" in rows["bad-tool"]["error"]
    assert "tool_choice: function 'nope'" in rows["bad-choice"]["error"]
    assert "messages[1].tool_call_id" in rows["bad-history"]["error"]


@pytest.mark.parametrize(("inputs", "message"), [
    ({"tools": [WEATHER]}, "tools need chat: true"),
    ({"chat": True, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"chat": True, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "function 'nope' is not one of"),
    ({"chat": True, "tool_choice": "required"}, "there are no tools"),
])
def test_a_recipe_with_bad_tools_is_refused_when_it_loads_naming_the_key(inputs, message):
    with pytest.raises(RecipeError, match="inputs") as error:
        recipe_from_data({"model": "smollm2-135m-instruct", "inputs": inputs})
    assert message in str(error.value)
