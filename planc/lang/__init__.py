"""The .plan front end: parse (Lark) → AST with spans → checked ``ir.Program``.

The loader is the front end's only I/O: it reads the plan file, resolves the
folder the plan's paths are relative to, and reads a cluster file the plan
names; the parser and the checker get all of it as data.
"""

from __future__ import annotations

from pathlib import Path

from planc import budget as budgets
from planc import ir
from planc.lang.check import check
from planc.lang.errors import Diagnostic, PlanError
from planc.lang.inputs import read_inputs
from planc.lang.parse import parse_collecting
from planc.span import Span

__all__ = ["load", "load_text", "read_inputs"]


def load_text(text: str, path: str = "<plan>", budget=None) -> ir.Program:
    """Parse and check .plan text; ``path`` names it in diagnostics and locates relative files.
    ``budget``: the resource bounds to check against (``planc.budget``; None: the one in force)."""
    with budgets.using(budget):
        tree, found = parse_collecting(text, path)
        inputs = read_inputs(tree, path)
        try:
            return check(tree, path, text, inputs, found)
        except PlanError as e:
            raise e.with_source(path, text) from None


def load(path: str | Path, budget=None) -> ir.Program:
    """Read, parse and check a .plan file; every user error is a PlanError."""
    p = str(path)
    try:
        raw = Path(p).read_bytes()
    except (OSError, ValueError) as e:   # ValueError: a path the file system cannot take (a NUL byte)
        raise PlanError([Diagnostic(f"cannot read plan file: {getattr(e, 'strerror', None) or e}",
                                    Span.unknown(p))]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:   # located at the first byte that is not UTF-8, shown with it replaced
        shown = raw.decode("utf-8", errors="replace")
        head = raw[:e.start].decode("utf-8", errors="replace")
        line = head.count("\n") + 1
        col = len(head) - (head.rfind("\n") + 1) + 1
        raise PlanError([Diagnostic(f"plan file is not UTF-8 text (byte {e.start})", Span(line, col, line, col + 1, p))],
                        {p: shown}) from None
    return load_text(text, p, budget)
