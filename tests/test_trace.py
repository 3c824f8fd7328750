"""The runtime's measured timeline (``planc.runtime.trace``) and ``planc trace``: files written,
read back and summarised; the CLI's table, JSON and errors. The timeline of a real multi-process
run is checked against its plan.json lists in ``test_e2e_unequal.py`` (``check_traces``)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from planc.runtime.trace import Tracer, load, summarise


def _steps(tracer: Tracer, origin: float) -> None:
    """Two steps of 1 s each: 0.5 s forward+backward compute, 0.2 s waiting, 0.1 s sending, 0.1 s
    reducing, 0.1 s nothing; a receive and a send on their threads overlap the compute."""
    for k in range(2):
        t = origin + k * 1_000_000
        tracer.complete(f"step {k}", t, t + 1_000_000, "main", step=k)
        tracer.complete("RecvActivation", t, t + 200_000, "compute", micro_batch=0, transfer="x")
        tracer.complete("ForwardPass", t + 200_000, t + 400_000, "compute", micro_batch=0)
        tracer.complete("SendActivation", t + 400_000, t + 500_000, "compute", micro_batch=0, transfer="y")
        tracer.complete("BackwardPass", t + 500_000, t + 800_000, "compute", micro_batch=0)
        tracer.complete("ReduceGrads", t + 800_000, t + 900_000, "compute")
        tracer.complete("recv x forward m0", t - 50_000, t + 200_000, "recv", micro_batch=0)
        tracer.complete("send y forward m0", t + 400_000, t + 700_000, "send", micro_batch=0)


def test_written_read_back_and_summarised(tmp_path):
    tr = Tracer(rank=3, stage=1)
    _steps(tr, origin=1e15)
    # events from other threads land too
    th = threading.Thread(target=lambda: tr.complete("reduce bucket 0", 1e15, 1e15 + 10, "reduce", bytes=4))
    th.start()
    th.join()
    path = tr.dump(str(tmp_path))
    assert path.endswith("trace-rank3.json")
    data = json.loads(open(path).read())
    names = [e["name"] for e in data["traceEvents"]]
    assert names[0] == "process_name" and data["traceEvents"][0]["args"]["name"] == "rank 3 (stage 1)"
    assert names.count("ForwardPass") == 2 and "reduce bucket 0" in names
    assert all(e["ph"] in ("X", "M") for e in data["traceEvents"])
    ts = [e["ts"] for e in data["traceEvents"] if e["ph"] == "X"]
    assert ts == sorted(ts)
    Tracer(rank=0).dump(str(tmp_path))        # an idle rank: no step, left out of the summary
    assert sorted(load(str(tmp_path))) == [0, 3]

    for skip, n in ((1, 1), (0, 2)):
        (row,) = summarise(str(tmp_path), skip_steps=skip)
        assert row["rank"] == 3 and row["stage"] == 1 and row["steps"] == n
        assert row["step_s"] == pytest.approx(1.0)
        assert row["compute"] == pytest.approx(0.5)
        assert row["wait"] == pytest.approx(0.2)
        assert row["send"] == pytest.approx(0.1)
        assert row["reduce"] == pytest.approx(0.1)
        assert row["other"] == pytest.approx(0.1)


def test_overlapping_spans_are_counted_once(tmp_path):
    tr = Tracer(rank=0, stage=0)
    tr.complete("step 0", 0, 100, "main")
    tr.complete("ForwardPass", 0, 60, "compute")
    tr.complete("BackwardPass", 40, 80, "compute")     # nested instructions may overlap: union, not sum
    tr.dump(str(tmp_path))
    (row,) = summarise(str(tmp_path), skip_steps=0)
    assert row["compute"] == pytest.approx(0.8) and row["other"] == pytest.approx(0.2)


def _planc(*args):
    return subprocess.run([sys.executable, "-m", "planc", "trace", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_cli_table_json_and_errors(tmp_path):
    tr = Tracer(rank=1, stage=0)
    _steps(tr, origin=5e14)
    tr.dump(str(tmp_path / "t"))
    r = _planc(tmp_path / "t")
    assert r.returncode == 0, r.stderr
    assert "recv wait" in r.stdout and "50%" in r.stdout and "20%" in r.stdout
    r = _planc(tmp_path / "t", "--json", "--skip", "0")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["steps"] == 2

    r = _planc(tmp_path / "nowhere")
    assert r.returncode == 2 and "planc trace: " in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    r = _planc(tmp_path / "empty")
    assert r.returncode == 2 and "no trace-rank<R>.json files" in r.stderr, r.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "trace-rank0.json").write_text("{not json")
    r = _planc(tmp_path / "bad")
    assert r.returncode == 2 and "not a planc trace" in r.stderr and "Traceback" not in r.stderr, r.stderr
    Tracer(rank=0).dump(str(tmp_path / "idle"))
    r = _planc(tmp_path / "idle")
    assert r.returncode == 2 and "no training step" in r.stderr


def test_cli_shows_the_plans_prediction_beside_the_measurement(tmp_path):
    tr = Tracer(rank=1, stage=0)
    _steps(tr, origin=5e14)
    tr.dump(str(tmp_path / "t"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text(json.dumps({"pipeline": {"predicted_iteration": 0.75, "predicted": {
        "stages": [{"stage": 0, "busy": 0.4}, {"stage": 1, "busy": 0.9}]}}}))
    for plan in (out, out / "plan.json"):      # the output folder or its plan.json
        r = _planc(tmp_path / "t", "--plan", plan)
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        assert "0.7500 s per step" in text and "stage 0 40%, stage 1 90%" in text, r.stdout
    r = _planc(tmp_path / "t", "--plan", out, "--json")
    (row,) = json.loads(r.stdout)
    assert row["predicted_step_s"] == 0.75 and row["predicted_compute"] == 0.4
    (tmp_path / "bad.json").write_text("[1, 2")
    (tmp_path / "list.json").write_text("[1, 2]")
    for bad in (tmp_path / "nowhere", tmp_path / "bad.json", tmp_path / "list.json"):
        r = _planc(tmp_path / "t", "--plan", bad)
        assert r.returncode == 2 and "not a compiled output or plan.json" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
