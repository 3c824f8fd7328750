"""The .plan front end: parse (Lark) → AST with spans → checked ``ir.Program``.

The loader is the front end's only I/O: it reads the plan file, resolves the
folder the plan's paths are relative to, and reads a cluster file the plan
names; the parser and the checker get all of it as data.
"""

from __future__ import annotations

import os
from pathlib import Path

from planc import ir
from planc.lang import ast
from planc.lang.errors import Diagnostic, PlanError
from planc.lang.yamlfile import YamlProblem, read_yaml
from planc.span import Span

__all__ = ["load", "load_text", "read_inputs"]


def load_text(text: str, path: str = "<plan>", budget=None) -> ir.Program:
    """Parse and check .plan text; ``path`` names it in diagnostics and locates relative files.
    ``budget``: the resource bounds to check against (``planc.budget``; None: the one in force)."""
    from planc import budget as budgets
    from planc.lang.check import check
    from planc.lang.parse import parse_collecting

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


def read_inputs(tree: ast.PlanFile, path: str):
    """What the checker needs from outside the text (:class:`planc.lang.check.PlanInputs`): the plan's
    folder (the working directory for text without a file), and the YAML files it names, if any: the
    cluster file and the DeepSpeed overrides."""
    from planc.lang.check import PlanInputs

    source_dir = str(Path(path).resolve().parent) if path and not path.startswith("<") else os.getcwd()
    block = next((s for s in tree.statements if isinstance(s, ast.ClusterBlock)), None)
    ds = next((s for s in tree.statements if isinstance(s, ast.DeepspeedDecl)), None)
    return PlanInputs(source_dir,
                      _read_yaml_input(source_dir, path, block.file.value, "cluster file")
                      if block is not None and block.file is not None else None,
                      _read_yaml_input(source_dir, path, ds.path.value, "DeepSpeed overrides file")
                      if ds is not None else None)


def _read_yaml_input(source_dir: str, path: str, name: str, what: str):
    """A YAML file the plan names (relative to its folder), read with each node's span, or the problem."""
    from planc.lang.check import ClusterFile

    file = Path(source_dir) / name
    # the file as diagnostics name it: beside the plan, as the plan's own path is written
    shown = str(Path(path).parent / name) if path and not path.startswith("<") else name
    text = None
    try:
        text = file.read_text()
        doc, marks = read_yaml(text, shown)
        return ClusterFile(name, doc=doc, path=shown, text=text, marks=marks)
    except FileNotFoundError:
        return ClusterFile(name, problem=f"{what} '{name}' not found (looked in {file.parent})")
    except UnicodeDecodeError as e:
        return ClusterFile(name, problem=f"{what} '{name}' is not UTF-8 text (byte {e.start})")
    except YamlProblem as e:
        return ClusterFile(name, problem=f"cannot read {what} '{name}': {e}", path=shown, text=text,
                           problem_span=e.span)
    except OSError as e:
        return ClusterFile(name, problem=f"cannot read {what} '{name}': {e.strerror or e}")
    except ValueError as e:   # a name the file system cannot take (a NUL byte)
        return ClusterFile(name, problem=f"cannot read {what} {name!r}: {e}")
