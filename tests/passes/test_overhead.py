"""The runtime's own time (cluster files' ``op_overhead`` and ``step_overhead``, measured by
``planc calibrate``): the simulator's closed forms with it, the cluster file's values and bad values,
plan.json, and ``planc bench accuracy`` carrying it from the calibration to the plans it predicts."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.bench import accuracy
from planc.lang import load
from planc.lang.errors import PlanError
from planc.pipeline.schedules import build
from planc.pipeline.simulate import predict, predict_schedule

from test_simulate import chain_input


@pytest.mark.parametrize("S,B", [(1, 3), (2, 4), (3, 5)])
def test_gpipe_with_the_runtimes_own_time_is_its_closed_form(S, B):
    """Free communication, every instruction ``o`` longer and every device's step ``k`` longer:
    (B + S - 1)(f + o + b + o) + k, and the bubble of the longer instructions."""
    f, b, o, k = 1.0, 2.0, 0.25, 3.0
    sim = dataclasses.replace(chain_input(S, f, b), op_overhead=o, step_overhead=k)
    p = predict_schedule(sim, "gpipe", B)
    assert p.iteration == pytest.approx((B + S - 1) * (f + b + 2 * o) + k)
    plain = predict_schedule(chain_input(S, f, b), "gpipe", B)
    assert plain.iteration == pytest.approx((B + S - 1) * (f + b))


def test_1f1b_on_one_stage_pays_it_per_instruction():
    sim = dataclasses.replace(chain_input(1, 1.0, 2.0), op_overhead=0.5, step_overhead=0.75)
    assert predict_schedule(sim, "1f1b", 6).iteration == pytest.approx(6 * (1 + 2 + 2 * 0.5) + 0.75)


YAML = """\
levels:
- {name: host, fanout: 2, bandwidth: 12000000.0, latency: 0.0001}
- {name: device, fanout: 2, bandwidth: 2000000000.0, latency: 0.00002}
host: host
flops: 20000000000.0
"""


def _load(tmp_path, extra: str):
    (tmp_path / "c.yaml").write_text(YAML + extra)
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\nparallel { pipe = 2, data = 2 }\n')
    return load(tmp_path / "p.plan")


def test_the_cluster_file_gives_it_in_seconds_or_with_a_unit(tmp_path):
    c = _load(tmp_path, "op_overhead: 2 ms\nstep_overhead: 0.03\n").cluster
    assert c.op_overhead == pytest.approx(2e-3) and c.step_overhead == pytest.approx(0.03)
    c = _load(tmp_path, "").cluster
    assert c.op_overhead is None and c.step_overhead is None


@pytest.mark.parametrize("extra,message,line", [
    ("op_overhead: -1\n", "op_overhead: must be a time of at least 0 (seconds of a device per instruction), got -1", 6),
    ("step_overhead: soon\n", "step_overhead: ", 6),
    ("step_overhed: 1\n", "unknown key 'step_overhed'", 6),
])
def test_bad_values_are_located_in_the_file(tmp_path, extra, message, line):
    with pytest.raises(PlanError) as e:
        _load(tmp_path, extra)
    d = e.value.diagnostics[0]
    assert message in d.message and d.span.line == line and d.span.file.endswith("c.yaml")


def test_plan_json_and_the_accuracy_bench_carry_it(tmp_path):
    from planc.driver.compile import compile_program

    (tmp_path / "c.yaml").write_text(YAML + "op_overhead: 0.002\nstep_overhead: 0.03\n")
    cal = accuracy.read_calibrated(tmp_path / "c.yaml")
    assert (cal.op_overhead, cal.step_overhead) == (0.002, 0.03)
    (tmp_path / "p.plan").write_text(
        "plan p {\n  cluster {\n    level node x 2 : bandwidth 1 GB/s, latency 5 us\n"
        "    level gpu x 2 : bandwidth 10 GB/s, latency 1 us\n    host = node\n  }\n"
        "  stage 0 on devices 0..2 as (data = 2)\n  stage 1 on devices 2..4 as (data = 2)\n"
        "  transfer h : f32[4, 8] from stage 0 as S0 R to stage 1 as S0 R\n}\n")
    program = load(tmp_path / "p.plan")
    assert program.cluster.op_overhead is None
    sub = accuracy.substitute(program.cluster, cal, 100)
    assert (sub.op_overhead, sub.step_overhead) == (0.002, 0.03)
    pj = compile_program(dataclasses.replace(program, cluster=sub)).plan_json
    assert pj["cluster"]["op_overhead"] == 0.002 and pj["cluster"]["step_overhead"] == 0.03
    assert "op_overhead" not in compile_program(program).plan_json["cluster"]


CAL = """\
levels:
- {name: host, fanout: 2, bandwidth: 3183300.0, latency: 0.0, both_ways: 2728140.0}
- {name: device, fanout: 2, bandwidth: 1679840000.0, latency: 0.000260813}
host: host
flops: 129303000000.0
cores: 2
cores_per: cluster
calibration: {measured_on: testbed, rate_mbit: 25.0}
"""


@pytest.fixture(scope="module")
def engine_plans(tmp_path_factory):
    """The calibration's engine plan at both micro-batch counts, compiled with the probe."""
    from benchmarks import calibrate as cal
    from planc.driver.compile import compile_file

    tmp = tmp_path_factory.mktemp("engine")
    (tmp / "engine_model.py").write_text(cal.ENGINE_MODEL)
    plans = []
    for b in cal.ENGINE_MICRO_BATCHES:
        (tmp / f"e{b}.plan").write_text(cal.engine_plan(2, 2, b, 25.0))
        plans.append(compile_file(tmp / f"e{b}.plan", probe=True).plan_json)
    return plans


def test_the_fit_recovers_the_time_that_made_the_measurements(engine_plans, tmp_path):
    """Measurements simulated with a known runtime time (through the same calibrated cluster, the
    transfers cut to one element) are fitted back to it; measurements below what the model already
    predicts fit to no time at all (never a negative one)."""
    import yaml

    from benchmarks import calibrate as cal
    from benchmarks.bench.accuracy import read_calibrated, substitute
    from planc.pipeline.gantt import cluster_of

    doc = yaml.safe_load(CAL)
    (tmp_path / "c.yaml").write_text(CAL)
    c = read_calibrated(tmp_path / "c.yaml")
    sims = [cal._signal_input(p, substitute(cluster_of(p), c, 25.0)) for p in engine_plans]
    assert all(t.nbytes == 4.0 for s in sims for tr in s.transfers for t in tr.forward + tr.backward)
    lists = [build("1f1b", 2, p["pipeline"]["micro_batches"], s.transfers).actions for p, s in zip(engine_plans, sims)]
    truth = [predict(dataclasses.replace(s, op_overhead=0.003, step_overhead=0.02), ls).iteration
             for s, ls in zip(sims, lists)]
    got = cal.fit_overhead(sims, lists, truth)
    assert got["op_overhead"] == pytest.approx(0.003, rel=1e-3)
    assert got["step_overhead"] == pytest.approx(0.02, rel=1e-3)
    assert got["simulated"] == pytest.approx(truth, rel=1e-4)
    none = cal.fit_overhead(sims, lists, [x * 0.5 for x in got["simulated_without"]])
    assert none["op_overhead"] == 0.0 and none["step_overhead"] == 0.0
    # the whole path from the engine's measurements and the document
    out = cal.engine_fit({"plans": engine_plans, "step_s": truth, "micro_batches": [4, 16]}, doc)
    assert out["op_overhead"] == pytest.approx(0.003, rel=1e-3) and out["step_overhead"] == pytest.approx(0.02, rel=1e-3)
