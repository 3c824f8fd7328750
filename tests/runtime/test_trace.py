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


def _stalled(tmp_path):
    """Two ranks, five steps of 1 s, except step 3: 2 s on rank 0, whose send was held 0.9 s, and 1.6 s
    on rank 1, waiting 0.8 s for a gradient and computing a 1.2 s forward (its own work, no hold-up)."""
    t0 = 1e15
    r0, r1 = Tracer(rank=0, stage=0), Tracer(rank=1, stage=1)
    at = t0
    for k in range(5):
        d0 = 2_000_000 if k == 3 else 1_000_000
        d1 = 1_600_000 if k == 3 else 1_000_000
        r0.complete(f"step {k}", at, at + d0, "main", step=k)
        r1.complete(f"step {k}", at, at + d1, "main", step=k)
        r0.complete("ForwardPass", at, at + 100_000, "compute", micro_batch=0)
        r0.complete("SendActivation", at + 100_000, at + (1_000_000 if k == 3 else 120_000), "compute",
                    micro_batch=0, transfer="h")
        r0.complete("ReduceGrads", at + 800_000, at + 850_000, "compute")
        r1.complete("RecvGrad", at + 200_000, at + (1_000_000 if k == 3 else 210_000), "compute",
                    micro_batch=1, transfer="h")
        r1.complete("ForwardPass", at, at + (1_200_000 if k == 3 else 100_000), "compute", micro_batch=1)
        r0.complete("send h forward m0", at, at + 1_500_000, "send", micro_batch=0)   # not the compute thread
        at += d0
    r0.dump(str(tmp_path))
    r1.dump(str(tmp_path))
    Tracer(rank=2).dump(str(tmp_path))          # an idle rank: no step
    return tmp_path


def test_stalls_name_the_slow_steps_and_their_longest_waits(tmp_path):
    from planc.runtime.trace import stalls
    d = str(_stalled(tmp_path))
    found = stalls(d, skip_steps=1)
    assert found["steps"] == 4 and found["median_step_s"] == pytest.approx(1.0) and found["factor"] == 1.25
    (slow,) = found["slow"]
    assert slow["step"] == 3 and slow["step_s"] == pytest.approx(2.0)     # the longest rank's step
    got = [(h["rank"], h["instruction"], h["micro_batch"], h["transfer"]) for h in slow["holdups"]]
    assert got == [(0, "SendActivation", 0, "h"), (1, "RecvGrad", 1, "h"), (0, "ReduceGrads", None, None)]
    first = slow["holdups"][0]
    assert first["stage"] == 0 and first["dur_s"] == pytest.approx(0.9) and first["at_s"] == pytest.approx(0.1)
    assert slow["holdups"][1]["dur_s"] == pytest.approx(0.8) and slow["holdups"][1]["at_s"] == pytest.approx(0.2)
    assert slow["holdups"][2]["at_s"] == pytest.approx(0.8) and slow["holdups"][2]["dur_s"] == pytest.approx(0.05)
    assert len(stalls(d, top=1)["slow"][0]["holdups"]) == 1
    assert stalls(d, factor=2.5)["slow"] == []                 # 2.0 s is not above 2.5 x 1 s
    assert stalls(d, skip_steps=5)["steps"] == 0
    with pytest.raises(ValueError, match="above 1"):
        stalls(d, factor=1.0)


def test_cli_stalls(tmp_path):
    d = _stalled(tmp_path / "t")
    r = _planc(d, "--stalls")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())       # the head line wraps at 80 columns when piped
    assert "1 of 4 step(s) took more than 1.25 x the median 1.0000 s" in out
    assert "step 3: 2.0000 s (2.00 x the median)" in out
    assert "rank 0 (stage 0) SendActivation m0 h: 900 ms, from 100 ms into the step" in out
    assert "rank 0 (stage 0) ReduceGrads: 50 ms, from 800 ms into the step" in out
    assert "ForwardPass" not in out
    r = _planc(d, "--stalls", "3")
    assert r.returncode == 0 and "0 of 4 step(s)" in r.stdout and "step 3:" not in r.stdout
    r = _planc(d, "--stalls", "--json", "--skip", "0")
    assert r.returncode == 0 and json.loads(r.stdout)["steps"] == 5
    r = _planc(d, "--stalls", "--plan", d)
    assert r.returncode == 2 and "do not combine" in r.stderr
    r = _planc(d, "--stalls", "0.5")
    assert r.returncode == 2 and "must be above 1" in r.stderr and "Traceback" not in r.stderr
    r = _planc(d, "--stalls", "--skip", "9")
    assert r.returncode == 2 and "no training step after the first 9" in r.stderr
    r = _planc(tmp_path / "nowhere", "--stalls")
    assert r.returncode == 2 and "planc trace: " in r.stderr and "Traceback" not in r.stderr
