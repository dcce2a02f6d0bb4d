"""LangChain's `ChatOpenAI.bind_tools` against `decodekit serve`: a tool defined by a pydantic model is called with
arguments that validate against it (`tool_choice: required`, strict objects), and `tool_choice: none` answers in
text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_tools_recipe
from tests.helpers.served import Served

langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")


class WeatherArgs(BaseModel):
    """The weather in a city for some days."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    recipe = write_tiny_tools_recipe(tmp_path_factory.mktemp("langchain"))
    server = Served(load_recipe(recipe), served_model_name="tiny")
    yield server
    server.stop()


def test_bind_tools_gets_a_call_that_validates_against_the_tools_model(served):
    from langchain_core.tools import tool

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    chat = langchain_openai.ChatOpenAI(model="tiny", base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                                       temperature=0)
    message = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False,
                              strict=True).invoke("What is the weather in Paris for two days?")
    assert message.response_metadata["finish_reason"] == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    WeatherArgs.model_validate(call["args"])
    text = chat.bind_tools([get_weather], tool_choice="none").invoke("hello")
    assert not text.tool_calls and isinstance(text.content, str)
    served.wait_idle()
