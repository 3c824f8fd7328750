"""The synthesis benchmark renders a table (timings are reported, never asserted)."""

import re

from benchmarks.bench import synthesis


def test_run_renders_one_row_per_case():
    cases = synthesis.CASES[:3]
    table = synthesis.run(cases)
    lines = table.splitlines()
    assert lines[0] == ("| hierarchy | axes | matrices | programs | slowest synthesis (factors) | placement | "
                        "placement + reductions planned |")
    assert len(lines) == 2 + len(cases)
    assert lines[2].startswith("| P² Fig. 2: rack 1 × server 2 × cpu 2 × gpu 4 | data 4 × param 4 (reduce data) | 4 ")
    assert all(l.count("|") == 8 and l.endswith(" s |") for l in lines[2:])
    # the matrices column says how the ranking was made and how many matrices it costed
    assert all(re.search(r"\| \d+ \((exhaustive|branch_and_bound), \d+ costed\) \|", l) for l in lines[2:])


def test_cases_cover_the_p2_systems_and_512_devices():
    labels = [c.label for c in synthesis.CASES]
    assert any("system A" in l for l in labels) and any("system B" in l for l in labels)
    devices = {c.label: __import__("math").prod(f for _, f, _, _ in c.levels) for c in synthesis.CASES}
    assert {512, 4096, 16384} <= set(devices.values())
    for c in synthesis.CASES:
        prog = synthesis.program_for(c)
        assert prog.parallel is not None and prog.cluster.devices == devices[c.label]
