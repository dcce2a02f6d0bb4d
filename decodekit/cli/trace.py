"""`decodekit trace FILE`: look at a decoding trace written by `decodekit run --trace`, in the terminal or as an
HTML page (the rendering is `decodekit.trace`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal


def trace(
    trace_path: Annotated[Path, typer.Argument(metavar="FILE", help="A trace file, written by `decodekit run "
                                               "RECIPE --trace FILE`.")],
    html: Annotated[Path | None, typer.Option(help="Write a self-contained HTML page here (click a token to see "
                                              "its step) instead of printing.")] = None,
    request: Annotated[str | None, typer.Option(help="Only this request: its id, else its 0-based position in "
                                                "the file.")] = None,
    sequence: Annotated[int | None, typer.Option(help="Only this output of each request (n > 1, beam search).")
                        ] = None,
    token: Annotated[int | None, typer.Option(help="Show this token's step in detail: each stage's candidates, how "
                                              "it was chosen, drafts, beams (with --html: select it).")] = None,
    steps: Annotated[str | None, typer.Option(help="Show these steps in detail: A:B (token indices, B excluded; "
                                              "A: or :B for an open end).")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Show every step in detail.")] = False,
) -> None:
    """Look at a decoding trace: each token coloured by its probability, and for the steps asked for, the candidates
    stage by stage (model, then each processor), how the token was chosen, drafts, beam decisions and the stop."""
    from decodekit.trace.format import read_trace
    from decodekit.trace.page import write_html
    from decodekit.trace.selection import only_sequence, parse_steps, select_requests
    from decodekit.trace.terminal import render_terminal

    try:
        chosen = select_requests(read_trace(trace_path), request)
        span = parse_steps(steps) if steps is not None else None
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    if html is None:
        render_terminal(chosen, terminal.console, sequence=sequence, token=token, steps=span, show_all=show_all)
        return
    chosen = only_sequence(chosen, sequence)
    first = chosen[0]
    out_index = sequence if sequence is not None else (first.outputs[0].index if first.outputs else 0)
    select = None if token is None else {"request": first.id, "output": out_index, "token": token}
    try:
        write_html(chosen, html, source=str(trace_path), select=select)
    except OSError as exc:
        terminal.fail(f"cannot write {html}: {exc}")
    tokens = sum(len(o.steps) for r in chosen for o in r.outputs)
    terminal.console.print(f"wrote {escape(str(html))} ({len(chosen)} request{'s' if len(chosen) != 1 else ''}, "
                           f"{tokens} tokens): open it in a browser, e.g. {escape(html.resolve().as_uri())}",
                           soft_wrap=True, highlight=False)
