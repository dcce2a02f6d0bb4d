"""`decodekit compare`'s plan, every part of it checked before anything runs: the points (recipes x sweeps), their
prompts, the tasks, and the metrics each point can be measured by.

A metric that needs the strategy's logprobs (`kl`) is measured where the strategy says what it draws its tokens from
(`Strategy.token_distribution`). Asked for by name (`--metric kl`) on a point whose strategy cannot say, it is an
error naming both; left to the defaults (every registered metric), it is left out for that point, with the reason
in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decodekit.api.errors import ConfigError, DecodeKitError
from decodekit.api.metrics import Metric, check_metric
from decodekit.api.params import SamplingParams
from decodekit.compare.points import Point, Sweep, plan_points
from decodekit.core.plan import Components
from decodekit.recipe_runner import BadInput, RecipeRequest, read_inputs


@dataclass
class ComparePlan:
    """What one `compare` run measures; see `plan_compare`."""

    points: list[Point]
    metrics: list[Metric]
    requests: dict[str, list[RecipeRequest]] = field(default_factory=dict)  # per point label
    bad_inputs: list[BadInput] = field(default_factory=list)
    left_out: dict[str, dict[str, str]] = field(default_factory=dict)  # point label -> metric -> why
    distributions: dict[str, list[str | None]] = field(default_factory=dict)  # point label -> per request
    tasks: list[str] = field(default_factory=list)
    task_manager: Any = None
    samples: int = 4
    seed: int = 0
    limit: int | None = None

    def metrics_for(self, label: str) -> list[Metric]:
        """The metrics measured at one point."""
        skipped = self.left_out.get(label, {})
        return [m for m in self.metrics if m.name not in skipped]


def plan_compare(paths: Sequence[Path], registry: Any, *, sweeps: Sequence[Sweep] = (), overrides: Sequence[str] = (),
                 metric_names: Sequence[str] | None = None, prompts_file: Path | None = None,
                 tasks: Sequence[str] = (), include_path: Path | None = None, samples: int = 4, seed: int = 0,
                 limit: int | None = None) -> ComparePlan:
    """Check and plan a comparison; nothing is loaded or run.

    Raises:
        ConfigError: no inputs, a bad `--samples`, a sweep that is not a recipe key, an unknown task or metric, a
            metric that needs logprobs on a strategy that cannot give them (each message names the option).
        RecipeError: a recipe (or its prompts file) is invalid.
    """
    if prompts_file is None and not tasks:
        raise ConfigError("give the inputs: --prompts FILE (open prompts) or --tasks T (lm-eval tasks), or both")
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {samples}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    points = plan_points(paths, sweeps, overrides, registry)
    plan = ComparePlan(points, _metrics(registry, metric_names) if prompts_file is not None else [],
                       tasks=list(tasks), samples=samples, seed=seed, limit=limit)
    if tasks:
        from decodekit.eval.harness import task_manager

        plan.task_manager = task_manager(list(tasks), include_path)
    components = Components(registry)
    for point in points:
        if prompts_file is not None:
            requests, bad = read_inputs(point.recipe, components, prompts_file=prompts_file)
            if not requests:
                raise ConfigError(f"--prompts {prompts_file}: no prompt to run" + "".join(f"\n  {b}" for b in bad))
            plan.requests[point.label] = requests
            plan.bad_inputs = plan.bad_inputs or bad
            plan.distributions[point.label] = [_distribution(components, r.params) for r in requests]
        _check_metrics(plan, point, explicit=metric_names is not None)
    return plan


def _metrics(registry: Any, names: Sequence[str] | None) -> list[Metric]:
    """The metrics asked for (every registered one when None), built and checked."""
    chosen = list(registry.metrics) if names is None else list(dict.fromkeys(names))
    metrics = []
    for name in chosen:
        try:
            entry = registry.get("metrics", name)
        except DecodeKitError as exc:
            raise ConfigError(f"--metric: {exc}") from None
        metric = entry.factory()
        try:
            check_metric(metric)
        except ValueError as exc:
            raise ConfigError(f"--metric {name}: {exc} (registered by plugin {entry.plugin!r})") from None
        metrics.append(metric)
    return metrics


def _distribution(components: Components, params: SamplingParams) -> str | None:
    """What the request's strategy draws its tokens from (`Strategy.token_distribution`)."""
    resolved = components.resolve(params)
    return resolved.strategy.token_distribution(resolved.strategy_options, params)


def _check_metrics(plan: ComparePlan, point: Point, explicit: bool) -> None:
    distributions = plan.distributions.get(point.label, [])
    if all(d is not None for d in distributions):
        return
    strategy = point.recipe.strategy.name if point.recipe.strategy is not None else "sample"
    for metric in plan.metrics:
        if "logprobs" not in metric.needs:
            continue
        why = (f"strategy {strategy!r} cannot say what distribution it draws its tokens from, so it cannot give "
               "the logprobs of its choices")
        if explicit:
            raise ConfigError(f"--metric {metric.name} needs the logprobs of each chosen token under the strategy's "
                              f"own distribution, and {point.label}'s {why}; leave {metric.name} out, or compare "
                              "that recipe without it")
        plan.left_out.setdefault(point.label, {})[metric.name] = why
