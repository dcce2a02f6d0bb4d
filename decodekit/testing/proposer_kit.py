"""The proposer kit: `check_proposer` runs speculative decoding with a proposer in a tiny in-process engine and
raises one `ConformanceError` (an `AssertionError`) saying what is wrong:

    >>> from decodekit.testing import check_proposer
    >>> check_proposer("my_proposer", {}, plugins=[my_plugin])

Speculative decoding with it must be lossless: greedy requests give exactly plain greedy's tokens, seeded sampled
requests the same tokens alone and batched (and on a second run); it must propose something (or the kit verified
nothing); every KV block, the engine's and the proposer's own model's, is free once the requests finish. The
`KitReport` counts the tokens it drafted and the target accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from decodekit.api.params import SamplingParams
from decodekit.core.registry import Registry
from decodekit.testing.engine_harness import (
    Harness,
    KitReport,
    compare_outputs,
    kit_prompts,
    on_one_thread,
    plan_error,
    registered_name,
    run_alone,
    shared_tiny_model,
)
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import plugin_manager


@on_one_thread
def check_proposer(proposer: Any, options: dict[str, Any] | None = None, *, plugins: Iterable[object] = (),
                   draft: Any = None, strategy: str = "speculative", num_speculative_tokens: int | None = 3,
                   prompts: Sequence[list[int]] | None = None, max_tokens: int = 16, seed: int = 0,
                   strategy_options: dict[str, Any] | None = None) -> KitReport:
    """Check that speculative decoding with a proposer is lossless and leaves nothing behind, in a tiny engine;
    raise `ConformanceError` on the first rule it breaks (see the module docstring).

    Args:
        proposer: its registered name, or a `Proposer` class or instance (registered under its `name`).
        options: its `proposer_options`.
        plugins: the plugins that register it (and `strategy`, when that is a plugin's).
        draft: the engine's draft model for a proposer that `needs_draft` (default: a tiny model of another
            architecture and seed, so drafts are sometimes rejected); `"target"`: the target model itself.
        strategy: the strategy that runs the proposer (its parameters: `proposer`, `proposer_options`,
            `num_speculative_tokens`).
        num_speculative_tokens: draft tokens per step (None: unset, so the strategy chooses: the speculative
            strategy adapts k to acceptance and the step's cost).
        prompts: token-id prompts (default: a few random and repetitive ones).
        max_tokens: tokens per request.
        seed: varies the default prompts and the sampled requests' seeds.
        strategy_options: more of the strategy's parameters (e.g. `{"tree": {"width": 2}}`: draft trees;
            `{"cost_model": "default"}`: adaptive speculation's fixed cost curve).
    """
    name, plugins = registered_name("proposers", proposer, plugins)
    registry = Registry.from_plugin_manager(plugin_manager(*plugins))
    if name not in registry.proposers:
        raise ConformanceError(f"proposer {name!r} is not registered; known: {sorted(registry.proposers)}")
    if draft is None and getattr(registry.proposers[name].factory, "needs_draft", False):
        draft = shared_tiny_model("qwen2", 3)  # another model than the target: some drafts are rejected, rolled back
    harness = Harness.build(plugins, f"proposer {name!r}", draft=draft)
    spec = {strategy: {"proposer": name, "proposer_options": options or {},
                       **({} if num_speculative_tokens is None else {"num_speculative_tokens": num_speculative_tokens}),
                       **(strategy_options or {})}}
    prompts = list(prompts) if prompts is not None else kit_prompts(4, seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec_greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, strategy=spec)
    error = plan_error(harness, spec_greedy)
    if error is not None:
        raise harness.fail("refused the kit's requests", error)
    plain = harness.generate(prompts, [greedy] * len(prompts), "plain greedy")
    speculative = harness.generate(prompts, [spec_greedy] * len(prompts), "speculative greedy, batched")
    compare_outputs(harness, f"is not lossless: speculative greedy decoding ({strategy}) gives other tokens than "
                             "plain greedy decoding", plain, speculative, [spec_greedy] * len(prompts),
                    ("plain", "speculative"))
    sampled = [SamplingParams(temperature=0.8, seed=500 + seed + i, max_tokens=max_tokens, ignore_eos=True,
                              strategy=spec) for i in range(len(prompts))]
    alone = run_alone(harness, prompts, sampled)
    mixed_prompts = [*prompts, *prompts]
    mixed = [*sampled, *([spec_greedy] * len(prompts))]
    mixed_prompts.append(prompts[0])
    mixed.append(SamplingParams(temperature=0.7, seed=9, max_tokens=max_tokens, ignore_eos=True))
    batched = harness.generate(mixed_prompts, mixed, "seeded sampled, batched")
    again = harness.generate(mixed_prompts, mixed, "seeded sampled, batched, second run")
    n = len(prompts)
    compare_outputs(harness, "gives different tokens on a second run of seeded sampled requests", batched[:n],
                    again[:n], sampled, ("first run", "second run"))
    compare_outputs(harness, "gives a seeded sampled request different tokens alone and batched", alone,
                    batched[:n], sampled, ("alone", "batched"))
    compare_outputs(harness, "is not lossless when batched with sampled requests", plain, batched[n : 2 * n],
                    [spec_greedy] * n, ("plain", "speculative"))
    runs = [*speculative, *alone, *batched, *again]
    drafted = sum(o.metrics.num_draft_tokens for o in runs)
    if drafted == 0:
        raise harness.fail("proposed no draft token on any of the kit's requests, so nothing was verified",
                           "pass `prompts=` on which it drafts")
    return KitReport(harness.requests, 0, drafted, sum(o.metrics.num_accepted_tokens for o in runs))
