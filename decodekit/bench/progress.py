"""What a benchmark reports while it runs: `BenchProgress` (reports nothing) and `RichBenchProgress` (a rich bar).

A long benchmark should never sit silent: the bar shows the stage (loading, warming up), then which system runs
which round and how many of the round's requests it has finished; each finished round leaves one line (its wall
time and tokens/s). Where the console is not a terminal (stderr redirected to a log) there is no bar: each stage
and round start is a line of its own instead.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from decodekit.bench.baselines import RunRecord


class BenchProgress:
    """The events of a benchmark run; this base class ignores them all.

    Attributes:
        scope: a prefix for every label (a matrix sets it to the cell being measured).
    """

    scope: str = ""

    def stage(self, text: str) -> None:
        """Something outside the timed rounds started (loading the model, setting up and warming up a system)."""

    def round_started(self, system: str, round_index: int, repeats: int, requests: int) -> None:
        """`system` starts round `round_index` (0-based) of `repeats`, with `requests` requests."""

    def requests_done(self, count: int = 1) -> None:
        """`count` more of the current round's requests finished."""

    def round_finished(self, system: str, round_index: int, repeats: int, record: RunRecord) -> None:
        """`system` finished a round (`record` holds its wall time and tokens)."""


class RichBenchProgress(BenchProgress):
    """A rich progress bar on `console` (stderr, for `decodekit bench`), used as a context manager.

    Args:
        console: where the bar and the per-round lines go (not a terminal: lines only).
        disable: show nothing (for `--json`).
    """

    def __init__(self, console: Console, *, disable: bool = False) -> None:
        self.disable = disable
        self.console = console
        self.lines_only = not disable and not console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("requests"), TimeElapsedColumn(), console=console, transient=True,
                                 disable=disable or self.lines_only)
        self.task: TaskID | None = None

    def __enter__(self) -> RichBenchProgress:
        self.progress.start()
        self.task = self.progress.add_task("starting", total=None)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.stop()

    def _update(self, description: str, total: int | None) -> None:
        """A fresh bar (its clock restarts): open-ended for a stage, over the requests for a round."""
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(escape(self.scope + description), total=total)
        self.progress.refresh()  # show each round at once, however quickly it ends
        if self.lines_only:
            count = f" ({total} requests)" if total is not None else ""
            self.console.print(f"[dim]{escape(self.scope + description)}{count}[/dim]", highlight=False,
                               soft_wrap=True)

    def stage(self, text: str) -> None:
        """Show the stage, with an open-ended bar."""
        self._update(text, None)

    def round_started(self, system: str, round_index: int, repeats: int, requests: int) -> None:
        """Show the system and round, with a bar over its requests."""
        self._update(f"{system}: round {round_index + 1}/{repeats}", requests)

    def requests_done(self, count: int = 1) -> None:
        """Advance the bar."""
        if self.task is not None:
            self.progress.advance(self.task, count)

    def round_finished(self, system: str, round_index: int, repeats: int, record: RunRecord) -> None:
        """Leave one line above the bar: the round's wall time and useful tokens/s."""
        if self.disable:
            return
        rate = record.useful_tokens / record.wall_s if record.wall_s > 0 else float("nan")
        self.console.print(f"{escape(self.scope)}{escape(system)} round {round_index + 1}/{repeats}: "
                           f"{record.useful_tokens} tokens in {record.wall_s:.1f} s, {rate:.1f} tok/s",
                           highlight=False, soft_wrap=True)


__all__ = ["BenchProgress", "RichBenchProgress"]
