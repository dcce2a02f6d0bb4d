"""Running a recipe: reading its prompts, generating (and the plain-strategy comparison), the rows written per
request and the summary figures. The CLI renders what these return; Python users call them directly.

A prompts file with a bad line does not stop the run: the good lines run, and each bad one comes back as a
`BadInput` naming its line and the reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decodekit.api.errors import DecodeKitError, RecipeError
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.bench.metrics import percentiles, request_latencies
from decodekit.core.plan import Components
from decodekit.recipe import COMPONENT_KEYS, Recipe, plain_params
from decodekit.recipe_syntax import format_validation_errors, read_text_capped
from decodekit.tool_calling import ToolPlan, calls_row
from decodekit.trace.format import trace_row as format_trace_row

MAX_PROMPTS_FILE_BYTES = 64 << 20
"""A prompts file larger than this (64 MiB) is refused: it is read whole, and every line becomes a request."""


@dataclass
class RecipeRequest:
    """One request of a run: its id, the prompt as the user wrote it, and its merged parameters."""

    id: str
    prompt: str
    params: SamplingParams


@dataclass
class BadInput:
    """An input line that was not run: where it is (`prompts.jsonl line 3`), why, and the id its request would
    have had (the line's own `id`, else its position), so an output row for it joins the input like the others."""

    where: str
    message: str
    id: str | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class InputLine(BaseModel):
    """One line of a .jsonl prompts file: a prompt and its overrides of the recipe's defaults."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="The prompt (wrapped in the chat template when inputs.chat).")
    id: str | int | None = Field(None, description="The request's id in the outputs (default: its position).")
    sampling: dict[str, Any] = Field(default_factory=dict, description="SamplingParams fields to override.")
    processors: list[Any] | None = Field(None, description="Processors merged over the recipe's, by name.")
    stopping: list[Any] | None = Field(None, description="Stopping criteria merged over the recipe's, by name.")
    strategy: Any = Field(None, description="A strategy replacing the recipe's.")
    reasoning: dict[str, Any] | None = Field(None, description="Reasoning settings merged over the recipe's, per "
                                             "phase (docs/reasoning.md).")

    def overrides(self) -> dict[str, Any]:
        """The line's overrides in `Recipe.params_for` form."""
        misplaced = sorted(set(self.sampling) & set(COMPONENT_KEYS))
        if misplaced:
            raise RecipeError(f"sampling: set {', '.join(misplaced)} next to sampling, not inside it")
        out = dict(self.sampling)
        for key in (*COMPONENT_KEYS, "reasoning"):
            if key in self.model_fields_set:
                out[key] = getattr(self, key)
        return out


def read_inputs(recipe: Recipe, components: Components, prompts: Sequence[str] = (),
                prompts_file: str | Path | None = None) -> tuple[list[RecipeRequest], list[BadInput]]:
    """The run's requests: `prompts` and `prompts_file` when given (they replace the recipe's inputs), else the
    recipe's `inputs.prompts` and `inputs.file`. Each request's parameters are merged and resolved here, so a bad
    line is reported before anything runs.

    Raises:
        RecipeError: the prompts file is missing, unreadable, larger than `MAX_PROMPTS_FILE_BYTES`, not UTF-8, or
            of an unknown kind.
    """
    if prompts or prompts_file is not None:
        texts, file = list(prompts), Path(prompts_file) if prompts_file is not None else None
    else:
        texts = list(recipe.inputs.prompts)
        file = recipe.base_dir / recipe.inputs.file if recipe.inputs.file is not None else None
    requests = [RecipeRequest(str(i + 1), text, recipe.default_params()) for i, text in enumerate(texts)]
    bad: list[BadInput] = []
    if file is not None:
        # a line's default id is its position among the file's lines (blank ones skipped, bad ones counted, as
        # `decodekit batch` numbers its rows), after the prompts given before it: a bad line does not shift the
        # ids of the lines after it, so outputs stay joinable to the input by id
        for position, (where, line) in enumerate(_file_lines(file), len(texts) + 1):
            try:
                requests.append(_request_from_line(recipe, components, line, str(position)))
            except DecodeKitError as exc:
                bad.append(BadInput(where, str(exc), _line_id(line, str(position))))
    return requests, bad


def _line_id(line: Any, default: str) -> str:
    """The id a line asks for (a JSON object's scalar `id`), else `default`."""
    own = line.get("id") if isinstance(line, dict) else None
    return str(own) if isinstance(own, (str, int)) and not isinstance(own, bool) else default


def _file_lines(file: Path) -> list[tuple[str, Any]]:
    """The file's non-blank lines: where each is (`prompts.jsonl line 3`) and its value (a .txt line's text, a
    .jsonl line's parsed JSON, or the `RecipeError` parsing it raised)."""
    if file.suffix not in (".jsonl", ".txt"):
        raise RecipeError(f"{file}: a prompts file is .jsonl (one JSON object per line) or .txt (one prompt per line)")
    text = read_text_capped(file, MAX_PROMPTS_FILE_BYTES, "prompts file")
    lines = [(f"{file.name} line {n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if file.suffix == ".txt":
        return lines
    parsed: list[tuple[str, Any]] = []
    for where, line in lines:
        try:
            parsed.append((where, json.loads(line)))
        except json.JSONDecodeError as exc:
            parsed.append((where, RecipeError(f"not valid JSON: {exc.msg} (column {exc.colno})")))
    return parsed


L = TypeVar("L", bound=InputLine)


def parse_line(recipe: Recipe, components: Components, line: Any, model: type[L]) -> tuple[L, SamplingParams]:
    """An input line (a parsed JSON value, a text line, or the error that reading it raised) validated into `model`,
    and its parameters: the recipe's defaults with the line's overrides merged and resolved.

    Raises:
        DecodeKitError: the line is not an object of `model`'s shape, names an unknown plugin or bad parameters.
    """
    if isinstance(line, Exception):
        raise line
    if isinstance(line, str):  # a .txt line, or a bare JSON string
        line = {"prompt": line}
    if not isinstance(line, dict):
        raise RecipeError(f"expected an object like {{\"prompt\": \"...\"}}, got {type(line).__name__}")
    try:
        item = model.model_validate(line)
    except ValidationError as exc:
        raise RecipeError(format_validation_errors(exc, model).replace("\n", "; ")) from None
    params = recipe.params_for(item.overrides(), sampling_key="sampling")
    components.resolve(params)  # unknown names, bad plugin parameters and refused combinations fail here
    return item, params


def _request_from_line(recipe: Recipe, components: Components, line: Any, default_id: str) -> RecipeRequest:
    item, params = parse_line(recipe, components, line, InputLine)
    return RecipeRequest(default_id if item.id is None else str(item.id), item.prompt, params)


@dataclass
class RunResult:
    """What a run produced: outputs in request order, its wall time, and the plain-strategy comparison."""

    requests: list[RecipeRequest]
    outputs: list[RequestOutput]
    wall_s: float
    plain_outputs: list[RequestOutput] | None = None
    plain_wall_s: float | None = None  # mean over the plain runs
    strategy_wall_s: float | None = None  # mean over the recipe-strategy runs of the comparison


def render_prompts(recipe: Recipe, llm: Any, requests: Sequence[RecipeRequest]) -> tuple[list[str], ToolPlan | None]:
    """The prompt texts the engine gets: chat-templated (with the system prompt) when `inputs.chat`; and with
    `inputs.tools` the tool plan every request calls them under (None: no tool calling)."""
    if not recipe.inputs.chat:
        return [r.prompt for r in requests], None
    inputs = recipe.inputs
    system = [{"role": "system", "content": inputs.system}] if inputs.system else []
    chats = [llm.chat_prompt([*system, {"role": "user", "content": r.prompt}], inputs.tools, inputs.tool_choice,
                             inputs.parallel_tool_calls, inputs.tool_format) for r in requests]
    return [prompt for prompt, _ in chats], chats[0][1] if chats else None


def forget_outputs(llm: Any) -> None:
    """Have every proposer the engine built forget the outputs of finished requests (`Proposer.forget_outputs`):
    before each timed run of a comparison, so a repeated prompt is not drafted from the answer an earlier run gave."""
    for proposer in llm.engine.components.built("proposers"):
        proposer.forget_outputs()


def run_recipe(recipe: Recipe, llm: Any, requests: Sequence[RecipeRequest],
               on_output: Callable[[RequestOutput], None] | None = None) -> RunResult:
    """Generate every request in one continuous batch; with `outputs.compare_plain`, run them again with the
    plain `sample` strategy. Before a comparison, an untimed warm-up prefills every prompt (one token each), so
    both timed runs find the prompts in the prefix cache and first-call costs favour neither, and the model's step
    cost is measured if it is not cached yet, and before each timed run the proposers forget earlier runs' outputs
    (`forget_outputs`): the ratio compares decoding. With `inputs.tools`, outputs are constrained to the tools' calls
    and read back (`tool_calls`)."""
    texts, plan = render_prompts(recipe, llm, requests)
    # A chat template already holds the special tokens (BOS); adding them again would change the prompt.
    options = {"add_special_tokens": not recipe.inputs.chat, "on_output": on_output}
    params = [plan.constrain(r.params) if plan is not None else r.params for r in requests]
    if recipe.outputs.compare_plain and texts:
        warm_up = SamplingParams(max_tokens=1, temperature=0)
        llm.generate(texts, warm_up, add_special_tokens=not recipe.inputs.chat)
        # speculation's cost model reads the step cost at its first step: measured on a new machine (or after the
        # kernels change), it would land inside the recipe's timed run
        llm.engine.step_cost()
    start = time.perf_counter()
    outputs = llm.generate(texts, params, **options)
    if plan is not None:
        outputs = [plan.read_into(o) for o in outputs]
    result = RunResult(list(requests), outputs, time.perf_counter() - start)
    if recipe.outputs.compare_plain:
        # A B B A: the recipe's run, two plain runs, the recipe's strategy again (outputs discarded). On a noisy
        # machine a single pair can mislead; the mirrored order cancels a drift in machine speed.
        plain_params_list = [plain_params(p) for p in params]
        plain_walls = []
        for _ in range(2):
            start = time.perf_counter()
            result.plain_outputs = llm.generate(texts, plain_params_list, **options)
            plain_walls.append(time.perf_counter() - start)
        forget_outputs(llm)  # the first run's answers would draft the second's
        start = time.perf_counter()
        llm.generate(texts, params, add_special_tokens=not recipe.inputs.chat)
        result.strategy_wall_s = (result.wall_s + time.perf_counter() - start) / 2
        result.plain_wall_s = sum(plain_walls) / len(plain_walls)
    return result


def output_row(request: RecipeRequest, output: RequestOutput) -> dict[str, Any]:
    """One JSON line of `--output`: id, prompt, text, token_ids, finish_reason, usage, metrics (and every choice,
    with its score, when a request returns several)."""
    completion_tokens = sum(len(o.token_ids) for o in output.outputs)
    row: dict[str, Any] = {
        "id": request.id,
        "prompt": request.prompt,
        "text": output.text,
        "token_ids": list(output.token_ids),
        "finish_reason": output.finish_reason,
        "stop_reason": output.outputs[0].stop_reason if output.outputs else None,
        "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(output.prompt_token_ids) + completion_tokens},
        "metrics": output.metrics.as_dict(),
    }
    if output.outputs and output.outputs[0].tool_calls:
        row["tool_calls"] = calls_row(output.outputs[0].tool_calls)
    if len(output.outputs) > 1:
        row["choices"] = [{"index": o.index, "text": o.text, "token_ids": list(o.token_ids),
                           "finish_reason": o.finish_reason, "stop_reason": o.stop_reason, "score": o.score,
                           "cumulative_logprob": o.cumulative_logprob} for o in output.outputs]
    if output.error is not None:
        row["error"] = output.error
    return row


DEFAULT_TRACE = 5
"""Candidates kept per stage when `decodekit run --trace FILE` turns the trace on."""


def trace_row(request: RecipeRequest, output: RequestOutput) -> dict[str, Any]:
    """One JSON line of `--trace`: the request, and each returned sequence's text, tokens and trace events. The row's
    format is `decodekit.trace.format`'s, which `decodekit trace` reads back."""
    return format_trace_row(request.id, request.prompt, output)


def summarize(outputs: Sequence[RequestOutput], wall: float, bad_inputs: Sequence[BadInput] = (),
              plain_outputs: Sequence[RequestOutput] | None = None, plain_wall: float | None = None,
              strategy_wall: float | None = None) -> dict[str, Any]:
    """Summary figures: requests, returned sequences, tokens (every sequence), tokens/s, TTFT/TPOT p50/p90 (TPOT per
    output position: `RequestMetrics.tpot`), finish reasons, the acceptance rate when draft tokens were proposed
    (and per proposer, `proposer_tokens`), the plain-strategy comparison, and what failed.

    `output_tokens` counts every returned sequence's tokens and `tokens_per_s` is that over this run's `wall`.
    With a comparison (`plain_outputs`, `plain_wall`: the plain runs' mean wall time) both sides are counted
    alike, on each request's first returned sequence (the best one of beam search, the first of `n`):
    `answer_tokens` and `plain_answer_tokens`; `strategy_tokens_per_s` is the recipe strategy's answer tokens over
    its mean wall time in the comparison (`strategy_wall`, default `wall`), `plain_tokens_per_s` the plain
    strategy's, and `speedup_vs_plain` exactly their ratio. A strategy that returns four beams where plain sampling
    returns one answer is not credited with four times the tokens; the figures the summary prints side by side are
    the ones the speedup is computed from."""
    tokens = _tokens(outputs)
    ttfts, tpots = request_latencies(outputs)
    ttft_p50, ttft_p90 = percentiles(ttfts, (50, 90))
    tpot_p50, tpot_p90 = percentiles(tpots, (50, 90))
    reasons: dict[str, int] = {}
    for o in outputs:
        reasons[str(o.finish_reason)] = reasons.get(str(o.finish_reason), 0) + 1
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    by_proposer: dict[str, dict[str, int]] = {}
    for o in outputs:
        for name, counts in o.metrics.proposer_tokens.items():
            total = by_proposer.setdefault(name, {"drafted": 0, "accepted": 0})
            total["drafted"] += counts["drafted"]
            total["accepted"] += counts["accepted"]
    summary: dict[str, Any] = {
        "requests": len(outputs), "sequences": sum(len(o.outputs) for o in outputs), "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": ttft_p50, "ttft_p90_s": ttft_p90, "tpot_p50_s": tpot_p50, "tpot_p90_s": tpot_p90,
        "finish_reasons": reasons,
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "proposer_tokens": by_proposer,
        "errors": [o.error for o in outputs if o.error],
        "bad_inputs": [str(b) for b in bad_inputs],
    }
    if plain_outputs is not None and plain_wall:
        answers, plain_answers = _answer_tokens(outputs), _answer_tokens(plain_outputs)
        plain_rate = plain_answers / plain_wall
        own_wall = strategy_wall or wall
        own_rate = answers / own_wall if own_wall > 0 else None
        summary["answer_tokens"] = answers
        summary["plain_answer_tokens"] = plain_answers
        summary["strategy_tokens_per_s"] = own_rate
        summary["plain_tokens_per_s"] = plain_rate
        summary["speedup_vs_plain"] = own_rate / plain_rate if own_rate is not None and plain_rate else None
    return summary


def _tokens(outputs: Sequence[RequestOutput]) -> int:
    """Every returned sequence's tokens."""
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def _answer_tokens(outputs: Sequence[RequestOutput]) -> int:
    """The tokens of each request's first returned sequence (beam search's best): what a comparison of strategies
    that return different numbers of sequences counts on both sides."""
    return sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
