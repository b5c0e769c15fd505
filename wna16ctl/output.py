"""The one output sink: rich tables for people, one JSON object for programs.

Results go to stdout, warnings, errors and hints to stderr.  Commands hand their result object to
the sink; nothing else in the package prints.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


class Sink:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet

    # rich is imported only when something is rendered for people (--json never needs it)
    @cached_property
    def out(self) -> "Console":
        from rich.console import Console

        # Not a terminal (a pipe, a log): keep tables wide instead of rich's 80-column default.
        return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)

    @cached_property
    def err(self) -> "Console":
        from rich.console import Console

        return Console(file=sys.stderr, highlight=False, soft_wrap=True)

    # results -------------------------------------------------------------------------------
    def result(self, data: dict[str, Any], render: Callable[[Console], None]) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
            sys.stdout.flush()
        else:
            render(self.out)

    # diagnostics ---------------------------------------------------------------------------
    def warn(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[yellow]warning:[/] {_escape(message)}")

    def info(self, message: str) -> None:
        if not self.quiet and not self.json_mode:
            self.err.print(_escape(message))

    def error(self, message: str, hint: str | None = None) -> None:
        self.err.print(f"[bold red]error:[/] {_escape(message)}")
        if hint:
            self.err.print(f"[dim]hint:[/] {_escape(hint)}")

    def progress_enabled(self) -> bool:
        return not self.quiet and not self.json_mode and sys.stderr.isatty()

    @contextmanager
    def progress(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bytes progress bar with throughput on a terminal; a no-op otherwise."""
        if not self.progress_enabled():
            yield lambda n: None
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def simple_table(title: str, columns: list[str]) -> "Table":
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False, header_style="bold")
    for c in columns:
        table.add_column(c)
    return table
