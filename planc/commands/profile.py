"""Time and memory per compiler pass (``planc compile --profile``).

A :class:`Profile` is handed to ``compile_file(path, profile=...)``; each pass runs inside
``section(name)``, which records its wall-clock seconds and the process's peak resident memory when it
ended (the high-water mark so far: the pass that raised it is the first whose figure is higher). A pass
that runs more than once (the pipeline pass for each schedule candidate) is one row with its total time.
The model probe runs in a subprocess: its row says the child's own peak (``probe`` … ``(child)``).
Measuring costs nothing measurable; no decision depends on it.
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager


def _peak_mb(who: int = resource.RUSAGE_SELF) -> float:
    kb = resource.getrusage(who).ru_maxrss
    return kb / (1 << 20) if sys.platform == "darwin" else kb / 1024   # bytes on macOS, KiB elsewhere


class Profile:
    def __init__(self):
        self.rows: dict[str, list] = {}   # name -> [seconds, peak MB, runs, child peak MB or None]
        self.started = time.perf_counter()

    @contextmanager
    def section(self, name: str, child: bool = False):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, child)

    def add(self, name: str, seconds: float, child: bool = False) -> None:
        row = self.rows.setdefault(name, [0.0, 0.0, 0, None])
        row[0] += seconds
        row[1] = _peak_mb()
        row[2] += 1
        if child:
            row[3] = _peak_mb(resource.RUSAGE_CHILDREN)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.started

    def table(self):
        """A rich table: pass, runs, seconds, share of the total, peak MB when it ended."""
        from planc.commands import ui
        total = self.total
        rows = []
        for name, (seconds, peak, runs, child) in self.rows.items():
            mem = f"{peak:.0f}" + (f" ({child:.0f} child)" if child is not None else "")
            rows.append([name, runs, f"{seconds:.3f}", f"{100 * seconds / total:.0f}%" if total else "-", mem])
        rows.append(["total", "", f"{total:.3f}", "100%", f"{_peak_mb():.0f}"])
        cols = ["pass", ui.Col("runs", justify="right"), ui.Col("seconds", justify="right"),
                ui.Col("share", justify="right"), ui.Col("peak MB", justify="right")]
        return ui.table(cols, rows, title="planc compile --profile: wall-clock seconds and the process's peak "
                                          "resident memory when each pass ended")
