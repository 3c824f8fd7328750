"""Value helpers shared by every construct's checks: numbers, quantities, names, tensor types.

Each reports what is wrong to the :class:`Diagnostics` it is given and returns
None (or a default) so that checking can go on and find every error at once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal

from planc import ir
from planc.lang import ast
from planc.lang.errors import Diagnostic, did_you_mean
from planc.lang.units import BANDWIDTH, FLOPS, SIZE, TIME
from planc.span import Span

__all__ = ["Diagnostics", "MAX_DIGITS", "IDENT", "int_of", "quantity", "plain_value", "tensor_type",
           "source_text", "did_you_mean"]

MAX_DIGITS = 18  # whole numbers in a plan fit in 64 bits
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(slots=True)
class Diagnostics:
    """The errors found so far, in the order found; ``PlanError`` sorts them by position."""

    items: list[Diagnostic] = field(default_factory=list)

    def add(self, message: str, span: Span, hint: str | None = None) -> None:
        self.items.append(Diagnostic(message, span, hint))

    @property
    def found(self) -> bool:
        return bool(self.items)


def int_of(errs: Diagnostics, num: ast.Num, what: str, minimum: int = 1) -> int | None:
    """A whole number of at most MAX_DIGITS digits, at least ``minimum``."""
    if not num.is_int:
        errs.add(f"{what} must be a whole number, got {num.text}", num.span)
        return None
    if len(num.text.lstrip("-")) > MAX_DIGITS:
        errs.add(f"{what} is too large ({len(num.text)} digits)", num.span)
        return None
    v = num.int_value
    if v < minimum:
        errs.add(f"{what} must be at least {minimum}, got {v}", num.span)
        return None
    return v


def quantity(errs: Diagnostics, q: ast.Quantity, table: dict, kind: str) -> float | None:
    """A quantity in base units (bytes/s, s, bytes), computed exactly from the written digits."""
    if q.unit not in table:
        errs.add(f"'{q.unit}' is not a {kind} unit; expected one of " + ", ".join(table), q.span)
        return None
    value = float(Decimal(q.number.text) * Decimal(repr(table[q.unit])))
    if not math.isfinite(value):
        errs.add(f"{q.number.text} {q.unit} is too large", q.span)
        return None
    return value


def plain_value(errs: Diagnostics, v: ast.Value):
    """A model argument as Python data: numbers, strings, true/false/none, names, lists and tuples, quantities."""
    if isinstance(v, ast.Num):
        return v.int_value if v.is_int and len(v.text) <= MAX_DIGITS else v.value
    if isinstance(v, ast.Str):
        return v.value
    if isinstance(v, ast.Name):
        return {"true": True, "false": False, "none": None}.get(v.value, v.value)
    if isinstance(v, (ast.ListValue, ast.TupleValue)):
        return tuple(plain_value(errs, x) for x in v.items)
    if isinstance(v, ast.Quantity):
        for table in (SIZE, TIME, BANDWIDTH, FLOPS):
            if v.unit in table:
                return v.number.value * table[v.unit]
    errs.add("expected a number, string, name or list here", v.span)
    return None


def tensor_type(errs: Diagnostics, tt: ast.TensorType) -> tuple[str, tuple[int, ...]] | tuple[None, None]:
    """``(dtype, shape)`` of a written ``f32[8, 1024]``; ``(None, None)`` when it is wrong."""
    dtype = tt.dtype.value
    ok = True
    if dtype not in ir.DTYPE_BYTES:
        errs.add(f"unknown dtype '{dtype}'; expected one of {', '.join(ir.DTYPE_BYTES)}", tt.dtype.span,
                 did_you_mean(dtype, ir.DTYPE_BYTES))
        ok = False
    dims = []
    for d in tt.dims:
        v = int_of(errs, d, "a tensor dimension")
        if v is None:
            ok = False
        dims.append(v)
    return (dtype, tuple(dims)) if ok else (None, None)


def source_text(span: Span, text: str) -> str:
    """The source text under a one-line span (for messages that quote what was written)."""
    lines = text.splitlines()
    if span.line < 1 or span.line > len(lines) or span.end_line != span.line:
        return "stage I"
    return " ".join(lines[span.line - 1][span.col - 1:span.end_col - 1].split())
