"""The stopping kit: `check_stopping_criterion` runs a stopping criterion on real sequences, directly and in a tiny
in-process engine, and raises one `ConformanceError` (an `AssertionError`) saying what is wrong:

    >>> from decodekit.testing import check_stopping_criterion
    >>> check_stopping_criterion("my_criterion", {"count": 2}, plugins=[my_plugin])

Called directly on real sequences (token by token, as the stop stage calls it), the criterion's decisions are
`StopDecision`s or None, the same on a second replay of the same tokens, never change the sequence or the
request's parameters, and a `truncate_text_at` lies within the text; in the engine, its requests give the same
outputs on a second run, alone and batched with others, and under speculative decoding (several tokens a step:
those after a stop are dropped) the same outputs as without (greedy). The `KitReport` counts the replayed
sequences it stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from decodekit.api.components import PlanError
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Request
from decodekit.api.sequence import Sequence as EngineSequence
from decodekit.api.stopping import StopDecision
from decodekit.core.detokenizer import IncrementalDetokenizer
from decodekit.core.plan import CriterionStage
from decodekit.core.stages.stop import append_text
from decodekit.testing.engine_harness import (
    Harness,
    KitReport,
    compare_outputs,
    kit_prompts,
    new_request_id,
    on_one_thread,
    plan_error,
    registered_name,
    run_alone,
    short_ids,
)


def _snapshot(seq: EngineSequence) -> dict[str, Any]:
    """What a criterion reads and must leave alone: the sequence's tokens, text and status, and the request's
    parameters and prompt (`stash` and `state` are the plugins' own, for a criterion's per-sequence state)."""
    return {
        "token_ids": list(seq.token_ids), "num_prompt_tokens": seq.num_prompt_tokens, "text": seq.text,
        "new_text_len": seq.new_text_len, "status": seq.status, "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason, "draft_token_ids": list(seq.draft_token_ids),
        "detokenizer text": seq.detokenizer.text, "request params": seq.request.params.model_dump(),
        "request prompt": list(seq.request.prompt_token_ids),
    }


def _replay(harness: Harness, stage: CriterionStage, plan: Any, params: SamplingParams, prompt: list[int],
            generated: list[int]) -> list[StopDecision | None]:
    """Call the criterion on `prompt + generated` token by token, as the stop stage does (the newest token
    detokenized first, by the stage's own `append_text`), on a fresh request and sequence; check each call's
    decision and that nothing changed.

    The criterion is called here rather than through `StopStage.run` because the kit holds it to more than the
    stage does: it sees every decision, also after a stop (the stage finishes the sequence at the first and drops
    the rest), checks each beyond its type (finish reason, `truncate_text_at`) and that the call changed nothing,
    and calls only the criterion under test (the stage runs the plan's default criteria before it)."""
    tokenizer = harness.llm.tokenizer
    engine = harness.llm.engine
    request = Request(new_request_id("kit-replay"), None, list(prompt), params)
    request.plan = plan
    seq = EngineSequence(request, list(prompt), len(prompt))
    seq.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
    request.sequences.append(seq)
    decisions: list[StopDecision | None] = []
    for position, token in enumerate(generated):
        seq.token_ids.append(token)
        append_text(seq)
        before = _snapshot(seq)
        where = f"at generated token {position} of {short_ids(generated)} (prompt {short_ids(prompt)})"
        try:
            decision = stage.check(seq, params, engine.eos_token_ids)
        except Exception as exc:
            raise harness.fail(f"raised {exc!r}", where) from exc
        after = _snapshot(seq)
        changed = [key for key in before if before[key] != after[key]]
        if changed:
            key = changed[0]
            raise harness.fail(f"changed the sequence it was checking ({', '.join(changed)})",
                               f"{where}: {key} {before[key]!r} -> {after[key]!r}; a criterion only reads the "
                               f"sequence (per-sequence state goes in `seq.stash`)")
        if decision is not None:
            if not isinstance(decision, StopDecision):
                raise harness.fail("returned something that is not a StopDecision or None",
                                   f"{where}: {type(decision).__name__}")
            if decision.finish_reason not in ("stop", "length"):
                raise harness.fail("returned a finish reason other than 'stop' or 'length'",
                                   f"{where}: {decision.finish_reason!r}")
            cut = decision.truncate_text_at
            if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool) or not 0 <= cut <= len(seq.text)):
                raise harness.fail("returned a truncate_text_at outside the text",
                                   f"{where}: {cut!r} for a text of {len(seq.text)} characters ({seq.text!r})")
        decisions.append(decision)
    return decisions


@on_one_thread
def check_stopping_criterion(criterion: Any, options: dict[str, Any] | None = None, *, plugins: Iterable[object] = (),
                             params: dict[str, Any] | None = None, prompts: Sequence[list[int]] | None = None,
                             max_tokens: int = 24, seed: int = 0) -> KitReport:
    """Check a stopping criterion on real sequences, directly and in a tiny engine; raise `ConformanceError` on the
    first rule it breaks (see the module docstring).

    Args:
        criterion: its registered name, or a `StoppingCriterion` class or instance (registered under its `name`).
        options: its parameters (a criterion requests name in `stopping:`); None for a default criterion, which
            `params` switch on instead.
        plugins: the plugins that register it (modules or objects with `@hookimpl` functions).
        params: `SamplingParams` fields of every request the criterion serves (`{"stop": ["\\n"]}` for the
            default stop-string criterion, `{"min_tokens": 2}`, ...).
        prompts: token-id prompts (default: a few random and repetitive ones, ids 3..383).
        max_tokens: tokens per request.
        seed: varies the default prompts and the sampled requests' seeds.

    Returns:
        what was exercised; `stops` counts the replayed sequences it stopped (0: choose options that stop).
    """
    name, plugins = registered_name("stopping_criteria", criterion, plugins)
    harness = Harness.build(plugins, f"stopping criterion {name!r}", draft="target")
    entry = harness.llm.engine.registry.stopping_criteria.get(name)
    if entry is None:
        raise harness.fail("is not registered", f"known: {sorted(harness.llm.engine.registry.stopping_criteria)}")
    fields = {"max_tokens": max_tokens, **(params or {})}
    if not entry.default:
        fields["stopping"] = [*fields.get("stopping", []), {name: options or {}}]
    elif options:
        raise ValueError(f"{name!r} is a default criterion: it takes no options (switch it on with `params=`)")
    greedy_fields = {"temperature": 0.0, **fields}
    greedy = SamplingParams(**greedy_fields)
    sampled = SamplingParams(**{**fields, "temperature": 0.8, "seed": 1000 + seed})
    prompts = list(prompts) if prompts is not None else kit_prompts(3, seed)
    try:
        plans = [harness.resolve(p) for p in (greedy, sampled)]
    except PlanError as exc:
        raise harness.fail("refused the kit's requests", str(exc)) from None
    stages = [next((c for c in plan.criteria if c.criterion.name == name), None) for plan in plans]
    if stages[0] is None or stages[1] is None:
        raise harness.fail("does not apply to the kit's requests",
                           "a default criterion applies where `is_active(params)`: pass `params=` that switch it on")

    # directly: real sequences, generated as the criterion's requests are (their processors apply) but with
    # nothing to stop them before max_tokens, replayed twice
    unstopped = {**fields, "ignore_eos": True, "stop": [], "stop_token_ids": [], "stopping": [], "strategy": None}
    stops = 0
    for plan, stage, request_params in zip(plans, stages, (greedy, sampled)):
        assert stage is not None
        source = SamplingParams(**{**unstopped, "temperature": request_params.temperature,
                                   "seed": request_params.seed})
        runs = harness.generate(prompts, [source] * len(prompts), "runs to replay, nothing stopping them")
        for prompt, run in zip(prompts, runs):
            first = _replay(harness, stage, plan, request_params, prompt, run.token_ids)
            second = _replay(harness, stage, plan, request_params, prompt, run.token_ids)
            if first != second:
                at = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
                raise harness.fail("is not deterministic: two replays of the same tokens got different decisions",
                                   f"generated token {at} of {short_ids(run.token_ids)}: {first[at]!r} vs "
                                   f"{second[at]!r} (does it depend on something besides the sequence, its "
                                   f"options and its own state in `seq.stash`?)")
            stops += any(d is not None for d in first)

    # in the engine: alone, batched with other requests, a second time, and under speculative decoding
    mine = [p for prompt in prompts for p in (greedy, sampled)]
    mine_prompts = [prompt for prompt in prompts for _ in (greedy, sampled)]
    others = [SamplingParams(temperature=0.0, max_tokens=max_tokens + 3, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=77 + seed, max_tokens=max(1, max_tokens - 5))]
    alone = run_alone(harness, mine_prompts, mine)
    batch_prompts = [*mine_prompts, *(prompts[i % len(prompts)] for i in range(len(others)))]
    batch_params = [*mine, *others]
    batched = harness.generate(batch_prompts, batch_params, "batched")[: len(mine)]
    again = harness.generate(batch_prompts, batch_params, "batched, second run")[: len(mine)]
    compare_outputs(harness, "gives different outputs on a second run", batched, again, mine,
                    ("first run", "second run"))
    compare_outputs(harness, "gives different outputs batched than alone", alone, batched, mine,
                    ("alone", "batched"))
    skipped: list[str] = []
    draft_tokens = accepted = 0
    # the target as its own draft: every draft is accepted, so steps bring several tokens and a stop lands
    # inside a step's tokens
    spec = SamplingParams(**{**greedy_fields, "strategy": {"speculative": {"proposer": "draft",
                                                                           "num_speculative_tokens": 4}}})
    refused = plan_error(harness, spec) if greedy.strategy is None else "the requests name their own strategy"
    if refused is None:
        spec_params = [spec] * len(prompts)
        speculative = harness.generate(prompts, spec_params, "speculative decoding")
        plain_greedy = [out for out, p in zip(alone, mine) if p.greedy]
        compare_outputs(harness, "gives different outputs under speculative decoding (several tokens a step: those "
                                 "after a stop must be dropped)", plain_greedy, speculative, spec_params,
                        ("without speculation", "with"))
        draft_tokens = sum(o.metrics.num_draft_tokens for o in speculative)
        accepted = sum(o.metrics.num_accepted_tokens for o in speculative)
    else:
        skipped.append(f"speculative decoding: {refused}")
    return KitReport(harness.requests, stops, draft_tokens, accepted, tuple(skipped))
