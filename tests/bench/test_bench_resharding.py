"""`planc bench resharding`: the table's shape and the AlpaComm figures on the small cases."""

from benchmarks.bench.resharding import cases, run


def test_bench_table_small_cases():
    table = run(check=True, large=False)
    lines = table.strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:4] == ["case", "tasks", "lower bound (ms)", "auto ="]
    assert len(lines) == 2 + len(cases(large=False))
    greedy = head.index("randomized_greedy ÷ LB")
    naive = head.index("naive ÷ LB")
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] == "broadcast"
        # every small case is within 5% of the NIC bound except 1 -> (4,2): t + A·t/K with A = 4, K = 64
        limit = 1.07 if cells[0].startswith("1 -> (4,2)") else 1.05
        assert 1.0 <= float(cells[greedy]) <= limit
        assert float(cells[naive]) >= float(cells[greedy])


def test_bench_cases_cover_alpacomm_meshes():
    names = [c.name for c in cases()]
    for mesh in ("(1,2)", "(1,4)", "(2,2)", "(2,4)", "(4,2)"):
        assert any(n.startswith(f"1 -> {mesh}") for n in names)
    for spec in ("S0 R R", "R R R", "R S0 R", "S1 R R"):
        assert f"(2,4) -> (2,4)  {spec} -> S0 R R" in names
    assert any(c.cluster.num_hosts == 64 and c.cluster.devices_per_host == 8 for c in cases())
