"""`python -m benchmarks bench`: benchmarks whose tables go into docs/benchmarks.md.

Each benchmark module has ``run() -> str`` (a markdown section). With
``--write FILE`` the section replaces the text between its markers in FILE:
``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->`` (appended if absent; ``section``: another NAME, for a
second run of one bench, e.g. ``iteration-bf16``).
``run_bench(name, write, **options)`` passes ``options`` to ``run`` (``iteration``:
``plans``, ``rates``, ``json_path``, ``chart``; ``accuracy``: ``measured``, ``cluster``,
``json_path``; ``nic``: ``plans``, ``cluster``, ``rates``, ``json_path``; ``iteration``, ``quota`` and ``schedules``:
``cpus_per_rank``; ``schedules``: ``cluster``, ``rounds``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

BENCHES = ("synthesis", "resharding", "testbed", "iteration", "fuzz", "accuracy", "cut", "nic", "verify", "scale", "zero", "regime",
           "checkpoint", "build", "startup", "zero3", "quota", "bwsplit",
           "schedules")


def run_bench(name: str, write: str | None = None, section: str | None = None, **options) -> str:
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}")
    options = {k: v for k, v in options.items() if v is not None}
    text = importlib.import_module(f"benchmarks.bench.{name}").run(**options).rstrip() + "\n"
    if write:
        replace_section(Path(write), section or name, text)
    return text


def replace_section(path: Path, name: str, text: str) -> None:
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{text}{end}"
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        doc = head + block + tail
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)
