"""The tool-call format kit: decodekit's own `json` format passes it, exercising every mode; formats that break the
contract (a constraint admitting text under `required`, calls read back wrong, history not round-tripping, a
constraint the engine cannot apply, a partial reading that streams what the finished one does not hold) fail it
naming the rule."""

from __future__ import annotations

import json

import pytest

from decodekit.api.constraints import ConstraintSpec
from decodekit.api.partial_calls import PartialOutput
from decodekit.api.tools import ParsedOutput, ToolCall
from decodekit.testing import ConformanceError, check_tool_format
from decodekit_plugins.tool_formats import JsonToolFormat


def test_decodekits_json_format_passes_the_kit():
    report = check_tool_format(JsonToolFormat)
    assert report.requests == 8  # two tool sets x two modes x one call or several


class _RequiredAllowsText(JsonToolFormat):
    name = "required_allows_text"

    def constraint(self, tools, mode, parallel):
        return super().constraint(tools, "auto", parallel)  # `required` wrongly admits {"response": ...}

    def parse(self, text):
        parsed = super().parse(text)
        return ParsedOutput(parsed.content or "text", parsed.calls) if not parsed.calls else parsed


class _WrongArguments(JsonToolFormat):
    name = "wrong_arguments"

    def parse(self, text):
        parsed = super().parse(text)
        return ParsedOutput(parsed.content, [ToolCall(c.name, {"unexpected": 1}) for c in parsed.calls])


class _LossyHistory(JsonToolFormat):
    name = "lossy_history"

    def assistant_content(self, content, calls):
        return json.dumps({"tool_calls": [{"name": c.name, "arguments": {}} for c in calls]})


class _NoConstraint(JsonToolFormat):
    name = "no_constraint"

    def constraint(self, tools, mode, parallel):
        return ConstraintSpec.regex("[a-z ]{1,20}")  # the engine can apply it, but no call can match


class _StreamsItsRawText(JsonToolFormat):
    name = "streams_raw_text"

    def partial(self, text):
        return PartialOutput(text)  # the JSON of the calls would stream as content


@pytest.mark.parametrize(("format_class", "rule"), [
    (_RequiredAllowsText, "required constraint admits a text answer"),
    (_WrongArguments, "do not validate against its parameters"),
    (_LossyHistory, "reads back as"),
    (_NoConstraint, "tool calls need a json_schema or a grammar"),
    (_StreamsItsRawText, "the streamed calls would differ from the finished ones"),
])
def test_a_format_that_breaks_the_contract_fails_naming_the_rule(format_class, rule):
    with pytest.raises(ConformanceError, match=rule):
        check_tool_format(format_class)
