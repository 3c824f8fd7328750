"""The import graph: no circles, the product never imports the lab, and no module over 500 lines.

Every module under ``planc/`` (and ``benchmarks/`` at the repository root, when it exists) is parsed
with ``ast``; every import counts, at module level and inside functions (an import inside a function
hides a circle, it does not remove it), relative imports resolved. Importing ``a.b.c`` from outside
package ``a.b`` also runs ``a/b/__init__.py``, so it is an edge to ``a.b`` too. Any strongly connected
component of more than one module fails, with one circle of it spelled out (file and line per import).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planc", "benchmarks")
MAX_LINES = 500

# the contract package: imported by the compiler and copied into every output, so it imports only the
# standard library and itself
CONTRACT = "planc.plan"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for top in PACKAGES:
        if not (ROOT / top).is_dir():
            continue
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _owner(name: str, modules) -> str | None:
    """The module ``name`` lives in: itself, else its longest dotted prefix that is a module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, is_pkg: bool, modules) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import in the file that names one of ``modules``."""
    package = module if is_pkg else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                sub = f"{source}.{a.name}"
                found.append((sub if sub in modules else source, node.lineno))
    out = []
    for name, line in found:
        target = _owner(name, modules)
        if target is None:
            continue
        parts = target.split(".")
        for k in range(1, len(parts) + 1):   # the packages entered from outside run their __init__ too
            entered = ".".join(parts[:k])
            inside = module == entered or module.startswith(entered + ".")
            if entered in modules and not inside:
                out.append((entered, line))
    return out


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, tuple[Path, bool]]]:
    """module -> {imported module: first line importing it}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_pkg) in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(module, path, is_pkg, modules):
            edges.setdefault(target, line)
        graph[module] = edges
    return graph, modules


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components, iteratively (no recursion limit on a deep graph)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def _circle(component: list[str], graph) -> list[str]:
    """One circle through the component's first module (breadth-first: a shortest one)."""
    members = set(component)
    start = component[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w in members and w not in came and w != start:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def _spelled(circle: list[str], graph, modules) -> str:
    steps = []
    for a, b in zip(circle, circle[1:]):
        path = modules[a][0].relative_to(ROOT)
        steps.append(f"{a} imports {b} ({path}:{graph[a][b]})")
    return "\n    ".join(steps)


def test_no_import_circles():
    graph, modules = import_graph()
    bad = [c for c in strongly_connected(graph) if len(c) > 1]
    text = "\n".join(f"circle among {', '.join(c)}:\n    {_spelled(_circle(c, graph), graph, modules)}" for c in bad)
    assert not bad, "import circles (break them: move the shared piece to the module that owns it)\n" + text


def test_the_graph_sees_function_level_and_relative_imports():
    """The walker itself: an import inside a function and a relative import are edges, and a circle
    through them is found and spelled."""
    graph = {"p.a": {"p.b": 3}, "p.b": {"p.c": 7}, "p.c": {"p.a": 1}, "p.d": {"p.a": 2}}
    comps = [c for c in strongly_connected(graph) if len(c) > 1]
    assert comps == [["p.a", "p.b", "p.c"]]
    assert _circle(comps[0], graph) == ["p.a", "p.b", "p.c", "p.a"]
    real, modules = import_graph()
    # planc/runtime/ imports its siblings relatively; planc/pipeline/gantt.py imports planc.commands.ui in a function
    assert "planc.runtime.dist_util" in real["planc.runtime.engine"]
    assert "planc.plan" in real["planc.runtime.engine"] and "planc.plan.jsonpath" in real["planc.plan.records"]
    assert "planc.commands.ui" in real["planc.pipeline.gantt"]
    # planc.budget imports planc.diagnostics, not the front end: from outside planc.lang, importing
    # planc.lang.errors would run planc/lang/__init__.py, an edge to planc.lang
    assert "planc.lang" in real["planc.driver.compile"] and "planc.lang" not in real["planc.budget"]


def test_the_product_never_imports_the_lab():
    graph, _ = import_graph()
    offenders = sorted(m for m, edges in graph.items()
                       if m.split(".")[0] == "planc" and any(t.split(".")[0] == "benchmarks" for t in edges))
    # also a name the lab might not define yet (no benchmarks/ folder here): read the imports' text
    for path in sorted((ROOT / "planc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"planc/ must not import benchmarks/: {sorted(set(offenders))}"


def test_no_module_over_500_lines():
    long = []
    for path in sorted((ROOT / "planc").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long.append(f"{rel}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams):\n  " + "\n  ".join(long)


def test_the_contract_imports_only_the_standard_library_and_itself():
    """planc.plan is copied into every output, where no other part of planc exists, and the runtime
    reads plan.json with it; the compiler writes with it. So it imports nothing else of planc (nor
    torch, nor anything outside the standard library), and planc.ir takes its vocabularies from it."""
    import sys
    graph, modules = import_graph()
    mine = [m for m in modules if m == CONTRACT or m.startswith(CONTRACT + ".")]
    assert len(mine) >= 7, mine
    outside = {m: sorted(t for t in graph[m] if not (t == CONTRACT or t.startswith(CONTRACT + ".")))
               for m in mine}
    assert not any(outside.values()), outside
    for m in mine:
        for node in ast.walk(ast.parse(modules[m][0].read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = [(node.module or "").split(".")[0]]
            else:
                continue
            assert all(t in sys.stdlib_module_names or t == "__future__" for t in tops), (m, tops)
    assert CONTRACT in graph["planc.ir"]


# the modules of planc/ that may import the front end: the driver that loads a .plan, and the CLI
FRONT_END_USERS = ("planc.driver.compile", "planc.commands.cli")


def test_only_the_driver_imports_the_front_end():
    """Passes and the readers of plan.json report errors through planc.diagnostics, not
    planc.lang.errors: importing any planc.lang module runs planc/lang/__init__.py, the parser."""
    graph, _ = import_graph()
    users = sorted(m for m, edges in graph.items()
                   if m.split(".")[0] == "planc" and not (m == "planc.lang" or m.startswith("planc.lang."))
                   and any(t == "planc.lang" or t.startswith("planc.lang.") for t in edges))
    assert users == sorted(FRONT_END_USERS), users


def test_importing_the_passes_leaves_the_parser_out():
    """A fresh interpreter that imports the passes, the plan readers and codegen has not loaded lark."""
    import subprocess
    import sys
    passes = ("planc.reduction", "planc.placement", "planc.resharding", "planc.pipeline", "planc.cost",
              "planc.model.infer", "planc.driver.verify", "planc.output.codegen", "planc.commands.explain")
    code = (f"import sys\nimport {', '.join(passes)}\n"
            "print(sorted(m for m in sys.modules if m == 'lark' or m.startswith(('lark.', 'planc.lang'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
