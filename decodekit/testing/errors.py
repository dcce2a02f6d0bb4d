"""`ConformanceError`, the one error every kit of `decodekit.testing` raises, and how a processor's failure is
worded (`processor 'name' <rule>: <detail>`)."""

from __future__ import annotations

from decodekit.api.processors import LogitsProcessor


class ConformanceError(AssertionError):
    """A plugin broke one of its contract's rules; the message names the rule and the plugin."""


def processor_name(processor: LogitsProcessor) -> str:
    """The processor's registered `name` (its class name if it has none)."""
    return str(getattr(processor, "name", type(processor).__name__))


def processor_failure(processor: LogitsProcessor, rule: str, detail: str = "") -> ConformanceError:
    """The error for a processor that broke `rule`: `processor 'name' <rule>: <detail>`."""
    return ConformanceError(f"processor {processor_name(processor)!r} {rule}" + (f": {detail}" if detail else ""))
