"""`bench serve`'s figures: per server (requests, errors, tokens, throughput, TTFT and TPOT p50 / p99, memory, the
greedy texts that match decodekit's), the ratios decodekit / another server, and the result as a table and as
JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decodekit.bench.machine import machine_line
from decodekit.bench.metrics import percentiles
from decodekit.bench.report import MISSING
from decodekit.bench.serving.client import StreamResult
from decodekit.bench.serving.workload import ChatRequest
from decodekit.tables import print_table


@dataclass
class ServerFigures:
    """One server's figures over the timed run (None where it has none)."""

    name: str
    command: list[str] = field(default_factory=list)
    requests: int = 0
    completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    generated_tokens: int = 0
    tokens_from: str | None = None  # "usage", "chunks", or "usage (n requests by chunks)"
    prompt_tokens: int | None = None
    wall_s: float | None = None
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    rss_mb_end: float | None = None
    greedy_same_text: float | None = None  # share of greedy requests with decodekit's text (not decodekit)
    per_request: dict[str, list[Any]] = field(default_factory=dict)
    unavailable: str | None = None  # why the server did not run
    notes: list[str] = field(default_factory=list)


@dataclass
class ServeBenchResult:
    """Both servers' figures, the ratios decodekit / transformers, and the context of the run."""

    workload: dict[str, Any]
    model: str
    dtype: str
    clients: int
    servers: dict[str, ServerFigures]
    ratios: dict[str, float | None]
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    peer_ratios: dict[str, dict[str, float | None]] = field(default_factory=dict)  # peer key -> decodekit / peer

    @property
    def machine(self) -> str:
        """The machine line (`decodekit.bench.machine.machine_line`), with the servers' threads."""
        return machine_line(self.environment, self.dtype, threads=self.environment.get("server_threads"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of the whole result, with the machine line as `machine`."""
        return {**asdict(self), "machine": self.machine}


def summarize_run(fig: ServerFigures, results: Sequence[StreamResult], wall_s: float) -> None:
    """Fill `fig` from one timed run's per-request results."""
    ok = [r for r in results if r.error is None]
    fig.requests, fig.completed, fig.errors = len(results), len(ok), len(results) - len(ok)
    fig.error_samples = list(dict.fromkeys(r.error for r in results if r.error is not None))[:5]
    fig.generated_tokens = sum(r.tokens for r in ok)
    by_chunks = sum(r.usage_tokens is None for r in ok)
    fig.tokens_from = "usage" if by_chunks == 0 else "chunks" if by_chunks == len(ok) else \
        f"usage ({by_chunks} requests by chunks)"
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    fig.prompt_tokens = sum(prompts) if prompts and len(prompts) == len(ok) else None
    fig.wall_s = wall_s
    fig.tokens_per_s = fig.generated_tokens / wall_s if wall_s > 0 else None
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    fig.ttft_p50_s, fig.ttft_p99_s = percentiles(ttfts, (50, 99))
    fig.tpot_p50_s, fig.tpot_p99_s = percentiles(tpots, (50, 99))
    fig.per_request = {"tokens": [r.tokens for r in results], "chunks": [r.chunks for r in results],
                       "ttft_s": [r.ttft_s for r in results], "e2e_s": [r.e2e_s for r in results],
                       "finish_reason": [r.finish_reason for r in results], "error": [r.error for r in results]}


RATIO_FIELDS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def ratios(a: ServerFigures, b: ServerFigures | None) -> dict[str, float | None]:
    """Each of `RATIO_FIELDS` of `a` over `b`'s (None where either has none, or without `b`)."""
    out: dict[str, float | None] = {}
    for name in RATIO_FIELDS:
        x, y = getattr(a, name), getattr(b, name) if b is not None else None
        out[name] = x / y if x is not None and y else None
    return out


def same_greedy_text(work: Sequence[ChatRequest], ours: Sequence[StreamResult],
                      theirs: Sequence[StreamResult]) -> float | None:
    """The share of greedy requests both servers answered whose texts are identical."""
    greedy = [(a, b) for req, a, b in zip(work, ours, theirs, strict=False)
              if req.greedy and a.error is None and b.error is None]
    return sum(a.text == b.text for a, b in greedy) / len(greedy) if greedy else None


def _ms(value: float | None) -> str:
    return MISSING if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return MISSING if value is None else fmt.format(value)


def render_serve_table(result: ServeBenchResult, console: Console | None = None) -> Table:
    """Print the result as a table (one row per server and a ratio row) followed by its notes."""
    console = console or Console()
    w, env = result.workload, result.environment
    title = (f"serve: {w['num_requests']} chat requests ({w['greedy']} greedy, {w['sampled']} sampled), max_tokens "
             f"{w['max_tokens_min']}-{w['max_tokens_max']}, {result.clients} streaming clients | {result.model} "
             f"{result.dtype}, server threads: {env.get('server_threads')}")
    table = Table(title=title, title_justify="left")
    for header in ("server", "ok", "errors", "tokens", "wall s", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                   "TPOT p50 ms", "TPOT p99 ms", "RSS MiB", "greedy same text"):
        # fold rather than cut (a server's name, a figure): in a terminal too narrow nothing ends in an ellipsis
        table.add_column(header, justify="left" if header == "server" else "right", overflow="fold")
    for fig in result.servers.values():
        if fig.unavailable is not None:
            table.add_row(f"{fig.name} [red](not run)[/red]", *([MISSING] * 11))
            continue
        same = MISSING if fig.greedy_same_text is None else f"{fig.greedy_same_text:.0%}"
        table.add_row(fig.name, f"{fig.completed}/{fig.requests}", str(fig.errors), str(fig.generated_tokens),
                      _num(fig.wall_s), _num(fig.tokens_per_s), _ms(fig.ttft_p50_s), _ms(fig.ttft_p99_s),
                      _ms(fig.tpot_p50_s), _ms(fig.tpot_p99_s), _num(fig.rss_mb_end, "{:.0f}"), same)
    for label, r in [("transformers", result.ratios), *result.peer_ratios.items()]:
        if any(v is not None for v in r.values()):
            table.add_row(f"[bold]decodekit / {escape(label)}[/bold]", "", "", "", "",
                          _num(r["tokens_per_s"], "{:.2f}x"), *(_num(r[k], "{:.2f}x") for k in RATIO_FIELDS[1:]),
                          "", "")
    print_table(console, table)  # piped or redirected: as wide as the names need
    for fig in result.servers.values():
        if fig.unavailable is not None:
            console.print(f"[red]{fig.name} did not run: {fig.unavailable}[/red]", soft_wrap=True)
        if fig.tokens_from is not None:
            console.print(f"{fig.name}: generated tokens counted from {fig.tokens_from}")
        for sample in fig.error_samples:
            console.print(f"[red]{fig.name} error: {sample}[/red]", soft_wrap=True)
        for note in fig.notes:
            console.print(f"{fig.name}: {note}")
    for note in result.notes:
        console.print(f"[dim]{note}[/dim]")
    console.print(f"machine: {escape(result.machine)} | {env.get('date')}", soft_wrap=True, highlight=False)
    return table


def serve_result_json(result: ServeBenchResult) -> str:
    """The result as an indented JSON document."""
    return json.dumps(result.to_dict(), indent=2, default=str)


__all__ = ["RATIO_FIELDS", "ServeBenchResult", "ServerFigures", "ratios", "render_serve_table", "same_greedy_text",
           "serve_result_json", "summarize_run"]
