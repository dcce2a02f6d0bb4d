"""The summary table `run` and `generate` print after the answers: requests, tokens, speed, latency percentiles,
finish reasons, draft acceptance and the speedup over plain sampling where measured."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from decodekit.cli import terminal


def render_summary(summary: dict[str, Any]) -> None:
    """Print the summary table (the figures of `decodekit.recipe_runner.summarize`)."""
    table = Table(title="summary", show_header=False)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    table.add_row("requests", str(summary["requests"]))
    several = summary.get("sequences", summary["requests"]) > summary["requests"]
    if several:  # n > 1 or beam search's num_return_sequences: the token figures below count every sequence
        table.add_row("returned sequences", str(summary["sequences"]))
    table.add_row("output tokens" + (" (all sequences)" if several else ""), str(summary["output_tokens"]))
    table.add_row("wall time", f"{summary['wall_s']:.2f} s")
    table.add_row("tokens/s", f"{summary['tokens_per_s']:.1f}" if summary["tokens_per_s"] else "-")
    table.add_row("TTFT p50 / p90", f"{ms(summary['ttft_p50_s'])} / {ms(summary['ttft_p90_s'])}")
    table.add_row("TPOT p50 / p90" + (" (per step)" if several else ""),
                  f"{ms(summary['tpot_p50_s'])} / {ms(summary['tpot_p90_s'])}")
    table.add_row("finish reasons", ", ".join(f"{k}: {v}" for k, v in summary["finish_reasons"].items()))
    if summary.get("acceptance_rate") is not None:
        table.add_row("draft acceptance", f"{summary['acceptance_rate']:.1%} "
                                          f"({summary['accepted_tokens']} of {summary['draft_tokens']} tokens)")
        by_proposer = summary.get("proposer_tokens") or {}
        if len(by_proposer) > 1:  # a chain: each proposer's share
            for name, counts in by_proposer.items():
                rate = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
                table.add_row(f"  by {name}", f"{rate:.1%} ({counts['accepted']} of {counts['drafted']} tokens)")
    if summary.get("speedup_vs_plain") is not None:
        # the speedup and the two rates it is the ratio of (each strategy's mean over its runs of the comparison),
        # both counted on each request's first answer, so several returned sequences do not inflate one side
        table.add_row("speedup vs plain sample", f"{summary['speedup_vs_plain']:.2f}x "
                                                 f"({summary['strategy_tokens_per_s']:.1f} vs "
                                                 f"{summary['plain_tokens_per_s']:.1f} mean tokens/s"
                                                 + (" of each request's first answer)" if several else ")"))
    if summary.get("errors"):
        table.add_row("failed requests", str(len(summary["errors"])))
    if summary.get("bad_inputs"):
        table.add_row("bad input lines", "\n".join(summary["bad_inputs"]))
    terminal.console.print(table)
