"""The one output sink: rich tables for people, one JSON object for programs.

Results go to stdout, warnings, errors and hints to stderr.  Commands hand their result object to
the sink; nothing else in the package prints.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.measure import Measurement
    from rich.progress import ProgressColumn
    from rich.table import Table


class Sink:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet

    # rich is imported only when something is rendered for people (--json never needs it)
    @cached_property
    def out(self) -> "Console":
        from rich.console import Console

        return Console(file=_plain_lines(sys.stdout), highlight=False, soft_wrap=False, width=output_width(sys.stdout))

    @cached_property
    def err(self) -> "Console":
        from rich.console import Console

        return Console(file=_plain_lines(sys.stderr), highlight=False, soft_wrap=True, width=output_width(sys.stderr))

    # results -------------------------------------------------------------------------------
    def result(self, data: dict[str, Any], render: Callable[[Console], None]) -> None:
        with _stdout_result():
            if self.json_mode:
                sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
                sys.stdout.flush()
            else:
                render(self.out)

    def result_lines(self, data: dict[str, Any], lines: Callable[[], list[str]]) -> None:
        """A result that people read as a few plain lines (repack's, assemble's): printed as they
        are, never wrapped, without importing rich (tens of milliseconds at the end of a run)."""
        if self.json_mode:
            self.result(data, lambda console: None)
        else:
            with _stdout_result():
                sys.stdout.write("".join(line + "\n" for line in lines()))
                sys.stdout.flush()

    # diagnostics ---------------------------------------------------------------------------
    def warn(self, message: str, *, always: bool = False) -> None:
        """A warning on stderr; `--quiet` hides it unless `always` (something was deleted, ...)."""
        if always or not self.quiet:
            self.err.print(f"[yellow]warning:[/] {_escape(message)}")

    def info(self, message: str) -> None:
        if not self.quiet and not self.json_mode:
            self.err.print(_escape(message))

    def error(self, message: str, hint: str | None = None) -> None:
        self.err.print(f"[bold red]error:[/] {_escape(message)}")
        if hint:
            self.err.print(f"[dim]hint:[/] {_escape(hint)}")

    def traceback(self, error: BaseException | None = None) -> None:
        """The traceback of `error`, else of the exception being handled, on stderr (`--debug`)."""
        import traceback

        if error is None:
            traceback.print_exc(file=sys.stderr)
        else:
            traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()

    def progress_enabled(self) -> bool:
        return not self.quiet and not self.json_mode and sys.stderr.isatty()

    @contextmanager
    def progress(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bytes progress bar with throughput on a terminal; a no-op otherwise."""
        with self.tasks() as start:
            yield start(description, total, unit="bytes")

    @contextmanager
    def tasks(self) -> Iterator[TaskStarter]:
        """Progress for a command with several steps: `start(description, total, unit=...)` shows a
        bar for one step (the previous one is finished) and returns its `advance(n)`.  Bars go to
        stderr, on a terminal only, and vanish when the command ends."""
        if not self.progress_enabled():
            yield no_progress
            return
        from rich.progress import BarColumn, Progress, TextColumn
        from rich.table import Column

        # the bar gives way on a narrow terminal; the amount and the time left stay on one line each
        with Progress(TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=2)),
                      BarColumn(bar_width=None, table_column=Column(ratio=1)), _amount_column(),
                      _eta_column(), console=self.err, transient=True, expand=True) as bar:
            current: list[Any] = []
            run: list[Any] = []  # the whole run's line (unit RUN): it stays while the steps change

            def start(description: str, total: int, *, unit: str = "bytes") -> Callable[[int], None]:
                if unit == RUN:
                    if not run:
                        run.append(bar.add_task(description, total=max(total, 1), unit=unit))
                    bar.update(run[0], total=max(total, 1))  # restated: the work is better known
                    return lambda n: bar.advance(run[0], n)
                for task in current:
                    bar.update(task, completed=bar.tasks[task].total, visible=False)
                task = bar.add_task(description, total=max(total, 1), unit=unit)
                current[:] = [task]
                return lambda n: bar.advance(task, n)

            yield start


@contextmanager
def _stdout_result() -> Iterator[None]:
    """A result that stdout cannot take (a full disk, /dev/full, an I/O error) is one line naming
    stdout.  A closed pipe (`| head`) stays what it is: the reader has what it wanted."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        from wna16ctl.errors import OutputError

        try:  # the unwritten rest would fail again when the interpreter flushes stdout at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (AttributeError, OSError, ValueError):  # not a real file (a test runner's buffer)
            pass
        raise OutputError(f"stdout: cannot write the result ({e.strerror or e}); send it to a file or pipe "
                          "that can take it") from None


TaskStarter = Callable[..., Callable[[int], None]]  # start(description, total, unit="bytes") -> advance(n)

RUN = "work of the whole run"  # the unit of a line that spans every step (WholeRun): started again, its total is restated


class WholeRun:
    """The time left of a whole run of several steps, there from its first step: each step's work
    is given up front in one unit (bytes read, or what costs as much), so the rate measured on the
    work done prices the steps still to come; as steps complete, the rate is theirs too.  `work`:
    each step's description -> its work in that unit.  Shown through `progress` as one line of unit
    RUN, "about 0:12:34 left for the whole verify"."""

    def __init__(self, progress: TaskStarter, what: str, work: dict[str, float]):
        self.progress, self.what, self.work = progress, what, dict(work)
        self.done = 0.0
        self._shown = 0  # the whole units handed to the line so far
        self._advance_run = progress(what, self.total, unit=RUN)

    @property
    def total(self) -> int:
        return int(sum(self.work.values()))

    def restate(self, description: str, work: float) -> None:
        """A step's work, better known than at the start (the tokens once the samples are read)."""
        self.work[description] = work
        self._advance_run = self.progress(self.what, self.total, unit=RUN)

    def start(self, description: str, total: int, *, unit: str = "bytes") -> Callable[[int], None]:
        """The step's own bar, as `progress` draws it; its increments also move the whole run."""
        step = self.progress(description, total, unit=unit)
        per = self.work.get(description, 0.0) / max(total, 1)

        def advance(n: int) -> None:
            step(n)
            self.done += n * per
            whole = int(self.done) - self._shown
            if whole > 0:
                self._shown += whole
                self._advance_run(whole)

        return advance

    def left(self, elapsed: float | None) -> float | None:
        """Seconds left for the whole run, `elapsed` seconds after it started (None: no work measured)."""
        return time_left(self.done, self.total, elapsed)


def no_progress(description: str, total: int, *, unit: str = "bytes") -> Callable[[int], None]:
    """The progress of library calls made without a sink: nothing is shown."""
    return lambda n: None


def _amount_column() -> ProgressColumn:
    """'12.0/40.0 MiB 8.1 MiB/s' for bytes, '3/16 experts' otherwise: binary units throughout.
    The class is defined on first use, so that importing sink.py does not import rich."""
    from rich.progress import ProgressColumn, Task
    from rich.table import Column
    from rich.text import Text

    class AmountColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            unit = task.fields.get("unit", "bytes")
            if unit == RUN:
                return Text(f"{100 * task.completed / (task.total or 1):.0f}%")
            if unit != "bytes":
                return Text(f"{task.completed:.0f}/{task.total:.0f} {unit}")
            speed = task.finished_speed or task.speed
            rate = f" {human_bytes(int(speed))}/s" if speed else ""
            return Text(f"{human_bytes(int(task.completed))}/{human_bytes(int(task.total or 0))}{rate}")

    return AmountColumn(table_column=Column(no_wrap=True))


def time_left(completed: float, total: float, elapsed: float | None) -> float | None:
    """Seconds left at the throughput measured since the step started (None before any progress).
    Over the whole step, not a recent window: verify's steps advance in uneven jumps (one expert,
    one layer), and a window's rate swings with them."""
    if not elapsed or completed <= 0 or total <= 0:
        return None
    return max(total - completed, 0) * elapsed / completed


def _eta_column() -> ProgressColumn:
    """'0:01:23 left' from `time_left`; '-:--:-- left' until the step has advanced."""
    from rich.progress import ProgressColumn, Task
    from rich.table import Column
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            left = time_left(task.completed, task.total or 0, task.elapsed)
            run = task.fields.get("unit") == RUN
            if left is None:
                return Text(f"time left for the {task.description} not yet known" if run else "-:--:-- left")
            s = int(left + 0.5)
            hms = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
            return Text(f"about {hms} left for the {task.description}" if run else f"{hms} left")

    return EtaColumn(table_column=Column(no_wrap=True))


def output_width(stream: Any) -> int | None:
    """Columns for rich: $COLUMNS when set, else the terminal's (None: rich asks it), else 100."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return None if stream.isatty() else PLAIN_WIDTH
    except (AttributeError, ValueError):
        return PLAIN_WIDTH


PLAIN_WIDTH = 100  # pipes and logs without $COLUMNS


class _NoTrailingSpaces:
    """A pipe or log stream whose lines lose the spaces rich pads table cells with."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._line = ""

    def write(self, text: str) -> int:
        lines = (self._line + text).split("\n")
        self._line = lines.pop()
        if lines:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._line:  # a line without its newline yet: written as it is
            self._stream.write(self._line)
            self._line = ""
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


def _plain_lines(stream: Any) -> Any:
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        terminal = False
    return stream if terminal else _NoTrailingSpaces(stream)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_size(value: str | int) -> int:
    """'4GiB' / '500MB' / '4096' -> bytes (K/M/G/T alone are binary, like the rest of the output)."""
    from wna16ctl.errors import UsageError

    if isinstance(value, int) and not isinstance(value, bool):
        n: float = value
    else:
        units = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
                 "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}
        text = str(value).strip().upper()
        num = text.rstrip("KMGTIB")
        try:
            n = float(num) * units[text[len(num):]]
        except (ValueError, KeyError):
            raise UsageError(f"{value!r} is not a size (e.g. 4GiB, 500MB)") from None
    if n < 1:
        raise UsageError(f"{value!r}: size must be positive (e.g. 4GiB, 500MB)")
    return int(n)


def plural(n: int, word: str, plural_form: str | None = None) -> str:
    """'1 file', '2 files', '1 directory', '2 directories'."""
    return f"{n} {word if n == 1 else (plural_form or word + 's')}"


def simple_table(title: str, columns: list[str], console: "Console | None" = None, *,
                 drop: tuple[str, ...] = (), wrap: tuple[str, ...] = ()) -> "Table":
    """A table with box drawing on a terminal, plain aligned columns in a pipe or a log.  No column
    is narrower than its longest word, so narrow terminals wrap cells between words ("layers
    0-1", never "laye/rs").

    `drop`: headers of columns that may be left out, in that order, while the table is wider than
    the console (a caption names them); the columns not named, the verdict among them, always stay.
    `wrap`: columns whose cells may wrap between words (their longest word is their need)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    class WordTable(Table):
        def _fit_words(self) -> None:
            for column in self.columns:
                cells = [column.header, *column._cells]
                words = [w for c in cells if isinstance(c, str) for w in Text.from_markup(c).plain.split()]
                column.min_width = max([column.min_width or 0, *map(len, words)])

        def _need(self) -> int:
            """Columns wide enough for every cell on one line (the `wrap` ones: their longest word)."""
            widths = []
            for column in self.columns:
                texts = [Text.from_markup(c).plain if isinstance(c, str) else "" for c in [column.header, *column._cells]]
                if column.header in wrap:
                    texts = [w for t in texts for w in t.split()]
                widths.append(max([len(line) for t in texts for line in t.splitlines() or [""]] or [0]))
            return sum(widths) + 2 * (len(widths) - 1)

        def _drop_to(self, width: int) -> None:
            dropped = []
            for header in drop:
                if self._need() <= width:
                    break
                index = next((i for i, c in enumerate(self.columns) if c.header == header), None)
                if index is not None:
                    del self.columns[index]
                    for i, column in enumerate(self.columns):
                        column._index = i  # rich pads and places a column by its index
                    dropped.append(header)
            if dropped:
                self.caption = f"not shown at {width} columns: {', '.join(dropped)} (every field is in --json)"

        def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
            self._drop_to(options.max_width)
            self._fit_words()
            return super().__rich_measure__(console, options)

        def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
            self._drop_to(options.max_width)
            self._fit_words()
            return super().__rich_console__(console, options)

    plain = console is not None and not console.is_terminal
    table = WordTable(title=title, title_justify="left", show_lines=False, header_style="bold",
                      box=None if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=not plain,
                      caption_justify="left", caption_style="dim")
    for c in columns:
        table.add_column(c)
    return table
