"""`python -m benchmarks bench … --plot FILE`: the bench's own table as grouped bars (PNG or SVG, matplotlib).

Every bench returns markdown (the table `--write` puts into docs/benchmarks.md);
this module reads that table back, so a picture shows exactly the figures of
the table and nothing a bench computed on the side. Columns drawn: the ratio
columns (a header with ``÷``: strategies against the lower bound, programs
against flat allreduce, programs against stock DeepSpeed) when the table has
any, else every column whose cells are numbers (seconds, counts). One group of
bars per row, one bar per drawn column; a cell that is not a number (``n/a``,
``—``) draws no bar. Each bar carries the gid ``bar-<row>-<column>`` in SVG.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

__all__ = ["tables", "plot_tables", "SUFFIXES"]

SUFFIXES = (".png", ".svg")
_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(?:s|ms|us|×|x|%)?\s*$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of ``markdown``: (header cells, rows of cells)."""
    out, lines = [], markdown.splitlines()
    i = 0
    while i + 1 < len(lines):
        if lines[i].lstrip().startswith("|") and re.match(r"^\s*\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            header, rows = _cells(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def number(cell: str) -> float | None:
    m = _NUMBER.match(cell.replace(",", ""))
    return float(m.group(1)) if m else None


def _columns(header: list[str], rows: list[list[str]]) -> list[int]:
    ratios = [j for j, h in enumerate(header) if "÷" in h]
    if ratios:
        return ratios
    return [j for j in range(1, len(header))
            if rows and all(number(r[j]) is not None for r in rows if j < len(r))]


def _label(header: list[str], row: list[str], columns: list[int]) -> str:
    """The row's name: its leading cells that are not drawn and not numbers (case, strategy ...)."""
    parts = [c for j, c in enumerate(row) if j not in columns and number(c) is None and j < 3]
    text = " / ".join(p.strip("`") for p in parts if p and p != "—")
    return text if len(text) <= 48 else text[:45] + "..."


def plot_tables(markdown: str, path: str | Path, title: str) -> int:
    """Draw every table of ``markdown`` into ``path``; returns the number of bars drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [(h, r, _columns(h, r)) for h, r in tables(markdown)]
    found = [(h, r, c) for h, r, c in found if r and c]
    if not found:
        raise ValueError("the bench printed no table with numbers to draw")
    fig, axes = plt.subplots(len(found), 1, figsize=(11, 1.2 + 0.32 * sum(len(r) for _, r, _ in found) + 1.4 * len(found)),
                             squeeze=False)
    bars = 0
    for k, (ax, (header, rows, columns)) in enumerate(zip(axes[:, 0], found)):
        width = 0.8 / len(columns)
        labelled = set()
        for ci, j in enumerate(columns):
            for ri, row in enumerate(rows):
                v = number(row[j]) if j < len(row) else None
                if v is None or math.isnan(v):
                    continue
                (bar,) = ax.barh(ri + (ci - (len(columns) - 1) / 2) * width, v, height=width,
                                 color=f"C{ci}", label=None if j in labelled else header[j])
                labelled.add(j)
                bar.set_gid(f"bar-{k}-{ri}-{ci}")
                bars += 1
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([_label(header, r, columns) for r in rows], fontsize=7)
        ax.invert_yaxis()
        if any("÷" in header[j] for j in columns):
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title(title if len(found) == 1 else f"{title} ({k + 1})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return bars
