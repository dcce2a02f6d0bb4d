"""Benchmark results: `BenchResult` and its per-system figures, summarized from the rounds, rendered as a rich
table for people and as JSON for machines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decodekit.bench.baselines import RunRecord
from decodekit.bench.machine import machine_line
from decodekit.bench.metrics import median, median_of_round_percentiles
from decodekit.tables import print_table

MISSING = "-"


@dataclass
class SystemFigures:
    """One system's figures over the rounds it completed (None where it could not provide one)."""

    name: str
    rounds: int = 0
    useful_tokens: int = 0  # per round; equals the workload's requested output tokens
    computed_tokens: int = 0  # per round, including padding waste
    wall_s: float | None = None
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    peak_rss_mb: float | None = None
    match_decodekit: float | None = None  # share of requests with decodekit's exact tokens (sanity check)
    prefix_decodekit: float | None = None  # mean share of decodekit's tokens matched before the first difference
    round_tokens_per_s: list[float] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class BenchResult:
    """Everything a benchmark measured: per-system figures, ratios decodekit / baseline, and context."""

    workload: dict[str, Any]
    model: str
    dtype: str
    device: str
    repeats: int
    systems: dict[str, SystemFigures]
    ratios: dict[str, float | None]  # baseline name -> median per-round decodekit tok/s / baseline tok/s
    engine_options: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def machine(self) -> str:
        """The machine line (`decodekit.bench.machine.machine_line`): the CPU and its flags, the dtype used, the
        torch threads, the versions and the commit."""
        return machine_line(self.environment, self.dtype, device=self.device,
                            dtype_requested=self.environment.get("dtype_requested"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of the whole result, with the machine line as `machine`."""
        return {**asdict(self), "machine": self.machine}


def summarize(fig: SystemFigures, records: list[RunRecord], reference: dict[int, list[list[int]]] | None) -> None:
    """Fill `fig` from a system's round records (`reference`: decodekit's outputs by round, for matching)."""
    if not records:
        return
    fig.rounds = len(records)
    fig.useful_tokens = records[0].useful_tokens
    fig.computed_tokens = records[0].computed_tokens
    fig.wall_s = median([r.wall_s for r in records])
    fig.round_tokens_per_s = [r.useful_tokens / r.wall_s for r in records]
    fig.tokens_per_s = median(list(fig.round_tokens_per_s))
    fig.ttft_p50_s, fig.ttft_p90_s = median_of_round_percentiles([r.ttft_s for r in records], (50, 90))
    fig.tpot_p50_s, fig.tpot_p90_s = median_of_round_percentiles([r.tpot_s for r in records], (50, 90))
    peaks = [r.peak_rss_bytes for r in records if r.peak_rss_bytes is not None]
    fig.peak_rss_mb = max(peaks) / 2**20 if peaks else None
    if reference is not None:
        ours = [out for rec in records if rec.round_index in reference for out in rec.outputs]
        theirs = [out for rec in records if rec.round_index in reference for out in reference[rec.round_index]]
        fig.match_decodekit, fig.prefix_decodekit = token_agreement(ours, theirs)


def token_agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float | None, float | None]:
    """How far a system's greedy tokens agree with the reference's (decodekit's), request by request.

    Returns:
        The share of requests whose tokens are identical, and the mean over requests of the common prefix's length
        over the reference's length (1.0 for an identical request, 0.5 when they part halfway); None, None for no
        requests.
    """
    pairs = list(zip(outputs, reference, strict=True))
    if not pairs:
        return None, None
    same = sum(a == b for a, b in pairs) / len(pairs)
    fractions = []
    for a, b in pairs:
        common = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            common += 1
        fractions.append(common / len(b) if b else float(a == b))
    return same, sum(fractions) / len(fractions)


def _ms(value: float | None) -> str:
    return MISSING if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return MISSING if value is None else fmt.format(value)


def _title(result: BenchResult) -> str:
    w = result.workload
    threads = result.environment.get("torch_threads")
    return (f"{w['name']}: {w['num_requests']} request(s), prompts {w['prompt_len_min']}-"
            f"{w['prompt_len_max']} tokens, outputs {w['output_len_min']}-{w['output_len_max']} tokens "
            f"({w['output_tokens']} in all) | {result.model} {result.dtype} on {result.device}, "
            f"{threads} threads, median of {result.repeats} round(s)")


def render_table(result: BenchResult, console: Console | None = None) -> Table:
    """Print the result as a table (one row per system) followed by its notes; returns the table.

    Args:
        result: what `run_benchmark` returned.
        console: where to print (a fresh `rich.console.Console` when None).
    """
    console = console or Console()
    table = Table(title=_title(result), title_justify="left")
    for header in ("system", "useful tok/s", "decodekit x", "wall s", "TTFT p50 ms", "TTFT p90 ms",
                   "TPOT p50 ms", "TPOT p90 ms", "peak RSS MiB", "computed/useful", "same tokens", "common prefix"):
        # fold rather than cut (a system's name, a figure): in a terminal too narrow nothing ends in an ellipsis
        table.add_column(header, justify="left" if header == "system" else "right", overflow="fold")
    for name, fig in result.systems.items():
        ratio = MISSING if name == "decodekit" else _num(result.ratios.get(name), "{:.2f}")
        waste = _num(fig.computed_tokens / fig.useful_tokens, "{:.2f}") if fig.useful_tokens else MISSING
        match = MISSING if fig.match_decodekit is None else f"{fig.match_decodekit:.0%}"
        prefix = MISSING if fig.prefix_decodekit is None else f"{fig.prefix_decodekit:.1%}"
        label = name if fig.error is None else f"{name} [red](error)[/red]"
        table.add_row(label, _num(fig.tokens_per_s), ratio, _num(fig.wall_s, "{:.2f}"),
                      _ms(fig.ttft_p50_s), _ms(fig.ttft_p90_s), _ms(fig.tpot_p50_s), _ms(fig.tpot_p90_s),
                      _num(fig.peak_rss_mb, "{:.0f}"), waste, match, prefix)
    print_table(console, table)  # piped or redirected: as wide as the names need
    for name, fig in result.systems.items():
        if fig.error:
            console.print(f"[red]{name}: {fig.error}[/red]")
        for note in fig.notes:
            console.print(f"{name}: {note}")
    for note in result.notes:
        console.print(f"[dim]{note}[/dim]")
    console.print(f"machine: {escape(result.machine)}", soft_wrap=True, highlight=False)
    return table


def jsonable(value: Any) -> Any:
    """`value` with NaN as None, dict keys as strings, tuples as lists and anything else not JSON as its `str`."""
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def result_json(result: BenchResult) -> str:
    """The result as an indented JSON document (`BenchResult.to_dict()`, with non-JSON values stringified)."""
    return json.dumps(jsonable(result.to_dict()), indent=2)
