"""`decodekit generate`: answers for prompts given on the command line, with sampling flags instead of a recipe."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.summary import render_summary

if TYPE_CHECKING:
    from pydantic import ValidationError


def generate(
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A prompt (repeatable).")],
    model: Annotated[str, typer.Option(help="Model: bundled name, folder, .gguf or hub id.")] = "smollm2-135m-instruct",
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = True,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Per-request seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if available).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text and a table.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Less logging.")] = False,
) -> None:
    """Generate answers for prompts with the engine, then print them and a summary table."""
    terminal.setup_logging(quiet or as_json)
    from pydantic import ValidationError

    from decodekit import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop=stop or [])
    except ValidationError as exc:
        terminal.fail(_flag_errors(exc))
    except ValueError as exc:
        terminal.fail(str(exc))
    try:
        llm = LLM(model, dtype=dtype, device=device)
        texts = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompt]
        start = time.perf_counter()
        outputs = llm.generate(texts, params, add_special_tokens=not chat)
        wall = time.perf_counter() - start
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    from decodekit.recipe_runner import summarize

    summary = summarize(outputs, wall)
    if as_json:
        rows = [{"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                 "error": o.error, "metrics": o.metrics.as_dict()} for p, o in zip(prompt, outputs)]
        print(json.dumps({"outputs": rows, "summary": summary}))
        return
    for p, o in zip(prompt, outputs):
        terminal.console.print(f"[bold cyan]>>> {p}[/]")
        terminal.console.print(o.text if o.error is None else f"[red]error: {o.error}[/]")
    render_summary(summary)


def _flag_errors(exc: ValidationError) -> str:
    """`SamplingParams` errors as the command line's flags: `--temperature: must be greater than or equal to 0,
    got -1.0` (one line per error)."""
    import re

    lines = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        field = next((str(part) for part in err["loc"] if isinstance(part, str)), "")
        if not field:  # a check across fields names the field in backticks: "`stop` strings must be non-empty"
            named = re.search(r"`(\w+)`", message)
            field = named.group(1) if named else ""
        flag = f"--{field.replace('_', '-')}" if field else "the sampling options"
        got = err.get("input")
        if not isinstance(got, (dict, list)) and f"got {got!r}" not in message:
            message += f", got {got!r}"
        lines.append(f"{flag}: {message}")
    return "\n".join(lines)
