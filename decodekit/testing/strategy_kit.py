"""The strategy kit: `check_strategy` runs a search strategy in a tiny in-process engine and raises one
`ConformanceError` (an `AssertionError`) saying what is wrong:

    >>> from decodekit.testing import check_strategy
    >>> check_strategy("my_strategy", {"width": 3}, plugins=[my_plugin])

Its requests (greedy, seeded sampled, and parallel when it accepts them) must give the same outputs on a second run
(same seeds), alone and mixed in one batch with requests of other strategies; outputs are well formed (a finish
reason, token ids in the vocabulary, at most `max_tokens`, as many outputs as promised); every KV block is free once
they finish; optionally (`lossless=True`) greedy requests give plain greedy's tokens. The `KitReport` lists the
request kinds the strategy refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.testing.engine_harness import (
    Harness,
    KitReport,
    compare_outputs,
    describe_params,
    kit_prompts,
    on_one_thread,
    plan_error,
    registered_name,
    run_alone,
)

_VARIANTS: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 7},
    {"temperature": 0.8, "seed": 11, "n": 2},
)
"""The kinds of request `check_strategy` sends a strategy by default: greedy, seeded sampled, parallel sampled."""


def _others(harness: Harness, max_tokens: int, seed: int) -> list[SamplingParams]:
    """Requests of other strategies to batch the strategy's with: plain greedy, parallel sampling and (when
    registered) beam search; those this engine's registry cannot plan are left out."""
    candidates = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens + 3),
        SamplingParams(temperature=0.7, seed=31 + seed, max_tokens=max(1, max_tokens - 3), n=2),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, strategy={"beam_search": {"num_beams": 2}}),
    ]
    return [p for p in candidates if plan_error(harness, p) is None]


def _check_well_formed(harness: Harness, outs: Sequence[RequestOutput], params: Sequence[SamplingParams],
                       expected: Sequence[int | None]) -> None:
    vocab = harness.llm.engine.vocab_size
    for i, (out, p, want) in enumerate(zip(outs, params, expected)):
        where = f"request {i} ({describe_params(p)})"
        if want is not None and len(out.outputs) != want:
            raise harness.fail("returned another number of outputs than promised",
                               f"{where}: {len(out.outputs)} outputs, expected {want}")
        if not out.outputs:
            raise harness.fail("returned no output", where)
        for k, o in enumerate(out.outputs):
            if o.finish_reason not in ("stop", "length"):
                raise harness.fail("finished an output without a finish reason ('stop' or 'length')",
                                   f"{where} output {k}: {o.finish_reason!r}")
            bad = [t for t in o.token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise harness.fail("returned token ids outside the vocabulary", f"{where} output {k}: {bad[:8]}")
            if len(o.token_ids) > p.max_tokens:
                raise harness.fail("returned more tokens than max_tokens",
                                   f"{where} output {k}: {len(o.token_ids)} > {p.max_tokens}")


@on_one_thread
def check_strategy(strategy: Any, options: dict[str, Any] | None = None, *, plugins: Iterable[object] = (),
                   params: Sequence[dict[str, Any]] | None = None, prompts: Sequence[list[int]] | None = None,
                   max_tokens: int = 10, draft: Any = None,
                   num_outputs: Callable[[Any, SamplingParams], int] | None = None, lossless: bool = False,
                   seed: int = 0) -> KitReport:
    """Check a search strategy in a tiny engine: the same outputs alone and batched with other strategies'
    requests and on a second run, well-formed outputs, every KV block freed; raise `ConformanceError` on the
    first rule it breaks (see the module docstring).

    Args:
        strategy: its registered name, or a `Strategy` class or instance (registered under its `name`).
        options: its parameters (`strategy: {name: options}`).
        plugins: the plugins that register it.
        params: the kinds of request to send it, as `SamplingParams` fields (default: greedy, seeded sampled, and
            seeded parallel sampling with n=2); kinds the strategy refuses when planned are skipped (and listed in
            the report), but it must accept one.
        prompts: token-id prompts (default: a few random and repetitive ones).
        max_tokens: tokens per request.
        draft: the engine's draft model, if the strategy needs one (`"target"`: the target model itself).
        num_outputs: how many outputs a request promises, given the validated options and its parameters (default:
            `params.n`).
        lossless: greedy requests must give exactly plain greedy decoding's tokens (speculative decoding).
        seed: varies the default prompts.
    """
    name, plugins = registered_name("strategies", strategy, plugins)
    harness = Harness.build(plugins, f"strategy {name!r}", draft=draft)
    if name not in harness.llm.engine.registry.strategies:
        raise harness.fail("is not registered", f"known: {sorted(harness.llm.engine.registry.strategies)}")
    prompts = list(prompts) if prompts is not None else kit_prompts(3, seed)
    kinds: list[SamplingParams] = []
    skipped: list[str] = []
    for variant in params if params is not None else _VARIANTS:
        p = SamplingParams(**{"max_tokens": max_tokens, **variant, "strategy": {name: options or {}}})
        error = plan_error(harness, p)
        if error is None:
            kinds.append(p)
        else:
            skipped.append(f"{describe_params(p)}: {error}")
    if not kinds:
        raise harness.fail("refused every kind of request the kit sends", "; ".join(skipped))
    mine = [p for p in kinds for _ in prompts]
    mine_prompts = [prompt for _ in kinds for prompt in prompts]
    expected = []
    for p in mine:
        plan = harness.resolve(p)
        expected.append(num_outputs(plan.strategy_options, p) if num_outputs is not None else p.n)

    alone = run_alone(harness, mine_prompts, mine)
    _check_well_formed(harness, alone, mine, expected)
    others = _others(harness, max_tokens, seed)
    batch_params: list[SamplingParams] = []
    batch_prompts: list[list[int]] = []
    order: list[int] = []  # where each of the strategy's requests sits in the mixed batch
    for i, (prompt, p) in enumerate(zip(mine_prompts, mine)):
        if others:  # interleave: the strategy's requests share every step with other strategies' requests
            batch_params.append(others[i % len(others)])
            batch_prompts.append(prompts[(i + 1) % len(prompts)])
        order.append(len(batch_params))
        batch_params.append(p)
        batch_prompts.append(prompt)
    first = harness.generate(batch_prompts, batch_params, "batched with other strategies")
    second = harness.generate(batch_prompts, batch_params, "batched, second run")
    batched, again = [first[j] for j in order], [second[j] for j in order]
    _check_well_formed(harness, batched, mine, expected)
    compare_outputs(harness, "is not deterministic: the same seeds gave other outputs on a second run", batched,
                    again, mine, ("first run", "second run"), scores=True)
    compare_outputs(harness, "gives different outputs batched than alone (does it draw from the global RNG, or let "
                             "one request's state reach another?)", alone, batched, mine, ("alone", "batched"),
                    scores=True)
    if lossless:
        greedy = [(prompt, p) for prompt, p in zip(mine_prompts, mine) if p.greedy]
        if not greedy:
            skipped.append("lossless: the strategy refused greedy requests")
        else:
            plain_params = [p.model_copy(update={"strategy": None}) for _, p in greedy]
            plain = harness.generate([g[0] for g in greedy], plain_params, "plain greedy")
            ours = [out for out, p in zip(alone, mine) if p.greedy]
            compare_outputs(harness, "is not lossless: greedy requests give other tokens than plain greedy decoding",
                            plain, ours, [p for _, p in greedy], ("plain", name))
    runs = [*alone, *batched, *again]
    return KitReport(harness.requests, 0, sum(o.metrics.num_draft_tokens for o in runs),
                     sum(o.metrics.num_accepted_tokens for o in runs), tuple(skipped))
