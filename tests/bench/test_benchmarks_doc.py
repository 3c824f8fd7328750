"""docs/benchmarks.md stays a page of current tables: at most 400 lines, every benchmark's section with
the command that reproduces it, and every table the benchmarks write between markers of a bench that
exists (``python -m benchmarks bench NAME --write docs/benchmarks.md [--section NAME]``). No timing."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.bench import BENCHES, replace_section, run_bench

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
MAX_LINES = 400
COMMAND = re.compile(r"`python -m benchmarks[ .][^`]*`|^python -m benchmarks ", re.M)


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body up to the next heading of any level) for every ``##`` and ``###`` heading."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]


def test_the_page_is_at_most_400_lines():
    n = len(DOC.read_text().splitlines())
    assert n <= MAX_LINES, (f"docs/benchmarks.md has {n} lines, over {MAX_LINES}: keep one current table per "
                            "benchmark and trim the older sections' prose (the history is in git)")


def test_every_benchmark_section_has_its_command():
    sections = _sections(DOC.read_text())
    assert len(sections) >= 10
    missing = [head for head, body in sections if not COMMAND.search(body)]
    assert not missing, f"sections without a `python -m benchmarks ...` command: {missing}"


def test_every_marked_table_belongs_to_a_bench():
    text = DOC.read_text()
    begins = re.findall(r"^<!-- bench:([\w-]+) -->$", text, re.M)
    ends = re.findall(r"^<!-- /bench:([\w-]+) -->$", text, re.M)
    assert begins == ends and len(set(begins)) == len(begins)
    for name in begins:
        # a second run of a bench (--section NAME) is named after it: iteration-bf16 is iteration's
        assert name in BENCHES or name.split("-")[0] in BENCHES, name
        if name not in BENCHES:
            assert f"--section {name}" in text, f"the section {name!r} does not say how it is written"


def test_write_replaces_only_its_own_section(tmp_path, monkeypatch):
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n<!-- bench:iteration -->\nold fp32\n<!-- /bench:iteration -->\n\n"
                   "<!-- bench:iteration-bf16 -->\nold bf16\n<!-- /bench:iteration-bf16 -->\n")
    monkeypatch.setattr("benchmarks.testbed.available", lambda: "no testbed in this test")
    run_bench("iteration", write=str(doc), section="iteration-bf16", plans=["plans/gpt-bench-2x2.plan"])
    text = doc.read_text()
    assert "old fp32" in text and "old bf16" not in text and "_Skipped: no testbed in this test" in text
    replace_section(doc, "scale", "a table\n")   # a bench not on the page yet: appended
    after = doc.read_text()
    assert text in after and after.endswith("<!-- bench:scale -->\na table\n<!-- /bench:scale -->\n")
