"""`python -m benchmarks.bench.cores`: one line per process count, every process timed, the ratio to
alone beside what processor sharing says; bad inputs named."""

from __future__ import annotations

from benchmarks.bench import cores


def test_it_times_every_process_and_says_what_sharing_predicts(capsys):
    assert cores.main(["--procs", "1,2", "--iters", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("1 process(es) on ") and "median ÷ alone 1.00" in lines[0]
    assert lines[1].startswith("2 process(es) on ") and lines[1].count(",") >= 1


def test_bad_inputs(capsys):
    assert cores.main(["--procs", "two"]) == 2
    assert "not whole numbers" in capsys.readouterr().err
    assert cores.main(["--procs", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
