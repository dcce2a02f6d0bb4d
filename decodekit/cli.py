"""The `decodekit` command line (typer + rich). Thin: parse, call the Python API, render."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from decodekit.errors import DecodeKitError

app = typer.Typer(help="decodekit: composable decoding strategies on a paged, continuously batched engine.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def summarize(outputs: list[Any], wall: float) -> dict[str, Any]:
    """Summary figures of a finished batch: requests, tokens, tokens/s, TTFT/TPOT p50/p90, finish reasons."""
    from decodekit.bench.report import percentile

    tokens = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    reasons: dict[str, int] = {}
    for o in outputs:
        reasons[str(o.finish_reason)] = reasons.get(str(o.finish_reason), 0) + 1
    return {
        "requests": len(outputs), "output_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "tpot_p50_s": percentile(tpots, 50), "tpot_p90_s": percentile(tpots, 90),
        "finish_reasons": reasons,
        "errors": [o.error for o in outputs if o.error],
    }


def render_summary(summary: dict[str, Any]) -> None:
    """Print the summary table."""
    table = Table(title="summary", show_header=False)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    table.add_row("requests", str(summary["requests"]))
    table.add_row("output tokens", str(summary["output_tokens"]))
    table.add_row("wall time", f"{summary['wall_s']:.2f} s")
    table.add_row("tokens/s", f"{summary['tokens_per_s']:.1f}" if summary["tokens_per_s"] else "-")
    table.add_row("TTFT p50 / p90", f"{ms(summary['ttft_p50_s'])} / {ms(summary['ttft_p90_s'])}")
    table.add_row("TPOT p50 / p90", f"{ms(summary['tpot_p50_s'])} / {ms(summary['tpot_p90_s'])}")
    table.add_row("finish reasons", ", ".join(f"{k}: {v}" for k, v in summary["finish_reasons"].items()))
    console.print(table)


@app.command()
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
    _setup_logging(quiet or as_json)
    from decodekit import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop=stop or [])
    except ValueError as exc:
        _fail(str(exc))
    try:
        llm = LLM(model, dtype=dtype, device=device)
        texts = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompt]
        start = time.perf_counter()
        outputs = llm.generate(texts, params, add_special_tokens=not chat)
        wall = time.perf_counter() - start
    except DecodeKitError as exc:
        _fail(str(exc))
    summary = summarize(outputs, wall)
    if as_json:
        rows = [{"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                 "error": o.error, "metrics": o.metrics.as_dict()} for p, o in zip(prompt, outputs)]
        print(json.dumps({"outputs": rows, "summary": summary}))
        return
    for p, o in zip(prompt, outputs):
        console.print(f"[bold cyan]>>> {p}[/]")
        console.print(o.text if o.error is None else f"[red]error: {o.error}[/]")
    render_summary(summary)


@app.command()
def plugins(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List installed plugins, what each registers, and where it came from."""
    from decodekit.plugins import get_plugin_manager, plugin_origins
    from decodekit.registry import Registry

    try:
        pm = get_plugin_manager()
    except DecodeKitError as exc:
        _fail(str(exc))
    registry = Registry.from_plugin_manager(pm)
    origins = plugin_origins(pm)
    rows: dict[str, dict[str, Any]] = {name: {"origin": origin, "processors": [], "stopping_criteria": [],
                                              "strategies": []} for name, origin in origins.items()}
    for kind in ("processors", "stopping_criteria", "strategies"):
        for entry in getattr(registry, kind).values():
            rows.setdefault(entry.plugin, {"origin": "?", "processors": [], "stopping_criteria": [],
                                           "strategies": []})[kind].append(entry.name)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="decodekit plugins")
    for col in ("plugin", "from", "processors", "stopping criteria", "strategies"):
        table.add_column(col)
    for name, row in rows.items():
        table.add_row(name, row["origin"], ", ".join(row["processors"]), ", ".join(row["stopping_criteria"]),
                      ", ".join(row["strategies"]))
    console.print(table)


@app.command()
def bench(
    workload: Annotated[str, typer.Argument(help="batch1, batch, mixed or ttft.")] = "mixed",
    model: Annotated[str, typer.Option(help="Model to benchmark.")] = "smollm2-135m-instruct",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    num_requests: Annotated[int, typer.Option(help="Requests in the mixed workload.")] = 64,
    batch_size: Annotated[int, typer.Option(help="Batch size (batch workload, HF static batches).")] = 16,
    output_len: Annotated[int, typer.Option(help="Output tokens (batch1/batch workloads).")] = 64,
    repeats: Annotated[int, typer.Option(help="Interleaved rounds; medians are reported.")] = 3,
    baseline: Annotated[list[str] | None, typer.Option(help="hf-sequential, hf-static, hf-cb (repeatable).")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Run decodekit and transformers side by side on one workload; print medians and ratios."""
    _setup_logging(True)
    from decodekit.bench import render_table, result_json, run_benchmark

    kwargs: dict[str, Any] = {"model": model, "dtype": dtype, "num_requests": num_requests,
                              "batch_size": batch_size, "output_len": output_len, "repeats": repeats, "seed": seed,
                              "num_threads": threads}
    if baseline:
        kwargs["baselines"] = tuple(baseline)
    try:
        result = run_benchmark(workload, **kwargs)
    except (DecodeKitError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        print(result_json(result))
    else:
        render_table(result, console)


def main() -> None:
    """Entry point: add plugin commands, run, and turn a DecodeKitError into one line and a non-zero exit."""
    try:
        from decodekit.plugins import get_plugin_manager

        get_plugin_manager().hook.decodekit_register_commands(cli=app)
        app()
    except DecodeKitError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)



