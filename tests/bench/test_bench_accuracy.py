"""`planc bench accuracy`: the figures (median error, pairs ordered as measured, best against best)
against a hand computation; predictions under a calibrated cluster against an independent route
(the same plan compiled with the cluster file itself, and a closed form for a link-bound transfer);
the report, its JSON and the bad inputs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from benchmarks.bench import accuracy
from benchmarks.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _row(group, alt, p, m, source="s"):
    return {"source": source, "group": group, "alternatives": "schedules", "alternative": alt,
            "rate_mbit": 100.0, "predicted": p, "measured": m, "note": None}


def test_summary_by_hand():
    rows = [_row("A", "x", 1.0, 1.25), _row("A", "y", 2.0, 1.6), _row("A", "z", 3.0, 1.5),
            _row("B", "u", 0.5, 0.8), _row("B", "v", 0.4, 1.0),
            _row("C", "w", 1.1, 1.0),
            _row("A", "stock", None, 2.0)]          # no prediction: left out of every figure
    s = accuracy.summarize(rows)
    # errors |p-m|/m: x .2, y .25, z 1.0, u .375, v .6, w .1 -> sorted .1 .2 .25 .375 .6 1.0, median .3125
    assert [r["error"] for r in s["cases"]][:6] == pytest.approx([0.2, 0.25, 1.0, 0.375, 0.6, 0.1])
    assert s["cases"][6]["error"] is None
    assert s["median_error"] == pytest.approx(0.3125)
    # pairs: A (x,y) agree, (x,z) agree, (y,z) predicted y<z measured y>z: disagree; B (u,v) disagree
    assert (s["pairs_agree"], s["pairs"]) == (2, 4) and s["pair_fraction"] == pytest.approx(0.5)
    best = {g["group"]: (g["predicted_best"], g["measured_best"], g["same"]) for g in s["groups"]}
    assert best == {"A": ("x", "x", True), "B": ("v", "u", False)}   # C has one alternative: no group
    assert s["best_all_same"] is False


def test_a_predicted_tie_against_a_measured_order_disagrees():
    s = accuracy.summarize([_row("D", "a", 1.0, 1.0), _row("D", "b", 1.0, 2.0)])
    assert (s["pairs_agree"], s["pairs"]) == (0, 1)


def test_a_predicted_tie_is_broken_as_the_compiler_breaks_it():
    """Equal predictions: the predicted best is what ``schedule = auto`` would pick (eager_1f1b, then
    1f1b, then gpipe), whatever the rows' order; other alternatives keep the rows' order."""
    rows = [_row("T", "planc gpipe", 1.5, 1.9), _row("T", "planc 1f1b", 1.5, 1.8),
            _row("T", "planc eager_1f1b", 1.5, 1.7)]
    g = accuracy.summarize(rows)["groups"][0]
    assert g["predicted_best"] == "planc eager_1f1b" and g["same"]
    g = accuracy.summarize(rows[:2])["groups"][0]
    assert g["predicted_best"] == "planc 1f1b"
    # a shorter prediction still wins over the tie order
    g = accuracy.summarize([_row("T", "planc eager_1f1b", 1.6, 1.7), _row("T", "planc gpipe", 1.5, 1.9)])["groups"][0]
    assert g["predicted_best"] == "planc gpipe" and not g["same"]
    strategies = [dict(_row("S", "broadcast", 1.0, 2.0), alternatives="strategies"),
                  dict(_row("S", "send_recv", 1.0, 1.0), alternatives="strategies")]
    assert accuracy.summarize(strategies)["groups"][0]["predicted_best"] == "broadcast"


def test_pairs_the_measurement_orders():
    """A pair counts among the resolved ones only when every sample of one is below every sample of the
    other; the predicted order is judged on those apart from the rest."""
    def row(alt, p, m, samples):
        return dict(_row("R", alt, p, m), samples=samples)
    a = row("a", 1.0, 1.00, [0.98, 1.00, 1.02])
    b = row("b", 2.0, 1.50, [1.45, 1.50, 1.55])      # apart from a: resolved, predicted in order
    c = row("c", 0.5, 1.01, [0.99, 1.01, 1.60])      # overlaps a (and b): not resolved
    assert accuracy.resolved(a, b) and accuracy.resolved(b, a)
    assert not accuracy.resolved(a, c) and not accuracy.resolved(b, c)
    assert not accuracy.resolved(a, dict(b, samples=[1.5]))          # one sample: no spread to judge
    assert not accuracy.resolved(a, dict(b, samples=None))
    s = accuracy.summarize([a, b, c])
    # all pairs: (a,b) agree, (a,c) p c<a m a<c disagree, (b,c) p c<b m c<b agree -> 2/3
    assert (s["pairs_agree"], s["pairs"]) == (2, 3)
    assert (s["pairs_resolved_agree"], s["pairs_resolved"]) == (1, 1)
    g = s["groups"][0]
    assert (g["predicted_best"], g["measured_best"], g["best_resolved"]) == ("c", "a", False)
    assert (s["best_resolved_same"], s["best_resolved"]) == (0, 0)
    # the predictor wrong on a resolved pair counts as wrong there too
    s = accuracy.summarize([a, dict(b, predicted=0.5)])
    assert (s["pairs_resolved_agree"], s["pairs_resolved"]) == (0, 1)
    assert s["groups"][0]["best_resolved"] and (s["best_resolved_same"], s["best_resolved"]) == (0, 1)
    md = accuracy.markdown(dict(s, cluster="c.yaml"))
    assert "the pairs the measurement itself orders" in md and "0/1 ordered as measured" in md


def test_samples_are_round_medians_from_three_rounds_else_steps():
    assert accuracy._samples({"steps": [1, 2, 3, 4], "round_medians": [1.5, 2.5, 3.5]}) == [1.5, 2.5, 3.5]
    assert accuracy._samples({"steps": [1, 2, 3, 4], "round_medians": [1.5, 2.5]}) == [1, 2, 3, 4]
    assert accuracy._samples({"measured": 1.0}) is None


CAL = """\
levels:
  - {name: host, fanout: 2, bandwidth: 12000000.0, latency: 0.0001}
  - {name: device, fanout: 2, bandwidth: 2000000000.0, latency: 0.00002}
host: host
flops: 20000000000.0
calibration:
  measured_on: testbed
  rate_mbit: 100.0
  by_rate: [{rate_mbit: 100.0, bandwidth: 12000000.0, latency: 0.0001}]
"""


@pytest.fixture
def cal_file(tmp_path) -> Path:
    p = tmp_path / "cal.yaml"
    p.write_text(CAL)
    return p


def test_host_link_scales_with_the_rate(cal_file):
    cal = accuracy.read_calibrated(cal_file)
    assert cal.host(100) == (pytest.approx(12e6), pytest.approx(1e-4), "calibrated at 100 Mbit/s")
    assert cal.host(400)[0] == pytest.approx(48e6)
    assert cal.inner().bandwidth == pytest.approx(2e9)


def test_an_unshaped_calibration_is_a_ceiling_not_a_rate_to_scale(tmp_path):
    """`--rate ...,10000` on a veth that moves 3.8 Gbit/s measures the machine, not a 10 Gbit/s
    shaper: a rate between 400 and 10000 scales from 400 (once it scaled 475 MB/s down from 10000,
    so 2500 Mbit/s came out slower than 1500), and nothing scales past the ceiling."""
    p = tmp_path / "cal.yaml"
    p.write_text(CAL.replace("by_rate: [{rate_mbit: 100.0, bandwidth: 12000000.0, latency: 0.0001}]",
                             "by_rate: [{rate_mbit: 100.0, bandwidth: 12000000.0, latency: 0.0001, "
                             "both_ways: 11000000.0}, {rate_mbit: 400.0, bandwidth: 48000000.0, latency: 0.0, "
                             "both_ways: 43000000.0}, {rate_mbit: 10000.0, bandwidth: 475000000.0, "
                             "latency: 0.001, both_ways: 475000000.0}]"))
    cal = accuracy.read_calibrated(p)
    assert cal.host(10000) == (pytest.approx(475e6), pytest.approx(1e-3), "calibrated at 10000 Mbit/s")
    bw, lat, how = cal.host(2500)
    assert bw == pytest.approx(48e6 * 2500 / 400) and lat == 0.0 and how == "calibrated at 400 Mbit/s, scaled"
    assert cal.host(50000)[0] == pytest.approx(475e6)
    assert cal.host(50000)[2].endswith("at the unshaped ceiling")
    rates = [100, 400, 1000, 1500, 2500, 3500, 5000, 10000, 20000]
    one = [cal.host(r)[0] for r in rates]
    both = [cal.both_ways(r) for r in rates]
    assert one == sorted(one) and both == sorted(both)
    assert all(b <= o for b, o in zip(both, one))
    assert cal.both_ways(2500) == pytest.approx(43e6 * 2500 / 400)


def test_a_low_rate_under_its_nominal_is_the_shaper_not_a_ceiling(tmp_path):
    """10 Mbit/s measured at 7.5 (protocol overhead) is below 80 % of nominal but still the shaper's
    rate: it must not cap 100 Mbit/s; only a rate above every shaper-limited one can be a ceiling,
    and a file with only a ceiling gives the nominal rate up to it."""
    p = tmp_path / "cal.yaml"
    p.write_text(CAL.replace("by_rate: [{rate_mbit: 100.0, bandwidth: 12000000.0, latency: 0.0001}]",
                             "by_rate: [{rate_mbit: 10.0, bandwidth: 937500.0, latency: 0.0}, {rate_mbit: 100.0, "
                             "bandwidth: 12000000.0, latency: 0.0001}, {rate_mbit: 10000.0, bandwidth: 475000000.0, "
                             "latency: 0.001}]"))
    cal = accuracy.read_calibrated(p)
    assert cal.host(100)[0] == pytest.approx(12e6)
    assert cal.host(25)[0] == pytest.approx(937500.0 * 2.5)
    assert cal.host(2500)[0] == pytest.approx(12e6 * 25)
    only = tmp_path / "only.yaml"
    only.write_text(CAL.replace("by_rate: [{rate_mbit: 100.0, bandwidth: 12000000.0, latency: 0.0001}]",
                                "by_rate: [{rate_mbit: 10000.0, bandwidth: 475000000.0, latency: 0.001}]"))
    c2 = accuracy.read_calibrated(only)
    assert c2.host(100)[0] == pytest.approx(12.5e6) and c2.host(50000)[0] == pytest.approx(475e6)


def test_testbed_transfer_against_the_closed_form(cal_file):
    from benchmarks.bench import testbed

    name = "1 -> (1,4)  R R -> R R"
    cases = [{"kind": "transfer", "case": name, "what": "send_recv", "measured": 1.5},
             {"kind": "transfer", "case": name, "what": "broadcast", "measured": 0.4},
             {"kind": "reduction", "case": "8 ranks, 16 MB f32", "what": "hierarchical", "measured": 0.6}]
    rows = accuracy.testbed_cases(cases, accuracy.read_calibrated(cal_file), "tb.json", 400)
    # send_recv: the sender's host link carries the 16 MiB slice once per receiver (4) at 4 x 12 MB/s
    nbytes = 1024 * 4096 * 4
    assert rows[0]["predicted"] == pytest.approx(4 * nbytes / 48e6, rel=0.02)
    # broadcast pipelines it once over the host link
    assert rows[1]["predicted"] == pytest.approx(nbytes / 48e6, rel=0.1)
    assert [r["rate_mbit"] for r in rows] == [400.0] * 3 and rows[2]["predicted"] > 0
    # the 3-host fan-out 1 -> (2,4): send/recv sends the slice to each of 8 receivers over host 0's link
    wide = accuracy.testbed_cases([{"kind": "transfer", "case": "1 -> (2,4)  R R -> R R", "what": "send_recv",
                                    "measured": 3.0}], accuracy.read_calibrated(cal_file), "tb.json", 400)
    assert wide[0]["predicted"] == pytest.approx(8 * nbytes / 48e6, rel=0.02)
    # the hierarchical program with its in-host steps over gloo is the runtime's A/B, not a choice of
    # the compiler's: no row (the cost model cannot tell the two apart, and should not be scored on it)
    assert accuracy.testbed_cases([{"kind": "reduction", "case": "8 ranks, 16 MB f32", "measured": 0.55,
                                    "what": "hierarchical, in-host steps over gloo"}],
                                  accuracy.read_calibrated(cal_file), "tb.json", 400) == []
    with pytest.raises(accuracy.AccuracyError, match="unknown transfer case"):
        accuracy.testbed_cases([{"kind": "transfer", "case": "nope", "what": "send_recv"}],
                               accuracy.read_calibrated(cal_file), "tb.json")
    assert testbed.LINK_MBIT == 400.0


PLAN = """\
plan tiny {{
  {cluster}
  parallel {{ pipe = 2, data = 2, place = [[2, 1], [1, 2]] }}
  model "{ex}/mlp.py:build" {{ layers = 4, hidden = 64, inputs = 8, outputs = 4 }}
  loss  "{ex}/mlp.py:loss"
  data  "{ex}/mlp.py:batches"
  stage 0 : layers 0..2
  stage 1 : layers 2..4
  transfer h from stage 0 to stage 1
  reduce gradients over data
  train {{ micro_batch = 8, micro_batches = 4, steps = 2, schedule = 1f1b, optimizer = adam(lr = 1e-3) }}
}}
"""
OWN_CLUSTER = ("cluster {\n    level node x 2 : bandwidth 1 GB/s, latency 5 us\n"
               "    level gpu x 2 : bandwidth 10 GB/s, latency 1 us\n    host = node\n  }")


def test_iteration_cases_match_the_plan_compiled_with_the_file(tmp_path, cal_file, capsys):
    from planc.driver.compile import compile_program
    from planc.lang import load
    from planc.model.probe import probe_model

    ex = ROOT / "examples"
    plan = tmp_path / "tiny.plan"
    plan.write_text(PLAN.format(cluster=OWN_CLUSTER, ex=ex))
    measured = {"plans": [{"plan": str(plan), "name": "tiny", "programs": {
        "planc gpipe": {"per_rate": [{"rate": 100, "median": 0.030}, {"rate": 10, "median": 0.20}]},
        "planc 1f1b": {"per_rate": [{"rate": 100, "median": 0.028}, {"rate": 10, "median": 0.19}]},
        "planc eager_1f1b": {"per_rate": [{"rate": 100, "median": 0.027}, {"rate": 10, "median": 0.18}]},
        "stock DeepSpeed": {"per_rate": [{"rate": 100, "median": 0.04}, {"rate": 10, "median": None}]}}}]}
    mfile = tmp_path / "it.json"
    mfile.write_text(json.dumps(measured))
    out = tmp_path / "acc.json"
    assert main(["bench", "accuracy", str(mfile), "--cluster", str(cal_file), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "Median |p−m|/m" in capsys.readouterr().out
    # the independent route: the plan's cluster block replaced by the cluster file itself, with the host
    # link at 100 Mbit/s (as calibrated) and at 10 Mbit/s (a tenth of the bandwidth) written out
    direct, probe = {}, None
    for rate, bw in ((100.0, 12e6), (10.0, 1.2e6)):
        (tmp_path / f"c{rate:g}.yaml").write_text(CAL.replace("bandwidth: 12000000.0, latency: 0.0001}",
                                                              f"bandwidth: {bw}, latency: 0.0001}}", 1))
        p = tmp_path / f"tiny{rate:g}.plan"
        p.write_text(PLAN.format(cluster=f'cluster "c{rate:g}.yaml"', ex=ex))
        program = load(p)
        probe = probe or probe_model(program)          # the model is the same in both: probed once
        sched = compile_program(program, probe).plan_json["pipeline"]["predicted"]["schedules"]
        direct[rate] = {s: v["iteration"] for s, v in sched.items()}
    rows = res["cases"]
    assert len(rows) == 8
    for r in rows:
        if r["alternative"] == "stock DeepSpeed":
            assert r["predicted"] is None and "not simulated" in r["note"]
        else:
            want = direct[r["rate_mbit"]][r["alternative"].removeprefix("planc ")]
            assert r["predicted"] == pytest.approx(want, rel=1e-9)
            assert r["error"] == pytest.approx(abs(want - r["measured"]) / r["measured"])
    # the figures recomputed from the rows
    errs = sorted(r["error"] for r in rows if r["error"] is not None)
    assert res["median_error"] == pytest.approx((errs[2] + errs[3]) / 2)
    assert res["pairs"] == 6 and len(res["groups"]) == 2


def test_bad_inputs_exit_2(tmp_path, cal_file, capsys):
    assert main(["bench", "accuracy", "x.json"]) == 2
    assert "needs --cluster" in capsys.readouterr().err
    assert main(["bench", "accuracy", str(tmp_path / "none.json"), "--cluster", str(cal_file)]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{oops")
    assert main(["bench", "accuracy", str(tmp_path / "bad.json"), "--cluster", str(cal_file)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    (tmp_path / "odd.json").write_text('{"a": 1}')
    assert main(["bench", "accuracy", str(tmp_path / "odd.json"), "--cluster", str(cal_file)]) == 2
    assert "neither" in capsys.readouterr().err
    (tmp_path / "ok.json").write_text("[]")
    assert main(["bench", "accuracy", str(tmp_path / "ok.json"), "--cluster", str(tmp_path / "no.yaml")]) == 2
    assert "cluster file" in capsys.readouterr().err
    (tmp_path / "broken.yaml").write_text(textwrap.dedent("""\
        levels: [{name: host, fanout: 2}]
        """))
    assert main(["bench", "accuracy", str(tmp_path / "ok.json"), "--cluster", str(tmp_path / "broken.yaml")]) == 2
    err = capsys.readouterr().err
    assert "needs a bandwidth" in err and "Traceback" not in err
    assert main(["bench", "synthesis", "--cluster", str(cal_file)]) == 2


def test_one_cluster_per_measured_file(tmp_path, cal_file, capsys):
    # the same testbed case in two files, the second predicted under a host link twice as fast: each file's
    # rows are what that file alone gives under its own cluster, and the counts must match
    case = [{"kind": "transfer", "case": "1 -> (1,4)  R R -> R R", "what": "send_recv", "measured": 1.5}]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(case))
    b.write_text(json.dumps(case))
    fast = tmp_path / "fast.yaml"
    fast.write_text(CAL.replace("bandwidth: 12000000.0", "bandwidth: 24000000.0"))
    out = tmp_path / "acc.json"
    assert main(["bench", "accuracy", str(a), str(b), "--cluster", str(cal_file), "--cluster", str(fast),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["cases"]
    alone_a = accuracy.evaluate(str(cal_file), [str(a)])["cases"]
    alone_b = accuracy.evaluate(str(fast), [str(b)])["cases"]
    assert [r["predicted"] for r in rows] == [alone_a[0]["predicted"], alone_b[0]["predicted"]]
    assert rows[1]["predicted"] == pytest.approx(rows[0]["predicted"] / 2, rel=0.02)
    assert f"{cal_file} ({a})" in json.loads(out.read_text())["cluster"]
    capsys.readouterr()
    assert main(["bench", "accuracy", str(a), str(b), str(a), "--cluster", str(cal_file),
                 "--cluster", str(fast)]) == 2
    assert "--cluster given 2 times for 3 measured file(s)" in capsys.readouterr().err
    assert main(["bench", "nic", "--cluster", str(cal_file), "--cluster", str(fast)]) == 2
    assert "takes one cluster file" in capsys.readouterr().err
