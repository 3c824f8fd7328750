"""Terminal output: rich tables that fit 80 columns, colour only on a terminal, and a progress helper.

One rule decides the look: a stream that is a TTY gets colour and rich's box drawing at the
terminal's width; anything else (a pipe, a file, a test's capture) gets plain text, 80 columns,
ASCII rules, no ANSI escapes, so piped output is stable enough for golden files and grep.

    console(stream)        the Console for a stream (stdout by default)
    table(columns, rows)   a Table; ``Col`` says how a column aligns and whether it may wrap
    emit(things, stream)   print lines and tables (coloured on a TTY, plain when piped)
    render(*things)        the same as plain 80-column text (what a pipe would get)
    progress(items, label) iterate with a progress bar on a TTY; one line per item (or nothing) when piped
    bar(label, total)      a progress bar advanced by hand (``advance(n, item)``); nothing when piped
    status(label)          a transient spinner with a changing line (``update(text)``); nothing when piped

Bars and spinners go to stderr by default and only to a terminal: piped output (stdout and stderr)
gets no escape sequences, no carriage returns and no extra lines from them. One at a time per
stream: one started while another is up (a testbed launch's step bar inside a bench's bar) is silent.
"""

from __future__ import annotations

import io
import sys
import textwrap
import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

WIDTH = 80                     # piped output's width: the terminal everyone still has

# plain mode's table rules: the shape of rich's SIMPLE box, in ASCII
PLAIN_BOX = box.Box(
    "    \n"
    "    \n"
    " -- \n"
    "    \n"
    "    \n"
    " -- \n"
    "    \n"
    "    \n",
    ascii=True,
)

T = TypeVar("T")


def human_bytes(n: float) -> str:
    """``1.5 GiB``, ``12.0 KiB``, ``300 B``: binary units, one decimal."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"


def human_seconds(seconds: float | None) -> str:
    """``1.234 s``, ``12.345 ms``, ``97.2 us``; ``n/a`` for None."""
    if seconds is None:
        return "n/a"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def is_tty(stream=None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):      # closed or not a file
        return False


def console(stream=None) -> Console:
    """A Console for ``stream``: colour at the terminal's width on a TTY, plain 80 columns otherwise."""
    stream = sys.stdout if stream is None else stream
    if is_tty(stream):
        return Console(file=stream, force_terminal=True, highlight=False, markup=False, emoji=False)
    return Console(file=stream, width=WIDTH, force_terminal=False, no_color=True, color_system=None,
                   highlight=False, emoji=False, markup=False, legacy_windows=False)


@dataclass(frozen=True, slots=True)
class Col:
    """A table column: its header, ``justify`` ('left' or 'right') and whether its cells may wrap."""
    header: str
    justify: str = "left"
    wrap: bool = False
    style: str | None = None


def table(columns: Iterable[Col | str], rows: Iterable[Iterable], *, title: str | None = None,
          tty: bool | None = None) -> Table:
    """A rich Table; cells are str()'d. Columns that may not wrap keep their text on one line
    (names, numbers, matrices), the others wrap at spaces to keep the table inside the width."""
    tty = is_tty() if tty is None else tty
    t = Table(box=box.SIMPLE_HEAD if tty else PLAIN_BOX, title=title, title_justify="left",
              header_style="bold" if tty else None, show_edge=False, pad_edge=False, expand=False,
              title_style="bold" if tty else None)
    for c in columns:
        c = Col(c) if isinstance(c, str) else c
        t.add_column(c.header, justify=c.justify, no_wrap=not c.wrap, overflow="fold",
                     style=c.style if tty else None)
    for row in rows:
        t.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in row))
    return t


def _wrap(line: str, width: int) -> list[str]:
    """A text line broken at spaces to ``width``, continuation lines indented 4 past the first."""
    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    return textwrap.wrap(line, width, subsequent_indent=" " * (lead + 4), break_long_words=False,
                         break_on_hyphens=False) or [line]


def emit(things: Iterable, stream=None) -> None:
    """Print strings (one line each, wrapped at the width with a hanging indent) and rich tables:
    coloured on a TTY; plain, 80 columns, trailing spaces stripped, when piped."""
    stream = sys.stdout if stream is None else stream
    if is_tty(stream):
        con = console(stream)
        for x in things:
            if isinstance(x, str):
                for line in _wrap(x, con.width):
                    con.print(line, soft_wrap=True)
            else:
                con.print(x)
        return
    stream.write(render(*things))
    stream.flush()


def render(*things) -> str:
    """Renderables (tables, strings) as the plain text a pipe gets: 80 columns, no escapes,
    no trailing spaces."""
    buf = io.StringIO()
    con = console(buf)
    for x in things:
        if isinstance(x, str):
            for line in _wrap(x, WIDTH):
                con.print(line, soft_wrap=True)
        else:
            con.print(x)
    return "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())


def progress(items: Iterable[T], label: str, *, total: int | None = None, stream=None,
             piped: str = "lines", describe=str) -> Iterator[T]:
    """Yield ``items``; on a TTY with a rich progress bar (on ``stream``, stderr by default, so stdout
    keeps only results). Piped, ``piped="lines"`` writes one line per item as it starts
    (``label [i/n] item``) and ``piped="silent"`` writes nothing. ``describe(item)`` names an item."""
    if piped not in ("lines", "silent"):
        raise ValueError(f"progress: piped must be 'lines' or 'silent', not {piped!r}")
    stream = sys.stderr if stream is None else stream
    if total is None:
        try:
            total = len(items)            # type: ignore[arg-type]
        except TypeError:
            total = None
    if is_tty(stream) and _live_free(stream):
        # rich's live display: imported only when a bar is shown on a terminal (a hot CLI path otherwise)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        with _live(stream), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[item]}"), console=console(stream),
                                     transient=False) as bar:
            task = bar.add_task(label, total=total, item="")
            for x in items:
                bar.update(task, item=describe(x))
                yield x
                bar.advance(task)
        return
    if is_tty(stream):                    # inside another bar on this terminal: that one shows the progress
        yield from items
        return
    n = "?" if total is None else str(total)
    t0 = time.monotonic()
    i = 0
    for i, x in enumerate(items, 1):
        if piped == "lines":
            print(f"{label} [{i}/{n}] {describe(x)}", file=stream, flush=True)
        yield x
    if piped == "lines":
        print(f"{label}: {i} done in {time.monotonic() - t0:.1f} s", file=stream, flush=True)


_LIVE: set[int] = set()   # streams showing a bar or spinner now: one live display per terminal


def _live_free(stream) -> bool:
    """No bar or spinner of ours is up on ``stream``: a nested one (a testbed launch's step bar
    inside a bench's bar) stays silent rather than fight the outer one for the terminal's lines."""
    return _key(stream) not in _LIVE


def _key(stream) -> int:
    # while a rich display is up, sys.stderr is its FileProxy: the terminal is the file behind it
    return id(getattr(stream, "rich_proxied_file", stream))


@contextmanager
def _live(stream):
    _LIVE.add(_key(stream))
    try:
        yield
    finally:
        _LIVE.discard(_key(stream))


class Bar:
    """What ``bar()`` yields: ``advance(n=1, item=None)`` and ``update(item)``; a no-op when piped."""

    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def advance(self, n: float = 1, item: str | None = None) -> None:
        if self._progress is not None:
            fields = {} if item is None else {"item": item}
            self._progress.update(self._task, advance=n, **fields)

    def update(self, item: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, item=item)


@contextmanager
def bar(label: str, total: float | None, *, stream=None, transient: bool = False) -> Iterator[Bar]:
    """A rich progress bar on ``stream`` (stderr by default) when it is a TTY, advanced by hand, for
    work that is not a loop over items (steps reported by a callback); when piped, nothing at all."""
    stream = sys.stderr if stream is None else stream
    if not (is_tty(stream) and _live_free(stream)):
        yield Bar()
        return
    # rich's live display: imported only when a bar is shown on a terminal
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with _live(stream), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[item]}"), console=console(stream),
                                 transient=transient) as p:
        yield Bar(p, p.add_task(label, total=total, item=""))


@contextmanager
def status(label: str, *, stream=None) -> Iterator[Callable[[str], None]]:
    """A transient spinner ``label: TEXT`` on ``stream`` (stderr by default) when it is a TTY; yields
    ``update(TEXT)``. It leaves nothing behind; when piped it writes nothing (``update`` is a no-op)."""
    stream = sys.stderr if stream is None else stream
    if not (is_tty(stream) and _live_free(stream)):
        yield lambda text: None
        return
    with _live(stream), console(stream).status(f"{label} …") as s:
        yield lambda text: s.update(f"{label}: {text}")

