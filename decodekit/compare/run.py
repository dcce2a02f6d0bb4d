"""Running `decodekit compare`'s points one after the other, each on the same inputs: its seeded samples (timed: the
speed figures), one scoring pass of the outputs under the plain model where a metric needs it (untimed), the
metrics, and the lm-eval tasks. A point that fails (its model does not load, a plugin raises, a request fails) is
recorded with its reason and the run goes on.

Points that load the same model the same way share one engine (`Engines`); before its timed run each point
prefills its prompts once, untimed, so that every point finds them in the prefix cache and the first point does
not pay for the others' cache.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decodekit.api.hookspecs import hookimpl
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.compare.plan import ComparePlan
from decodekit.compare.points import Point
from decodekit.compare.quality import (
    MetricFigure,
    chosen_logprobs,
    sample_group,
    sample_params,
    sample_seed,
    score_metrics,
)
from decodekit.eval.scoring import score_tails
from decodekit.recipe import Recipe
from decodekit.recipe_runner import render_prompts, summarize

SPEED_KEYS = ("requests", "output_tokens", "wall_s", "tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s",
              "tpot_p90_s", "acceptance_rate", "proposer_tokens")
"""The figures of `decodekit.recipe_runner.summarize` a point reports as its speed (plus its KV blocks)."""


@dataclass
class PointResult:
    """What one point measured: its speed, its quality figures, its tasks' figures, its samples; or its failure."""

    point: Point
    error: str | None = None
    speed: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, MetricFigure] = field(default_factory=dict)
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the point ran to its end."""
        return self.error is None

    def accuracy(self, task: str) -> float | None:
        """The task's first metric (its accuracy in the report)."""
        return next(iter((self.tasks.get(task) or {}).values()), None)


class Engines:
    """The engine of the points being run: points that load the same model, dtype, device, draft and engine options
    share it; a point that needs another replaces it (one model in memory at a time)."""

    def __init__(self, plugin_manager: Any) -> None:
        self.plugin_manager = plugin_manager
        self.kv = KvPeak()
        plugin_manager.register(self.kv, name="decodekit-compare-kv-peak")
        self.key: str | None = None
        self.llm: Any = None

    def get(self, recipe: Recipe) -> Any:
        """The `LLM` for `recipe`, built when the last one served another model or options."""
        key = json.dumps(recipe.model_dump(mode="json", include={"model", "dtype", "device", "draft", "engine"}),
                         sort_keys=True)
        if key != self.key:
            self.llm, self.key = None, None  # the old one is freed before the new one loads
            self.llm = recipe.build_llm(self.plugin_manager)
            self.key = key
        return self.llm


class KvPeak:
    """The most KV blocks in use at once during a timed run, read after every engine step (a plugin of the run's
    plugin manager: `decodekit_step_finished` is called once per step, whether or not the step emitted anything, so
    strategies that only return final outputs are measured too)."""

    def __init__(self) -> None:
        self.peak: int | None = None  # None: not measuring

    @hookimpl
    def decodekit_step_finished(self, engine: Any) -> None:
        """Note the blocks in use after a step of a timed run."""
        if self.peak is not None:
            self.peak = max(self.peak, int(engine.stats()["kv_blocks_used"]))


def run_point(plan: ComparePlan, point: Point, engines: Engines,
              on_output: Callable[[RequestOutput], None] | None = None) -> PointResult:
    """Measure one point; never raises for a failure of the point itself (it is the result's `error`)."""
    result = PointResult(point)
    try:
        llm = engines.get(point.recipe)
        if point.label in plan.requests:
            _run_prompts(plan, point, engines, llm, result, on_output)
        if plan.tasks and result.ok:
            _run_tasks(plan, point, llm, result)
    except Exception as exc:  # a recipe that fails is reported, and the other points go on
        result.error = str(exc) or type(exc).__name__
    return result


def _run_prompts(plan: ComparePlan, point: Point, engines: Engines, llm: Any, result: PointResult,
                 on_output: Callable[[RequestOutput], None] | None) -> None:
    requests = plan.requests[point.label]
    distributions = plan.distributions[point.label]
    metrics = plan.metrics_for(point.label)
    wants_logprobs = any("logprobs" in m.needs for m in metrics)
    wants_model = any("model_logprobs" in m.needs for m in metrics)
    texts, tools = render_prompts(point.recipe, llm, requests)  # a recipe's tools constrain its samples too
    special = not point.recipe.inputs.chat  # a chat template already holds the special tokens
    # untimed: every prompt prefilled (and one decode step run) before the timed run, at every point alike
    llm.generate(texts, SamplingParams(max_tokens=2, temperature=0), add_special_tokens=special)
    prompts, params = [], []
    for i, (request, text, dist) in enumerate(zip(requests, texts, distributions)):
        for j in range(plan.samples):
            prompts.append(text)
            sampled = sample_params(request.params, sample_seed(plan.seed, i, j, plan.samples),
                                    wants_logprobs and dist == "processed")
            params.append(tools.constrain(sampled) if tools is not None else sampled)
    engines.kv.peak = 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, on_output=on_output, add_special_tokens=special)
    wall = time.perf_counter() - start
    kv_peak, engines.kv.peak = engines.kv.peak, None
    failed = [o for o in outputs if o.error is not None]
    if failed:
        result.error = f"{len(failed)} of {len(outputs)} requests failed: {failed[0].error}"
        return
    summary = summarize(outputs, wall)
    result.speed = {key: summary[key] for key in SPEED_KEYS}
    result.speed.update(kv_blocks_peak=kv_peak, kv_blocks_total=int(llm.engine.stats()["kv_blocks_total"]))
    model = _model_logprobs(llm, outputs) if wants_model else None
    groups = []
    for i, (request, dist) in enumerate(zip(requests, distributions)):
        own = outputs[i * plan.samples:(i + 1) * plan.samples]
        lps = [chosen_logprobs(o, dist) for o in own] if wants_logprobs else None
        groups.append(sample_group(request.prompt, own, lps,
                                   model[i * plan.samples:(i + 1) * plan.samples] if model is not None else None))
        result.samples.append({"id": request.id, "prompt": request.prompt, "texts": groups[-1].texts,
                               "token_ids": groups[-1].token_ids})
    result.quality = score_metrics(metrics, groups, plan.left_out.get(point.label))


def _model_logprobs(llm: Any, outputs: list[RequestOutput]) -> list[list[float] | None]:
    """log p of every generated token of each output's first sequence under the plain model: prompt and output
    scored as one prompt (untimed). None for an output that could not be scored (too long for the context)."""
    firsts = [o.outputs[0].token_ids if o.outputs else [] for o in outputs]
    todo = [i for i, ids in enumerate(firsts) if ids]
    scored = score_tails(llm, [list(outputs[i].prompt_token_ids) + list(firsts[i]) for i in todo],
                         [len(firsts[i]) for i in todo])
    values: list[list[float] | None] = [[] for _ in outputs]
    for i, entry in zip(todo, scored):
        values[i] = None if isinstance(entry, str) else [c.logprob for c in entry]
    return values


def _run_tasks(plan: ComparePlan, point: Point, llm: Any, result: PointResult) -> None:
    from decodekit.eval.harness import evaluate
    from decodekit.eval.model import DecodekitLM

    lm = DecodekitLM(recipe=point.recipe, llm=llm)
    # a chat recipe's task prompts go through the chat template too, as its open prompts do
    scores = evaluate(lm, plan.tasks, plan.task_manager, limit=plan.limit, seed=plan.seed,
                      apply_chat_template=point.recipe.inputs.chat)
    result.tasks = scores.metrics
    if not result.speed and lm.outputs:  # tasks only: the speed of their generation requests
        summary = summarize(lm.outputs, lm.generation_wall_s)
        result.speed = {key: summary[key] for key in SPEED_KEYS}


def request_count(plan: ComparePlan) -> int:
    """Timed generation requests of the whole run (what the progress bar counts)."""
    return sum(len(requests) * plan.samples for requests in plan.requests.values())

