"""The model probe's answers kept across compiles (``planc compile`` without ``--no-cache``).

An answer is the runtime probe's JSON for one request (``planc.model.probe.probe_request``), or its report
of the user's code failing (``planc.model.probe.FAILED``: replayed as the same located error); it is kept in
``<folder>/<key>.json`` (default folder ``~/.cache/planc/probe/``), where ``key`` is the SHA-256 of:

- the request itself (model, data and loss files and functions, the model's arguments, micro-batch,
  seed, stage layers, transfers, tensor degrees, whether FLOPs are counted);
- the bytes of the model, data and loss files, and of every ``.py`` file beside the model file that it
  imports (``import x`` / ``from x import ...`` / ``from . import x``, read from its syntax tree: one
  level, the files a model folder usually splits into);
- torch's installed version (read from its package metadata, without importing torch), Python's, and
  the bytes of every module of planc's runtime (``planc/runtime/*.py``: the probe and all it imports),
  so a changed measurement is not served.

An entry holds the key and the answer's own SHA-256; one that cannot be read, does not parse, names
another key or whose answer does not hash to the digest it holds is ignored (the probe runs and the
entry is written again), never trusted. Entries are written to a temporary file, then renamed into
place. A hit gives the same answer the subprocess gave, so the same plan.json byte for byte.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"   # the probe runs these modules (probe.py and what it imports)
FORMAT = 1


def default_folder() -> Path:
    return Path.home() / ".cache" / "planc" / "probe"


def _digest(path: str | Path | None) -> str | None:
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _torch_version() -> str | None:
    from importlib import metadata
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def imported_beside(model_file: str | Path) -> list[Path]:
    """The ``.py`` files in the model file's folder that it imports (one level), sorted."""
    path = Path(model_file)
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif node.level == 1:
                names.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    out = []
    for name in sorted(names):
        for cand in (path.parent / f"{name}.py", path.parent / name / "__init__.py"):
            if cand.is_file() and cand.resolve() != path.resolve():
                out.append(cand)
    return out


def _runtime_digest() -> str:
    """One digest of every module of planc's runtime: the probe subprocess runs probe.py and the modules
    it imports (measurements, tied parameters, Hugging Face building, tensor parallelism), so a change to
    any of them is a different probe."""
    h = hashlib.sha256()
    for path in sorted(RUNTIME.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def request_key(req: dict) -> str:
    files = {what: _digest(req.get(what)) for what in ("model_file", "data_file", "loss_file")}
    beside = {str(p): _digest(p) for p in imported_beside(req["model_file"])} if req.get("model_file") else {}
    material = {"format": FORMAT, "request": req, "files": files, "beside": beside, "torch": _torch_version(),
                "python": platform.python_version(), "runtime": _runtime_digest()}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _answer_digest(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class ProbeCache:
    """A folder of probe answers; ``hits`` and ``misses`` count this object's lookups."""

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder) if folder is not None else default_folder()
        self.hits = self.misses = 0

    def path_of(self, req: dict) -> Path:
        return self.folder / f"{request_key(req)}.json"

    def get(self, req: dict) -> dict | None:
        """The kept answer to ``req``, or None (absent, unreadable or corrupt: recompute)."""
        key = request_key(req)
        try:
            entry = json.loads((self.folder / f"{key}.json").read_text())
            doc = entry["answer"]
            ok = (isinstance(entry, dict) and entry.get("format") == FORMAT and entry.get("key") == key
                  and isinstance(doc, dict) and entry.get("digest") == _answer_digest(doc))
        except (OSError, ValueError, KeyError, TypeError):
            ok, doc = False, None
        if not ok:
            self.misses += 1
            return None
        self.hits += 1
        return doc

    def put(self, req: dict, doc: dict) -> None:
        """Keep ``doc`` as the answer to ``req``; a folder that cannot be written is no error (no cache)."""
        key = request_key(req)
        entry = {"format": FORMAT, "key": key, "digest": _answer_digest(doc), "answer": doc}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, self.folder / f"{key}.json")
        except OSError:
            return
