"""The reasoning-format kit: decodekit's `think_tags` and `harmony` pass it, and formats that break a rule fail it
naming the rule."""

from __future__ import annotations

import pytest

from decodekit.api.reasoning import START, ReasoningFormat, Transition
from decodekit.testing import ConformanceError, check_reasoning_format
from decodekit_plugins.reasoning_formats import Harmony, ThinkTags


@pytest.mark.parametrize("format_class", [ThinkTags, Harmony])
def test_decodekits_own_formats_pass_the_kit_on_an_engine(format_class):
    report = check_reasoning_format(format_class)
    assert report.requests == 3 and not report.skipped


class Fenced(ReasoningFormat):
    """A third party's format: thinking between `[[` and `]]` (registered by the kit, as it is nobody's)."""

    name = "fenced"
    transitions = (Transition("[[", "thinking", after=(START,)), Transition("]]", "answer", after=("thinking",)))

    def closing(self, phase: str) -> str | None:
        return "]]" if phase == "thinking" else None


def test_a_third_party_format_is_registered_by_the_kit_and_passes():
    assert check_reasoning_format(Fenced).requests == 3


class ClosesNowhere(Fenced):
    name = "closes_nowhere"

    def closing(self, phase: str) -> str | None:
        return "||" if phase == "thinking" else None


class BadTarget(Fenced):
    name = "bad_target"
    transitions = (*Fenced.transitions, Transition("<<", "nowhere"))


class SplitKeepsMarkers(Fenced):
    name = "split_keeps_markers"

    def split(self, text, start):
        return super().split(text.replace("]]", "]] "), start)


@pytest.mark.parametrize(("format_class", "rule"), [
    (ClosesNowhere, "completes no transition"),
    (BadTarget, "names a phase the format lacks"),
    (SplitKeepsMarkers, "split"),
])
def test_a_format_that_breaks_a_rule_fails_naming_it(format_class, rule):
    with pytest.raises(ConformanceError, match=rule):
        check_reasoning_format(format_class)
