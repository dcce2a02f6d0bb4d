"""The terminal every command writes to: the consoles (results on stdout, progress and errors on stderr), the one
way a user error ends a command, and how much logging a command lets through.

Commands use these as `terminal.console` (an attribute looked up at each call, not a name imported once), so a test
can swap the console for one of a fixed width in this one place.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
"""Results: answers, tables, JSON (stdout)."""

err_console = Console(stderr=True)
"""Progress bars, notes and errors (stderr), so that stdout stays the result alone."""


def fail(message: str) -> NoReturn:
    """End the command on a user's mistake: one `error: ...` line on stderr and exit status 2."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def setup_logging(quiet: bool) -> None:
    """Log decodekit's INFO lines (WARNING only when `quiet`); transformers' own logging and progress bars stay off
    (they would interleave with the command's output)."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
