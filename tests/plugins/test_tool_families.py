"""The tool-call formats of model families (Hermes/Qwen, Llama 3 JSON, Mistral) and `tool_choice: auto` as a lazy
grammar: each format passes the tool-format kit; under `auto` any text without the marker is admitted whole and a
started call always completes validly or stops at the token budget (hypothesis properties, on a tiny engine whose
sampling is pushed toward the marker); a format whose `auto` is not lazy fails the kit; the format is picked from
the chat template (its call marker) and such a template is given the tools itself."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit import LLM, SamplingParams
from decodekit.api.constraints import ConstraintSpec
from decodekit.api.tools import ToolMode, ToolSpec, detect_tool_format
from decodekit.testing import ConformanceError, check_tool_format, constraint_admits, tiny_llm
from decodekit.tool_calling import ToolPlan, formats_of
from decodekit_plugins.tool_families import HermesToolFormat, Llama3JsonToolFormat, MistralToolFormat
from tests.helpers.tiny_folders import save_tiny_llama

FAMILIES = [HermesToolFormat, Llama3JsonToolFormat, MistralToolFormat]
TOOLS = [ToolSpec("get_weather", "The weather.", {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}),
    ToolSpec("flag", None, {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                            "additionalProperties": False})]
SCHEMAS = {t.name: t.parameters for t in TOOLS}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny_llm()


@pytest.mark.parametrize("fmt", FAMILIES, ids=lambda f: f.name)
def test_each_family_format_passes_the_tool_format_kit(fmt):
    report = check_tool_format(fmt, max_tokens=100)  # a call cut by the budget is skipped, and said
    assert report.requests == 8


class _EagerHermes(HermesToolFormat):
    """Not lazy: under `auto` the text may hold the marker and anything after it."""

    name = "eager_hermes"

    def constraint(self, tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> ConstraintSpec:
        if mode == "required":
            return super().constraint(tools, mode, parallel)
        return ConstraintSpec.grammar("start: TEXT\nTEXT: /(.|\\n)*/")


def test_a_format_whose_auto_is_not_lazy_fails_the_kit():
    with pytest.raises(ConformanceError, match="the marker followed by no call is admitted"):
        check_tool_format(_EagerHermes, tool_sets=[TOOLS[1:]], max_tokens=60)


_FREE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from("\n<>[]{}\":"),
                max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FAMILIES), text=_FREE, parallel=st.booleans())
def test_under_auto_any_text_without_the_marker_is_admitted_whole(llm, fmt, text, parallel):
    if fmt.marker in text:
        text = text.replace(str(fmt.marker), "")
    # a special token's literal text (hypothesis found "<pad>") tokenizes to that special token, which a model's text
    # never holds: plain text is what the constraint must admit
    for special in llm.tokenizer.all_special_tokens:
        text = text.replace(special, "")
    assert constraint_admits(llm, fmt().constraint(TOOLS, "auto", parallel), text)


_STARTED_CALLS = given(fmt=st.sampled_from(FAMILIES), seed=st.integers(0, 2**31 - 1), push=st.floats(2.0, 12.0),
                       max_tokens=st.integers(16, 96), parallel=st.booleans())


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@_STARTED_CALLS
def test_under_auto_a_started_call_completes_validly_or_stops_at_the_budget(llm, fmt, seed, push, max_tokens,
                                                                             parallel):
    _check_a_started_call(llm, fmt, seed, push, max_tokens, parallel)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@_STARTED_CALLS
def test_under_auto_a_started_call_completes_validly_or_stops_at_the_budget_many_examples(
        llm, fmt, seed, push, max_tokens, parallel):
    _check_a_started_call(llm, fmt, seed, push, max_tokens, parallel)


def _check_a_started_call(llm: LLM, fmt: Any, seed: int, push: float, max_tokens: int, parallel: bool) -> None:
    # sampling pushed toward the marker's tokens (a bias placed before the constraint), so calls start often and
    # at random points; whatever the model writes after the marker, the constraint must carry it to a valid call
    plan = ToolPlan(fmt(), TOOLS, "auto", parallel)
    bias = {"logit_bias": {"bias_strings": {fmt.marker: push}}}
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, processors=[bias, plan.processor()])
    out = llm.generate(["user: call a tool\nassistant:"], params)[0].outputs[0]
    text, marker = str(out.text), str(fmt.marker)
    parsed = plan.read(text)
    if marker not in text:
        assert parsed.calls == [] and parsed.content == text  # free text, read back as it is
        return
    head = text.split(marker, 1)[0]
    assert parsed.content == (head.rstrip() or None) or out.finish_reason == "length"
    if out.finish_reason == "length" and not parsed.calls:
        return  # cut mid-call: nothing is read back as a call
    assert parsed.calls and (parallel or len(parsed.calls) == 1), text
    for call in parsed.calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


QWEN_LIKE = ("{%- if tools %}<s>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
             "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call></s>\n{% endif %}"
             "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
             "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_the_format_is_picked_by_the_marker_its_chat_template_holds():
    formats: dict[str, Any] = formats_of(tiny_llm().engine.registry)
    assert detect_tool_format(QWEN_LIKE, formats) == "hermes"
    assert detect_tool_format("{{ '[TOOL_CALLS]' }}{{ messages }}", formats) == "mistral"
    assert detect_tool_format("{{ '<|python_tag|>' }}{{ messages }}", formats) == "llama3_json"
    assert detect_tool_format("{{ messages }}", formats) == "json"
    assert detect_tool_format(None, formats) == "json"


def test_a_family_template_gets_the_tools_itself_and_llm_chat_calls_in_its_format(tmp_path):
    folder = save_tiny_llama(tmp_path / "qwen-like", chat_template=QWEN_LIKE, max_position_embeddings=4096)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="32MiB")
    tool = {"type": "function", "function": {"name": TOOLS[0].name, "parameters": TOOLS[0].parameters}}
    out = llm.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(temperature=0, max_tokens=120),
                   tools=[tool], tool_choice="required", parallel_tool_calls=False)[0]
    # the template's own tool section, not the format's system prompt
    assert "# Tools" in str(out.prompt) and "You may call one or more functions" not in str(out.prompt)
    choice = out.outputs[0]
    assert str(choice.text).startswith("<tool_call>\n{\"name\": \"get_weather\"")
    assert choice.finish_reason == "tool_calls" and choice.tool_calls is not None
    jsonschema.validate(choice.tool_calls[0].arguments, SCHEMAS["get_weather"])
