"""``model``, ``loss`` and ``data``: references to Python functions, with the model's arguments."""

from __future__ import annotations

from planc import ir
from planc.lang import ast
from planc.lang.check.values import IDENT, Diagnostics, plain_value

__all__ = ["check_code"]


def check_code(errs: Diagnostics, block: ast.CodeBlock | None) -> ir.CodeRef | None:
    """``"file.py:function"`` and its arguments as plain data (paths stay relative to the plan)."""
    if block is None:
        return None
    ref = block.ref.value
    path, sep, fn = ref.rpartition(":")
    if not sep or not path.endswith(".py") or not IDENT.fullmatch(fn):
        errs.add(f"{block.kind} must be written \"file.py:function\", got \"{ref}\"", block.ref.span)
        return None
    args, seen = [], set()
    for kv in block.args:
        if kv.key.value in seen:
            errs.add(f"argument '{kv.key.value}' is given twice", kv.key.span)
        seen.add(kv.key.value)
        args.append((kv.key.value, plain_value(errs, kv.value)))
    return ir.CodeRef(path, fn, tuple(args), block.span)
