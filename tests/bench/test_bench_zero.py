"""`python -m benchmarks bench zero`: its plans compile to the two pairs it compares, and its table's ratios
are the figures' (the measurement itself is the bench's: root and a testbed)."""
from __future__ import annotations

from benchmarks.bench import zero


def test_the_bench_compares_the_flat_pair_with_the_synthesized_one(tmp_path):
    cases = zero._cases(tmp_path)
    flat, synth = cases
    assert flat["text"] == ("reduce_scatter(slice=root, form=inside)", "all_gather(slice=root, form=inside)")
    assert synth["text"][0] != flat["text"][0] and synth["text"][1] != flat["text"][1]
    assert flat["bytes"] == synth["bytes"] == 4 * zero.LAYERS * (zero.HIDDEN * zero.HIDDEN + zero.HIDDEN)
    # the flat pair is the synthesized one's baseline, and the cost model prefers the hierarchy here
    assert synth["flat_predicted"] == flat["predicted"] > synth["predicted"]


def test_table_ratios():
    cases = [{"what": "flat x", "text": ("a", "b"), "measured": 1.2, "predicted": 0.6, "bytes": 50_000_000},
             {"what": "synth", "text": ("c", "d"), "measured": 0.6, "predicted": 0.3, "bytes": 50_000_000}]
    text = zero.table(cases)
    assert "physical bound 1.000 s" in text
    row = next(line for line in text.splitlines() if line.startswith("| synth"))
    assert "| 0.600 | 2.00 | 0.300 | 2.00 | 0.60 |" in row
