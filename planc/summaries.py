"""`planc check`'s summary table (re-exported by planc.explain)."""
from __future__ import annotations

import re

from planc import ui
from planc.ui import Col

__all__ = ["check_summary"]


def check_summary(summary: str, tty: bool = False) -> list:
    """`planc check`'s output: the first line of ``planc.lang.format.summary`` (name, ok, path), then
    its ``  key   value`` lines as a two-column table; a line of another shape stays a line below it.
    The facts are summary()'s own, so check shows exactly what it says."""
    head, *lines = summary.splitlines()
    rows, notes = [], []
    for line in lines:
        m = re.match(r"^  (\S.*?)\s{2,}(\S.*)$", line)
        if m:
            rows.append([m.group(1), m.group(2)])
        else:
            notes.append(line)
    out: list = [head]
    if rows:
        out.append(ui.table([Col("item"), Col("what", wrap=True)], rows, tty=tty))
    return out + notes
