"""The compiler imports nothing of the runtime: what both sides must agree on (plan.json's records, the
receive-posting rule ``post_gates``, the checkpoint manifest) lives in the contract package planc.plan.

Every module of ``planc/`` outside ``planc/runtime/`` is parsed with ``ast``; every import counts, at
module level and inside functions, relative imports resolved. One exception, listed in ``READERS``:
``planc trace`` (planc/commands/cli.py) reads the traces a run wrote with the runtime's own reader
(``planc.runtime.trace``), imported inside the command's functions only, so that no compile loads it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = "planc.runtime"
# (module, imported runtime module): CLI commands that read what a run wrote, never a compiler pass
READERS = {("planc.commands.cli", "planc.runtime.trace")}


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def runtime_imports(path: Path, module: str, is_pkg: bool) -> list[tuple[str, int, bool]]:
    """``(runtime module, line, at module level)`` of every import of ``planc.runtime`` in the file."""
    package = module if is_pkg else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [source] if source != "planc" else [f"planc.{a.name}" for a in node.names]
        for name in names:
            if name == RUNTIME or name.startswith(RUNTIME + "."):
                found.append((name, node.lineno, id(node) in top))
    return found


def compiler_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "planc").rglob("*.py")) if (ROOT / "planc" / "runtime") not in p.parents]


def test_the_compiler_imports_nothing_of_the_runtime():
    bad, readers = [], set()
    for path in compiler_modules():
        module, is_pkg = _module_name(path)
        for name, line, at_top in runtime_imports(path, module, is_pkg):
            if (module, name) in READERS and not at_top:
                readers.add((module, name))
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: imports {name}"
                       + (" at module level" if (module, name) in READERS else ""))
    assert not bad, "compiler modules import the runtime (move what they share into planc.plan):\n" + "\n".join(bad)
    assert readers == READERS, f"a listed reader no longer imports the runtime: {sorted(READERS - readers)}"


def test_the_scan_finds_every_spelling(tmp_path):
    pkg = tmp_path / "planc" / "pipeline"
    pkg.mkdir(parents=True)
    probe = pkg / "probe.py"
    probe.write_text("import planc.runtime.comm\nfrom planc.runtime import engine\nfrom planc import runtime\n"
                     "from ..runtime.comm import post_gates\ndef f():\n    from planc.runtime.trace import stalls\n"
                     "from planc.plan.gates import post_gates\n")
    found = runtime_imports(probe, "planc.pipeline.probe", False)
    assert [(n, line, top) for n, line, top in found] == [
        ("planc.runtime.comm", 1, True), ("planc.runtime", 2, True), ("planc.runtime", 3, True),
        ("planc.runtime.comm", 4, True), ("planc.runtime.trace", 6, False)]
