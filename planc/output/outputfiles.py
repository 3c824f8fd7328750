"""The user's Python files a compiled output holds, so that OUT/ runs where the plan's folder is absent.

The rule (docs/errors.md, "What the output folder holds"): the files the plan's ``model``, ``loss`` and
``data`` lines name are copied into OUT/ by file name; so is every Python module they import, directly or
through one another, that lies in the folder of the file that imports it (the named file's folder, or
a package under it): ``import helper``, ``from helper import f``, ``from pkg.sub import g``, ``from . import h``
inside a package. A module is copied to the same place relative to OUT/ as it has relative to its named
file's folder (a package with its ``__init__.py`` files), so the same import finds it there (OUT/ is first
on the ranks' path, as the named file's folder is first on the probe's).

Imports are read from the source with ``ast``, not by running it: an import whose name is computed
(``importlib.import_module(name)``, ``__import__``), a module found through ``sys.path`` changes or an
environment variable, and any file that is not Python (weights, vocabularies, data) are not found;
modules outside the folder (installed packages, the standard library) are the launch machine's to have.

A Hugging Face model folder (``model hf "dir"``) is copied whole into OUT/<its name>/ (config, weights,
anything else in it), unless it holds more than ``planc.model.hfmodel.COPY_LIMIT_BYTES``: plan.json then names
its absolute path.
"""
from __future__ import annotations

import ast
from pathlib import Path

from planc import ir
from planc.model import hfmodel
from planc.diagnostics import Diagnostic, PlanError
from planc.model.probe import code_file

__all__ = ["output_code_files", "local_imports"]


def _module_files(root: Path, dotted: str) -> list[Path]:
    """The files under ``root`` that importing ``dotted`` runs: each package's ``__init__.py`` on the way
    and the module itself (``a/b.py`` or ``a/b/__init__.py``). Empty when its first part is not under root."""
    parts = [p for p in dotted.split(".") if p]
    out: list[Path] = []
    here = root
    for i, part in enumerate(parts):
        pkg, mod = here / part, here / f"{part}.py"
        if pkg.is_dir():
            if (pkg / "__init__.py").is_file():
                out.append(pkg / "__init__.py")
            here = pkg
            continue
        if mod.is_file():
            out.append(mod)
        break   # a module file ends the path (what follows is an attribute), or nothing is here
    return out


def _imported_names(tree: ast.AST, path: Path, root: Path) -> set[str]:
    """Dotted names (relative to ``root``) the module at ``path`` imports, relative imports resolved."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: from the importing file's package
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                try:
                    prefix = ".".join(base.relative_to(root).parts)
                except ValueError:
                    continue
                mod = ".".join(p for p in (prefix, node.module or "") if p)
            else:
                mod = node.module or ""
            if mod:
                names.add(mod)
            names.update(".".join(p for p in (mod, a.name) if p) for a in node.names if a.name != "*")
    return names


def local_imports(path: Path, root: Path) -> list[Path]:
    """Every Python file under ``root`` that the file at ``path`` imports, directly or through the files it
    imports, in a fixed order (``path`` itself not included). A file that does not parse is a SyntaxError."""
    root, start = root.resolve(), path.resolve()
    seen, todo = {start}, [start]
    while todo:
        current = todo.pop()
        tree = ast.parse(current.read_text(encoding="utf-8"), filename=str(current))
        for name in sorted(_imported_names(tree, current, root)):
            for f in _module_files(root, name):
                f = f.resolve()
                if f not in seen:
                    seen.add(f)
                    todo.append(f)
    return sorted(seen - {start})


def _syntax_error(what: str, ref: ir.CodeRef, e: SyntaxError, src: Path) -> PlanError:
    col = f":{e.offset}" if e.offset else ""
    where = Path(e.filename).name if e.filename else src.name
    text = f" (`{e.text.strip()}`)" if e.text and e.text.strip() else ""
    return PlanError(Diagnostic(f"{what} file {ref.path}: {where}:{e.lineno}{col}{text}: SyntaxError: {e.msg}",
                                ref.span))


def output_code_files(program: ir.Program) -> dict[str, Path]:
    """OUT/-relative name -> source file of every Python file the output holds for the plan's code: the
    named files and the modules they import beside them (the module docstring's rule). Two different
    files for one name, or a named file that does not parse, is a located error at the plan's line."""
    files: dict[str, Path] = {}
    refs: dict[str, ir.CodeRef] = {}

    def add(name: str, src: Path, ref: ir.CodeRef) -> None:
        if name in files and files[name] != src:   # OUT/ holds the code files side by side, by name
            raise PlanError([Diagnostic(f"two code files share the name {name!r}: {files[name]} and {src} "
                                        "(the output folder holds them side by side; rename one)", ref.span)])
        files[name], refs[name] = src, ref

    for what, ref in (("model", program.model), ("loss", program.loss), ("data", program.data)):
        if ref is None or isinstance(ref, ir.HfModel):   # no code file: its folder's files below
            continue
        src = code_file(program, what, ref).resolve()
        add(src.name, src, ref)
        try:
            helpers = local_imports(src, src.parent)
        except SyntaxError as e:
            raise _syntax_error(what, ref, e, src) from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(Diagnostic(f"cannot read the {what} file {ref.path}: {e}", ref.span)) from None
        for h in helpers:
            add(h.relative_to(src.parent).as_posix(), h, ref)
    for name, src in hfmodel.folder_files(program).items():   # a Hugging Face model folder, copied whole
        add(name, src, program.model)
    return dict(sorted(files.items()))
