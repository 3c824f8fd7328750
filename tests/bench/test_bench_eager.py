"""`python -m benchmarks.bench.eager`: each row is the plan compiled as `planc bench accuracy` compiles it
(the same predictions), a model size replaces the plan's arguments (and changes the compute),
`--own-cores` drops the shared pool, and bad inputs are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench import eager

from test_bench_accuracy import CAL, OWN_CLUSTER, PLAN

ROOT = Path(__file__).resolve().parents[2]
SHARED = CAL.replace("host: host\n", "host: host\ncores: 1\ncores_per: cluster\n")


@pytest.fixture
def files(tmp_path):
    cal = tmp_path / "cal.yaml"
    cal.write_text(SHARED)
    plan = tmp_path / "tiny.plan"
    plan.write_text(PLAN.format(cluster=OWN_CLUSTER, ex=ROOT / "examples"))
    return plan, cal


def test_rows_are_the_compiled_predictions_and_a_size_changes_the_compute(files):
    from benchmarks.bench.accuracy import compiled_at_rates, read_calibrated
    from planc.lang import load

    plan, cal = files
    rs = eager.rows(str(plan), str(cal), [100.0, 10.0])
    expect = {r: pj["pipeline"]["predicted"] for r, pj in compiled_at_rates(load(plan), read_calibrated(cal),
                                                                               [100.0, 10.0])}
    for r in rs:
        want = expect[r["rate_mbit"]]
        assert r["1f1b"] == want["schedules"]["1f1b"]["iteration"]
        assert r["compute"] == want["iteration_free_communication"]
        assert r["gain"] == pytest.approx(r["1f1b"] / r["eager_1f1b"])
        assert r["model"] == "layers=4, hidden=64, inputs=8, outputs=4"
    wide = eager.rows(str(plan), str(cal), [100.0], [{"hidden": 256}])[0]
    assert wide["model"].startswith("layers=4, hidden=256")
    assert wide["compute"] > rs[0]["compute"]          # 16x the matmul FLOPs
    # one core shared by the four devices: every device alone computes no slower
    own = eager.rows(str(plan), str(cal), [100.0], own_cores=True)[0]
    assert own["compute"] < rs[0]["compute"]
    table = eager.markdown(rs)
    assert table.count("\n") == 1 + len(rs) and "| 1f1b ÷ eager |" in table


def test_bad_inputs_are_named(files, capsys):
    plan, cal = files
    assert eager.main([str(plan), "--cluster", str(cal), "--model", "hidden"]) == 2
    assert "'hidden' is not KEY=VALUE" in capsys.readouterr().err
    assert eager.main([str(plan), "--cluster", str(cal), "--model", "width=3"]) == 2
    assert "the plan's model takes no width (it has hidden, inputs, layers, outputs)" in capsys.readouterr().err
    assert eager.main([str(plan), "--cluster", str(cal), "--rates", "0"]) == 2
    assert "not positive Mbit/s" in capsys.readouterr().err
    assert eager.main([str(plan), "--cluster", str(cal.parent / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    assert eager.main([str(plan), "--cluster", str(cal), "--rates", "100"]) == 0
    assert "| layers=4, hidden=64, inputs=8, outputs=4 | 100 |" in capsys.readouterr().out
