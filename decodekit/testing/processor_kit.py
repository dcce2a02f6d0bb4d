"""The processor kit's one call: `check_processor` runs every check of `processor_checks` on cases hypothesis draws
(`processor_inputs.cases`) and raises one `ConformanceError`, an `AssertionError`, with the failing example:

    >>> from hypothesis import strategies as st
    >>> from decodekit.testing import check_processor
    >>> check_processor(MyProcessor(), st.builds(MyProcessor.Params, strength=st.floats(0, 2)))

Besides the per-case rules, one holds across the cases: a processor must keep a finite logit in some row of some
case. A constraint may empty a row (the engine then fails that request with a clear error), but a processor that
empties every row on every input is broken.

Every failure is a `ConformanceError` naming the processor: a processor that raises on a valid case included (the
message names the exception and the case), and several distinct failures found in one run (hypothesis reports them
together; the message lists each). This module needs hypothesis, not pytest, and nothing of the engine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Flaky

from decodekit.api.processors import LogitsProcessor
from decodekit.testing.errors import ConformanceError, processor_failure, processor_name
from decodekit.testing.processor_checks import ALL_CHECKS, check_keeps_a_finite_logit, keeps_some_finite_logit
from decodekit.testing.processor_inputs import Case, StrategyOrFactory, cases

if sys.version_info >= (3, 11):
    from builtins import ExceptionGroup as _ExceptionGroup
else:  # pragma: no cover - hypothesis depends on the backport there
    from exceptiongroup import ExceptionGroup as _ExceptionGroup


def _leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(group, _ExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]


def _from_group(processor: LogitsProcessor, group: BaseException) -> ConformanceError:
    """One `ConformanceError` for an exception group hypothesis raised: each distinct failure listed (several bugs
    found in one run), or the one failure said to be flaky; the falsifying examples become its notes."""
    failures: dict[str, list[str]] = {}
    for leaf in _leaves(group):
        text = str(leaf) if isinstance(leaf, ConformanceError) else f"{type(leaf).__name__}: {leaf}"
        failures.setdefault(text, list(getattr(leaf, "__notes__", [])))
    if len(failures) == 1:
        message = next(iter(failures))
    else:
        message = "\n".join([f"processor {processor_name(processor)!r} failed in {len(failures)} distinct ways:",
                             *(f"- {text}" for text in failures)])
    notes = [f"[{i}] {note}" if len(failures) > 1 else note
             for i, leaf_notes in enumerate(failures.values(), 1) for note in leaf_notes]
    if isinstance(group, Flaky):
        message += ("\n(the failure did not always reproduce: does the processor depend on something besides its "
                    "inputs, states and seeds?)")
        notes.append(str(getattr(group, "message", group)))
    error = ConformanceError(message)
    if hasattr(error, "add_note"):
        for note in notes:
            error.add_note(note)
    return error


def check_processor(processor: LogitsProcessor, options: StrategyOrFactory, *, max_examples: int = 50,
                    checks: Sequence[Callable[[LogitsProcessor, Case], None]] = ALL_CHECKS,
                    derandomize: bool = False, hypothesis_settings: settings | None = None,
                    **case_options: Any) -> None:
    """Run every check on `max_examples` generated cases; raise `ConformanceError` on failure (after hypothesis has
    shrunk the case to a small one; its falsifying example is in the error's notes).

    When hypothesis finds several distinct failures, the one `ConformanceError` lists each of them; a processor
    that raises on a valid case fails with a `ConformanceError` naming the exception and the case. With
    `check_keeps_a_finite_logit` among `checks`, a processor that leaves no finite logit in any row of any case
    drawn fails too (a constraint may empty some rows, not every row of every input).

    Args:
        processor: the processor (set up already, if it needs `setup`).
        options: strategy of its parameters, or a function of the vocabulary size returning one.
        max_examples: how many cases hypothesis generates.
        checks: which checks to run (default: all).
        derandomize: use a fixed hypothesis seed (reproducible CI runs).
        hypothesis_settings: settings to start from (e.g. `settings(phases=[Phase.generate])`, no shrinking);
            without them, every phase runs but `explain` (which re-runs a failing case many times to tell which of
            its parts matter: slow, and of little use on a tensor).
        **case_options: passed to `cases` (`vocab`, `sequences`, `params`, `max_drafts`, `dtype`, `device`,
            `info`: the `ComponentInfo` the processor was set up with, to run its `check_options_with` too).
    """
    base = (settings(phases=[phase for phase in Phase if phase is not Phase.explain]) if hypothesis_settings is None
            else hypothesis_settings)

    # `check_keeps_a_finite_logit` lets a constraint empty rows case by case; its other half needs every case seen
    tally = {"cases": 0, "kept": 0} if check_keeps_a_finite_logit in checks else None

    @settings(base, max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=cases(processor, options, **case_options))
    def run(case: Case) -> None:
        for check in checks:
            check(processor, case)
        if tally is not None:
            tally["cases"] += 1
            if not tally["kept"] and keeps_some_finite_logit(processor, case):  # one such case is enough
                tally["kept"] = 1

    try:
        run()
    except _ExceptionGroup as group:
        raise _from_group(processor, group) from group
    if tally is not None and tally["cases"] and not tally["kept"]:
        raise processor_failure(processor, "left every row of every case with every logit -inf (nothing to sample, "
                                           "whatever the input)",
                                f"no row of the {tally['cases']} case(s) drawn kept a finite logit; a constraint may "
                                f"empty some rows (the engine fails those requests with an error), but a processor "
                                f"that empties every row on every input is broken (does it ban every token, or do "
                                f"its options?)")
