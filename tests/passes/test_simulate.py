"""The iteration simulator (planc.pipeline.simulate.predict) against closed forms, its memory figures
against the schedules' bounds, its predictions in compiled plans and `schedule = auto`, and the Gantt
chart of `planc simulate`."""

import dataclasses
from pathlib import Path

import pytest

from planc import ir
from planc.cost import events
from planc.cost.network import Network
from planc.pipeline.schedules import build, plan_actions, peak_in_flight
from planc.pipeline.simulate import (SimInput, SimReduction, SimTask, SimTransfer, StageCompute, predict, predict_schedule)

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")


def cluster(hosts, per_host=1, bw=1e9, latency=0.0, inner_bw=1e12):
    levels = (ir.Level("node", hosts, bw, latency),) + ((ir.Level("gpu", per_host, inner_bw, 0.0),)
                                                         if per_host > 1 else ())
    return ir.Cluster(levels, "node")


def chain_input(S, f, b, nbytes=0.0, bw=1e9, act=0.0):
    """S stages of one device each, device s on host s; a transfer of ``nbytes`` between neighbours."""
    comp = tuple(StageCompute((f,), (b,), (0.0,), act) for _ in range(S))
    trs = tuple(SimTransfer(f"t{s}", s, s + 1, (SimTask(s, (s + 1,), nbytes, "send_recv"),),
                            (SimTask(s + 1, (s,), nbytes, "send_recv"),)) for s in range(S - 1))
    return SimInput(cluster(S, bw=bw), tuple((s,) for s in range(S)), comp, trs)


@pytest.mark.parametrize("S,B", [(2, 4), (3, 5), (4, 8), (5, 3)])
def test_gpipe_bubble_with_free_communication(S, B):
    f, b = 1.0, 2.0
    p = predict_schedule(chain_input(S, f, b), "gpipe", B)
    assert p.iteration == pytest.approx((B + S - 1) * (f + b))
    for st in p.stages:
        assert st.bubble == pytest.approx((S - 1) / (B + S - 1))
        assert st.exposed_communication == pytest.approx(0.0, abs=1e-12)
    assert p.exposed_communication == pytest.approx(0.0, abs=1e-12)


def reduction_input(grad_bytes, bw, f0=1.0, f1=1.0, b0=2.0, b1=2.0):
    """One stage on two devices of two hosts (data = 2): layer 1's gradients (``grad_bytes``) are one
    bucket, reduced by a ring allreduce while layer 0's backward (``b0``) still runs; layer 0 has none."""
    comp = (StageCompute((f0, f1), (b0, b1), (0.0, grad_bytes)),)
    red = (SimReduction(0, (("allreduce", ((0, 1),)),)),)
    return SimInput(cluster(2, bw=bw), ((0, 1),), comp, (), red, bucket_bytes=1e18)


def test_reduction_hidden_when_shorter_than_the_overlapped_backward():
    B = 3
    ops = build("1f1b", 1, B).actions
    compute = B * (1.0 + 1.0 + 2.0 + 2.0)
    # ring allreduce of S over 2 devices: 2(k-1)/k S / bw = S / bw = 1.5 s < layer 0's backward (2 s)
    p = predict(reduction_input(1.5e9, 1e9), ops)
    assert p.iteration == pytest.approx(compute)
    assert p.exposed_communication == pytest.approx(0.0, abs=1e-9)
    assert p.stages[0].bubble == pytest.approx(0.0, abs=1e-9)
    # 5 s of reduction: 3 s stick out past the last backward
    q = predict(reduction_input(5e9, 1e9), ops)
    assert q.iteration == pytest.approx(compute - 2.0 + 5.0)
    assert q.exposed_communication == pytest.approx(3.0)
    assert q.stages[0].exposed_communication == pytest.approx(3.0)


@pytest.mark.parametrize("B", [1, 4, 7])
def test_link_bound_pipeline_runs_at_bytes_over_rate(B):
    """Compute ~0, one transfer of N bytes each way per micro-batch over a host link of rate R: the
    forward activations and the returning gradients use the two directions of the link, so 1f1b
    overlaps them, (B + 1) N / R; gpipe sends every gradient after every activation, 2 B N / R."""
    N, R = 4e6, 1e9
    sim = chain_input(2, 1e-15, 2e-15, nbytes=N, bw=R)
    one = predict_schedule(sim, "1f1b", B)
    assert one.iteration == pytest.approx((B + 1) * N / R, rel=1e-9)
    gp = predict_schedule(sim, "gpipe", B)
    assert gp.iteration == pytest.approx(2 * B * N / R, rel=1e-9)
    assert one.free_iteration == pytest.approx(0.0, abs=1e-12)


def test_links_are_shared_fairly():
    """Two flows leaving one host share its up-link: together bytes / capacity; alone each is faster."""
    net = Network(cluster(3, bw=1e9))
    g = events.Graph()
    a = g.add(flows=[(0, 1, 1e9)])
    b = g.add(flows=[(0, 2, 1e9)])
    c = g.add([a, b], duration=0.5)
    t = events.run(g, net)
    assert t.finish[a] == pytest.approx(2.0) and t.finish[b] == pytest.approx(2.0)
    assert t.finish[c] == pytest.approx(2.5)
    g2 = events.Graph()
    x = g2.add(flows=[(0, 1, 1e9)])
    g2.add(flows=[(2, 1, 0.5e9)])   # shares only the down-link into host 1
    t2 = events.run(g2, net)
    assert t2.finish[x] == pytest.approx(1.5)   # 0.5 s at half rate shared, then alone
    g3 = events.Graph()                          # two messages between one pair: one after the other
    first, second = g3.add(flows=[(0, 1, 1e9)]), g3.add(flows=[(0, 1, 1e9)])
    t3 = events.run(g3, net)
    assert (t3.finish[first], t3.finish[second]) == (pytest.approx(1.0), pytest.approx(2.0))
    g4 = events.Graph()
    a4 = g4.add()
    g4.add([a4, g4.add([a4])])
    g4.nodes[1].deps.append(2)                   # a cycle
    with pytest.raises(ValueError, match="cannot finish"):
        events.run(g4, net)


def test_runtime_constants_are_the_simulated_ones():
    import re
    from planc.pipeline import simulate
    from planc import plan
    from planc.runtime import comm   # stdlib only; grads imports torch, so read its constant
    assert simulate.RECV_AHEAD == comm.DEFAULT_AHEAD == plan.DEFAULT_RECV_AHEAD
    text = (ROOT / "planc" / "runtime" / "grads.py").read_text()
    assert re.search(r"^DEFAULT_BUCKET_BYTES = DEFAULT_GRAD_BUCKET_BYTES\b", text, re.M)   # the contract's
    assert simulate.BUCKET_BYTES == plan.DEFAULT_GRAD_BUCKET_BYTES == 8 << 20


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("S,B", [(2, 6), (3, 4), (4, 9)])
def test_schedule_memory_bounds_hold_in_simulation(schedule, S, B):
    act, N = 1000.0, 400.0
    sim = chain_input(S, 1e-3, 2e-3, nbytes=N, bw=1e6, act=act)
    p = predict_schedule(sim, schedule, B)
    for i, st in enumerate(p.stages):
        k = peak_in_flight(schedule, S, i, B)
        assert st.peak_in_flight == k
        # in-flight activations, plus inputs received ahead (at most `ahead` + 1 operations' worth)
        assert k * act <= st.peak_activation_bytes <= k * act + (sim.ahead + 1) * N
        if i == 0:
            assert st.peak_activation_bytes == k * act   # stage 0 receives no input


def test_every_transfer_and_reduction_moves_its_bytes():
    """Bytes delivered over the links equal the tasks' bytes (independent count over the plan)."""
    N = 1e5
    sim = chain_input(3, 1e-4, 2e-4, nbytes=N, bw=1e9)
    p = predict_schedule(sim, "eager_1f1b", 4, timeline=True)
    host_up = [(link, a, b) for link, a, b, what in p.traffic if link[2] == 0]
    moved = sum((b - a) * 1e9 for _, a, b in host_up)   # each flow alone on its up-link here
    assert moved == pytest.approx(2 * 2 * 4 * N, rel=1e-6)   # 2 transfers x 2 directions x 4 micro-batches
    assert len(p.transfers) == 2 * 2 * 4


# ---------------------------------------------------------------- compiled plans

@pytest.fixture(scope="module")
def unet():
    from planc.lang import load
    from planc.model.probe import probe_model
    program = load(ROOT / "plans" / "unet-skip.plan")
    return program, probe_model(program)


def test_predicted_iteration_in_compiled_bundled_plan_and_auto_follows_it(unet):
    from planc.driver.compile import compile_program
    program, probe = unet
    pipe = compile_program(program, probe).plan_json["pipeline"]
    runs = pipe["predicted"]["schedules"]
    assert set(runs) == set(SCHEDULES) | {"zb_h1"}   # the schedules of one stage per mesh
    assert pipe["predicted_iteration"] == runs[pipe["schedule"]]["iteration"] > 0
    stages = pipe["predicted"]["stages"]
    assert len(stages) == 3 and all(0 <= s["bubble"] <= 1 and s["peak_activation_bytes"] > 0 for s in stages)
    assert pipe["predicted"]["flops"] == 100e12 and pipe["predicted"]["flops_given"] is False
    # schedule = auto: the fastest predicted one, here with a slower device so compute matters
    slow = dataclasses.replace(program.cluster, flops=2e9)
    auto = dataclasses.replace(program, cluster=slow,
                               train=dataclasses.replace(program.train, schedule=ir.PipeSchedule.AUTO))
    plan = compile_program(auto, probe).plan_json
    runs = plan["pipeline"]["predicted"]["schedules"]
    best = min(runs.values(), key=lambda r: r["iteration"])["iteration"]
    assert runs[plan["pipeline"]["schedule"]]["iteration"] == best
    assert plan["train"]["schedule"] == plan["pipeline"]["schedule"]
    assert plan["choices"]["schedule"].startswith(f"{plan['pipeline']['schedule']}: the fastest predicted")
    # a memory limit only gpipe's need (the memory model, pipeline.stages[i].memory) breaks leaves gpipe out
    need = {s: _need(compile_program(dataclasses.replace(
        program, cluster=slow, train=dataclasses.replace(program.train, schedule=ir.PipeSchedule(s))), probe),
        probe) for s in SCHEDULES}
    limit = (need["gpipe"] + max(need["1f1b"], need["eager_1f1b"])) / 2
    assert need["gpipe"] > limit
    capped = dataclasses.replace(auto, cluster=dataclasses.replace(slow, memory=limit))
    got = compile_program(capped, probe).plan_json
    assert got["pipeline"]["schedule"] != "gpipe" and "gpipe would need" in got["choices"]["schedule"]


def _need(compiled, probe):
    """Per device, the most a stage needs: parameters, gradients, optimizer state + activations in flight."""
    return max(s["memory"]["total"] for s in compiled.plan_json["pipeline"]["stages"])


def test_pipeline_stages_of_the_contract(unet):
    """PLAN_FORMAT.md's ``pipeline.stages``: per stage busy, bubble and peak activation bytes, the
    simulated figures of ``pipeline.predicted.stages``; present with null figures when nothing was
    simulated (no probe), so a checker finds the key in every plan with a model."""
    from planc.driver.compile import compile_program
    program, probe = unet
    pipe = compile_program(program, probe).plan_json["pipeline"]
    assert [s["stage"] for s in pipe["stages"]] == [0, 1, 2]
    for st, sim in zip(pipe["stages"], pipe["predicted"]["stages"]):
        assert set(st) == {"stage", "busy", "bubble", "peak_activation_bytes", "memory"}
        assert set(st["memory"]) == {"parameters", "gradients", "optimizer", "activations", "logits", "step", "total", "build"}
        assert (st["busy"], st["bubble"], st["peak_activation_bytes"]) == \
            (sim["busy"], sim["bubble"], sim["peak_activation_bytes"])
        assert st["busy"] + st["bubble"] == pytest.approx(1.0) and st["peak_activation_bytes"] > 0
    from planc.lang import load
    from e2e_util import spelled
    bare = compile_program(load(spelled("unet-skip.plan")), None).plan_json["pipeline"]
    assert bare["predicted_iteration"] is None and "predicted" not in bare
    assert bare["stages"] == [{"stage": i, "busy": None, "bubble": None, "peak_activation_bytes": None,
                               "memory": None} for i in range(3)]


def test_gantt_chart_has_a_bar_per_interval(tmp_path, unet):
    pytest.importorskip("matplotlib")
    from planc.driver.compile import compile_program
    from planc.pipeline.gantt import draw, plan_input
    program, probe = unet
    plan = compile_program(program, probe).plan_json
    sim = plan_input(plan)
    p = predict(sim, plan_actions(plan), timeline=True)
    out = tmp_path / "t.png"
    info = draw(p, sim, out, title="unet")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    # one bar per stage per operation (the first device of each stage), one per host-link flow
    assert info["compute_bars"] == sum(len(c.compute()) for c in plan_actions(plan))
    hosts = sim.cluster.host_index
    assert info["traffic_bars"] == sum(1 for link, *_ in p.traffic if link[0] == hosts) > 0
    assert info["transfer_marks"] == 2 * len(plan["transfers"]) * plan["pipeline"]["micro_batches"]
    assert info["patches"] == info["compute_bars"] + info["traffic_bars"]   # bars on the axes
    assert info["markers"] == info["transfer_marks"]
    with pytest.raises(ValueError, match=".png or .svg"):
        draw(p, sim, tmp_path / "t.pdf")


def test_planc_simulate_on_a_compiled_plan(tmp_path, unet, capsys):
    pytest.importorskip("matplotlib")
    import json
    from planc.commands.cli import main
    from planc.driver.compile import compile_program
    import dataclasses
    program, probe = unet
    # without the cluster's flops there is no compute to draw: planc simulate says how to give it
    (tmp_path / "plan.json").write_text(json.dumps(compile_program(program, probe).plan_json))
    assert main(["simulate", str(tmp_path)]) == 2
    assert "the cluster gives no device throughput" in capsys.readouterr().err
    program = dataclasses.replace(program, cluster=dataclasses.replace(program.cluster, flops=2e9))
    plan = compile_program(program, probe).plan_json
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["simulate", str(tmp_path), "-o", str(tmp_path / "t.svg"), "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    for name in SCHEDULES:
        assert name in out
    assert "eager_1f1b (plan)" in out and "1f1b stage 2: busy" in out
    assert ("runtime overhead excluded: the cluster gives no op_overhead or step_overhead, so these times are the "
            "layers' FLOPs and the communication only; the runtime's own time per instruction and per step is not "
            "modelled, and a small model's real step is many times longer (docs/calibrate.md, \"The runtime's own "
            "time\")") in " ".join(out.split())
    svg = (tmp_path / "t.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    runs = plan["pipeline"]["predicted"]["schedules"]
    assert _us(runs["gpipe"]["iteration"]) in out   # the table re-simulates to the compiler's figures
    assert main(["simulate", str(tmp_path), "-o", str(tmp_path / "t.pdf")]) == 2
    capsys.readouterr()
    plan["cluster"].update(op_overhead=0.002, step_overhead=0.0105)   # a calibrated cluster file's figures
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["simulate", str(tmp_path)]) == 0
    assert ("runtime overhead included: 2 ms per instruction, 10.5 ms per step (the cluster's op_overhead, "
            "step_overhead)") in " ".join(capsys.readouterr().out.split())
    del plan["pipeline"]["predicted"]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["simulate", str(tmp_path / "plan.json")]) == 2
    assert "no compute model" in capsys.readouterr().err


def _us(seconds: float) -> str:
    from planc.pipeline.gantt import _t
    return _t(seconds)
