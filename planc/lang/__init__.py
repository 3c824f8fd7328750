"""The .plan front end: parse (Lark) → AST with spans → checked ``ir.Program``."""

from __future__ import annotations

from pathlib import Path

from planc import ir
from planc.lang.errors import Diagnostic, PlanError, Span


def load_text(text: str, path: str = "<plan>") -> ir.Program:
    from planc.lang.check import check
    from planc.lang.parse import parse

    tree = parse(text, path)
    try:
        return check(tree, path, text)
    except PlanError as e:
        raise e.with_source(path, text) from None


def load(path: str | Path) -> ir.Program:
    """Read, parse and check a .plan file; every user error is a PlanError."""
    p = str(path)
    try:
        raw = Path(p).read_bytes()
    except OSError as e:
        raise PlanError([Diagnostic(f"cannot read plan file: {e.strerror or e}", Span.unknown(p))]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError([Diagnostic(f"plan file is not UTF-8 text (byte {e.start})", Span.unknown(p))]) from None
    return load_text(text, p)
