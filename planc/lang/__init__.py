"""The .plan front end: parse (Lark) → AST with spans → checked ``ir.Program``.

The loader is the front end's only I/O: it reads the plan file, resolves the
folder the plan's paths are relative to, and reads a cluster file the plan
names; the parser and the checker get all of it as data.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from planc import ir
from planc.lang import ast
from planc.lang.errors import Diagnostic, PlanError
from planc.span import Span

__all__ = ["load", "load_text", "read_inputs"]


def load_text(text: str, path: str = "<plan>") -> ir.Program:
    """Parse and check .plan text; ``path`` names it in diagnostics and locates relative files."""
    from planc.lang.check import check
    from planc.lang.parse import parse_collecting

    tree, found = parse_collecting(text, path)
    try:
        return check(tree, path, text, read_inputs(tree, path), found)
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


def read_inputs(tree: ast.PlanFile, path: str):
    """What the checker needs from outside the text (:class:`planc.lang.check.PlanInputs`): the plan's
    folder (the working directory for text without a file) and the cluster file it names, if any."""
    from planc.lang.check import ClusterFile, PlanInputs

    source_dir = str(Path(path).resolve().parent) if path and not path.startswith("<") else os.getcwd()
    block = next((s for s in tree.statements if isinstance(s, ast.ClusterBlock)), None)
    if block is None or block.file is None:
        return PlanInputs(source_dir)
    name = block.file.value
    file = Path(source_dir) / name
    try:
        contents = ClusterFile(name, doc=yaml.safe_load(file.read_text()))
    except FileNotFoundError:
        contents = ClusterFile(name, problem=f"cluster file '{name}' not found (looked in {file.parent})")
    except UnicodeDecodeError as e:
        contents = ClusterFile(name, problem=f"cluster file '{name}' is not UTF-8 text (byte {e.start})")
    except (OSError, yaml.YAMLError) as e:
        contents = ClusterFile(name, problem=f"cannot read cluster file '{name}': {str(e).splitlines()[0]}")
    return PlanInputs(source_dir, contents)
