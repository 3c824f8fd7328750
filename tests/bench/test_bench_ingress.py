"""`python -m benchmarks.bench.ingress`: link orders, simulated. The chains of the receiving-host order
checked against what they must hold (every key a send that enters that host, in ready order), and on
two hosts against the sending-host order (one sender host per receiving host: the two orders are the
same chains, so they simulate the same); the table and the bad inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks.bench import ingress

from test_bench_accuracy import CAL, OWN_CLUSTER, PLAN

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path):
    cal = tmp_path / "cal.yaml"
    cal.write_text(CAL)
    plan = tmp_path / "tiny.plan"
    plan.write_text(PLAN.format(cluster=OWN_CLUSTER, ex=ROOT / "examples"))
    return plan, cal


def test_receiving_host_chains(files):
    from benchmarks.bench.accuracy import read_calibrated, substitute
    from planc.driver.compile import compile_program
    from planc.lang import load
    from planc.pipeline.gantt import plan_input
    from planc.pipeline.schedules import build
    from planc.pipeline.simulate import _simulate, _turns, ingress_order_from, nic_order_from
    from planc.model.probe import probe_model

    plan, cal = files
    program = load(plan)
    program = dataclasses.replace(program, cluster=substitute(program.cluster, read_calibrated(cal), 100))
    pj = compile_program(program, probe_model(program)).plan_json
    sim = plan_input(pj)
    lists = _turns(build("1f1b", 2, 4, sim.transfers).actions, 2)
    shared = _simulate(sim, lists, free=False, keep=False)
    chains = ingress_order_from(shared.ready, sim)
    assert chains, "the tiny plan sends across its two hosts"
    when = {key: t for t, key in shared.ready}
    host_of = sim.cluster.host_of
    for h, keys in chains:
        assert [when[k] for k in keys] == sorted(when[k] for k in keys)
        for sender, name, direction, _ in keys:
            assert host_of(sender) != h
            t = next(t for t in sim.transfers if t.name == name)
            tasks = t.forward if direction == "forward" else t.backward
            assert any(host_of(r) == h for task in tasks if task.sender == sender for r in task.receivers)
    # two hosts: what enters host 1 is what leaves host 0, in the same ready order
    egress = dict(nic_order_from(shared.ready, sim))
    assert {h: keys for h, keys in chains} == {1 - h: keys for h, keys in egress.items()}


def test_table_on_two_hosts(files, capsys):
    plan, cal = files
    rs = ingress.rows(str(plan), str(cal), [100.0, 25.0])
    assert [(r["rate_mbit"], r["schedule"]) for r in rs] == [(100.0, "1f1b"), (100.0, "eager_1f1b"),
                                                             (25.0, "1f1b"), (25.0, "eager_1f1b")]
    for r in rs:
        assert r["sending hosts"] == pytest.approx(r["receiving hosts"]) == pytest.approx(r["both"])
        assert r["shared"] > 0
    slow = {r["schedule"]: r["shared"] for r in rs if r["rate_mbit"] == 25.0}
    fast = {r["schedule"]: r["shared"] for r in rs if r["rate_mbit"] == 100.0}
    assert all(slow[s] > fast[s] for s in slow)        # a slower link, a longer simulated step
    assert ingress.main([str(plan), "--cluster", str(cal), "--rates", "100"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 100 |") == 2 and "receiving hosts" in out


def test_bad_inputs(files, tmp_path, capsys):
    plan, cal = files
    assert ingress.main([str(plan), "--cluster", str(cal), "--rates", "fast"]) == 2
    assert "--rates 'fast': not numbers" in capsys.readouterr().err
    assert ingress.main([str(plan), "--cluster", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    assert ingress.main([str(tmp_path / "none.plan"), "--cluster", str(cal)]) == 2
    assert "none.plan" in capsys.readouterr().err
