"""`planc check`'s summary table (re-exported by planc.explain), and explain's sequence-parallelism lines."""
from __future__ import annotations

import re

from planc import ui
from planc.ui import Col

__all__ = ["check_summary", "sequence_lines"]


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


def sequence_lines(stages: list[dict]) -> list[str]:
    """Which tensor stages run sequence-parallel, and why the others do not (plan.json stages[i])."""
    on = [str(s["index"]) for s in stages if s.get("sequence_parallel")]
    out = [f"sequence parallelism: stage{'s' if len(on) > 1 else ''} {', '.join(on)} (norms, residuals and the "
           "activations between stages split along the sequence over tensor)"] if on else []
    out += [f"stage {s['index']}: no sequence parallelism: {s['sequence_why']}" for s in stages
            if s.get("sequence_parallel") is False and s.get("sequence_why")]
    return out
