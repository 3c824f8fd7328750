"""`planc bench … --plot`: the bench's own table drawn as bars, one per number of the drawn columns."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("matplotlib")

from benchmarks import cli  # noqa: E402
from benchmarks.bench import plot  # noqa: E402

TABLE = """Some text before.

| case | strategy | measured s | ÷ baseline (measured) | predicted s | ÷ baseline (predicted) |
|---|---|---|---|---|---|
| 1 -> (1,4) | send_recv | 1.458 | 1.00 | 1.343 | 1.00 |
| 1 -> (1,4) | broadcast | 0.370 | 0.25 | 0.346 | 0.26 |
| 8 ranks | flat | 0.677 | n/a | 0.589 | — |

| hierarchy | matrices | placement + synthesis |
|---|---|---|
| A | 4 | 0.013 s |
| B | 87 | 2.070 s |
"""


def _bars(svg_text: str) -> list[str]:
    return re.findall(r'id="(bar-\d+-\d+-\d+)"', svg_text)


def test_tables_are_read_back_with_their_cells():
    found = plot.tables(TABLE)
    assert [h[:2] for h, _ in found] == [["case", "strategy"], ["hierarchy", "matrices"]]
    assert found[0][1][1] == ["1 -> (1,4)", "broadcast", "0.370", "0.25", "0.346", "0.26"]
    assert plot.number("2.070 s") == 2.07 and plot.number("n/a") is None and plot.number("1,024") == 1024


def test_ratio_columns_are_drawn_when_there_are_any_else_the_numeric_ones(tmp_path):
    out = tmp_path / "p.svg"
    n = plot.plot_tables(TABLE, out, "t")
    bars = _bars(out.read_text())
    # table 1: the two ÷ columns over 3 rows, less the two cells that are not numbers; table 2: both columns
    assert n == len(bars) == 3 * 2 - 2 + 2 * 2
    assert sorted(b for b in bars if b.startswith("bar-1-")) == ["bar-1-0-0", "bar-1-0-1", "bar-1-1-0", "bar-1-1-1"]


def test_planc_bench_plot_draws_the_synthesis_table(tmp_path, capsys, monkeypatch):
    from benchmarks.bench import synthesis
    monkeypatch.setattr(synthesis, "run", lambda **_: TABLE)     # the bench's table; the drawing is the test
    out = tmp_path / "s.png"
    assert cli.main(["bench", "synthesis", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out} (8 bars)" in capsys.readouterr().err


def test_a_plot_that_is_not_png_or_svg_is_refused(tmp_path, capsys):
    assert cli.main(["bench", "synthesis", "--plot", str(tmp_path / "s.pdf")]) == 2
    assert "must be a .png or .svg file" in capsys.readouterr().err
