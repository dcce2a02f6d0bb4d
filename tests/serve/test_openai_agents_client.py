"""The openai-agents SDK against `decodekit serve`: an agent with two function tools runs to completion through chat
completions (`OpenAIChatCompletionsModel`) and through the Responses API (`OpenAIResponsesModel`, the SDK's default),
streamed and not. Each tool is called with arguments its schema admits, and the agent's final output is produced
by the model (a structured `output_type`, which the SDK asks for with `response_format` / `text.format` on every
turn, tool turns included).

The model is a tiny random one, so the agent's path is set by `tool_choice`, not by what the model would choose:
`get_weather` first, then `get_time`, then `none` (the final answer), each turn's choice set by the agent's hooks
as the previous tool ends (`reset_tool_choice=False`, so the SDK does not reset it to `auto`). Greedy, so every run
is the same."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_tools_recipe
from tests.helpers.served import KEY, Served

agents = pytest.importorskip("agents", reason="openai-agents is not installed")

CITIES = ("Paris", "Oslo")
NEXT_CHOICE = {"get_weather": "get_time", "get_time": "none"}
"""Each turn's `tool_choice` after a tool ends: the other tool, then no tool (the final answer)."""


class Answer(BaseModel):
    """The agent's final output (bounded values, so the random model's constrained answer ends quickly)."""

    city: Literal["Paris", "Oslo"]
    sunny: bool


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    recipe = write_tiny_tools_recipe(tmp_path_factory.mktemp("agents"), max_tokens=200)
    server = Served(load_recipe(recipe), api_key=KEY, served_model_name="tiny")
    yield server
    server.stop()


def _run_agent(served: Served, api: str, streamed: bool) -> tuple[list[tuple[str, str]], Any]:
    """Run the two-tool agent once through `api` ("chat" or "responses"); the tools' calls and the result."""
    from openai import AsyncOpenAI

    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(("get_weather", city))
        return f"Sunny, 22 C in {city}."

    @agents.function_tool
    def get_time(city: Literal["Paris", "Oslo"]) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"It is 14:05 in {city}."

    class NextToolChoice(agents.AgentHooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: str) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=NEXT_CHOICE[tool.name])

    async def run() -> Any:
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
        model_class = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
        agent = agents.Agent(
            name="assistant", instructions="Answer with the tools' results.", tools=[get_weather, get_time],
            model=model_class("tiny", client), output_type=Answer, hooks=NextToolChoice(), reset_tool_choice=False,
            model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, parallel_tool_calls=False))
        question = "What is the weather and the time in Paris?"
        if not streamed:
            return await agents.Runner.run(agent, question, max_turns=4)
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    agents.set_tracing_disabled(True)  # no traces exported to OpenAI
    return calls, asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_with_two_function_tools_runs_to_a_final_output(served, api, streamed):
    calls, result = _run_agent(served, api, streamed)
    # both tools ran, in the order the tool choices asked, with arguments their schemas admit (the SDK validates
    # them before calling; a city outside the enum would have been an error fed back to the model instead)
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert all(city in CITIES for _, city in calls)
    assert isinstance(result.final_output, Answer)
    items = [type(item).__name__ for item in result.new_items]
    assert items == ["ToolCallItem", "ToolCallOutputItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    served.wait_idle()


def test_the_same_agent_gives_the_same_calls_and_answer_through_both_apis(served):
    chat_calls, chat = _run_agent(served, "chat", streamed=False)
    responses_calls, responses = _run_agent(served, "responses", streamed=False)
    assert chat_calls == responses_calls and chat.final_output == responses.final_output
