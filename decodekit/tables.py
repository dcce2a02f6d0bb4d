"""Printing rich tables whose cells are names (plugins, components, systems) without cutting them short.

rich lays a table out to its console's width. With no terminal to ask (output piped or redirected, as in CI or
`decodekit plugins | grep ...`), that width is 80 columns, and a table wider than that shrinks its columns and ends
long names with an ellipsis: `decodekit_plugins.sampling` became `decodekit…`, and a name that is cut cannot be
copied into a recipe or grepped for. `print_table` prints such a table at the width it needs instead; the tables'
name columns also use `overflow="fold"` so that, in a terminal too narrow for them, a name wraps onto the next line
rather than losing its end.
"""

from __future__ import annotations

import copy
import os

from rich.console import Console
from rich.table import Table

_UNBOUNDED = 10_000
"""A width no table reaches, to measure the width a table needs when nothing wraps."""


def print_table(console: Console, table: Table) -> None:
    """Print `table` on `console`, at the width its widest row needs when the output is not a terminal.

    A pipe or a file has no width to fit, so there the table is laid out as wide as its content (never narrower
    than the console) and nothing in it wraps or is cut. A terminal keeps its own width, and so does output when
    the COLUMNS environment variable is set: that is a width someone chose (rich honours it too).

    Args:
        console: where to print.
        table: the table; it is not changed (a copy is widened).
    """
    if console.is_terminal or os.environ.get("COLUMNS"):
        console.print(table)
        return
    needed = console.measure(table, options=console.options.update_width(_UNBOUNDED)).maximum
    if needed <= console.width:
        console.print(table)
        return
    wide = copy.copy(table)  # a table with a fixed width lays out to it whatever the console's width
    wide.width = needed
    console.print(wide, crop=False)  # and crop=False keeps its lines whole past the console's width


__all__ = ["print_table"]
