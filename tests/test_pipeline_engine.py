"""Engine pieces without processes: instruction expansion, stage graph, probe."""

import json
import subprocess
import sys

import pytest
from deepspeed.runtime.pipe import schedule as ds

from planc.runtime.engine import EngineError, PlanEngine, PlanSchedule, StageGraph, trainable_spec_problem

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from e2e_util import ROOT, hand_plan  # noqa: E402

U = [("m", "f32", (4, 8, 8), 1, None, 2), ("e2", "f32", (4, 8, 8), 0, 1, 1),
     ("e2s", "f32", (4, 8, 8), 0, 1, 2), ("e1", "f32", (4, 4, 16), 0, 0, 2)]


def test_instruction_expansion_follows_plan_lists():
    sched = PlanSchedule(["F0", "F1", "B0", "B1"], 2, 3, 0, [], ["e2", "e2s", "e1"], True)
    steps = [[(type(c).__name__, c.kwargs) for c in s] for s in sched.steps()]
    assert steps[0] == [("LoadMicroBatch", {"buffer_id": 0}), ("ForwardPass", {"buffer_id": 0}),
                        ("SendActivation", {"buffer_id": 0, "transfer": "e2"}),
                        ("SendActivation", {"buffer_id": 0, "transfer": "e2s"}),
                        ("SendActivation", {"buffer_id": 0, "transfer": "e1"})]
    assert [n for n, _ in steps[2]] == ["RecvGrad"] * 3 + ["BackwardPass"]
    assert [n for n, _ in steps[-1]] == ["ReduceGrads", "OptimizerStep"]


def test_instruction_map_covers_every_instruction():
    for cls in (ds.LoadMicroBatch, ds.RecvActivation, ds.ForwardPass, ds.SendActivation, ds.RecvGrad,
                ds.BackwardPass, ds.SendGrad, ds.ReduceGrads, ds.OptimizerStep):
        assert cls in PlanEngine._INSTRUCTION_MAP


def test_stage_graph_declaration_order_and_checks():
    plan = hand_plan("u", [(0, 2), (2, 3), (3, 6)], 2, 1, U, "1f1b", 2)
    g = StageGraph(plan)
    g.check()
    assert g.incoming(2) == ["m", "e2s", "e1"] and g.outgoing(0) == ["e2", "e2s", "e1"]
    assert g.src_layer(g.by_name["m"]) == 2 and g.src_layer(g.by_name["e1"]) == 0
    bad = hand_plan("u", [(0, 2), (2, 3), (3, 6)], 2, 1, U[1:], "1f1b", 2)
    with pytest.raises(EngineError, match="stage 1 sends no transfer"):
        StageGraph(bad).check()


def test_only_data_slice_specs_train():
    plan = hand_plan("u", [(0, 2), (2, 3), (3, 6)], 2, 1, U, "1f1b", 2)
    assert trainable_spec_problem(plan, plan["transfers"][0]) is None
    t = dict(plan["transfers"][0], dst={"stage": 2, "spec": "R S0 R"})
    assert "--comm-only" in trainable_spec_problem(plan, t)


def test_probe_cli_reports_transfer_shapes():
    graph = {"stages": [[0, 2], [2, 3], [3, 6]],
             "transfers": [{"name": n, "src_stage": s, "src_layer": l, "dst_stage": d} for n, _, _, s, l, d in U]}
    r = subprocess.run([sys.executable, "-m", "planc.runtime.probe", str(ROOT / "examples" / "unet.py"), "build",
                        json.dumps({"channels": 4, "inputs": 2, "length": 16}), "4", "--graph", json.dumps(graph)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [t["shape"] for t in out["transfers"]] == [[4, 8, 8], [4, 8, 8], [4, 8, 8], [4, 4, 16]]
    assert out["params"] == sum(s["params"] for s in out["stages"])
    r = subprocess.run([sys.executable, "-m", "planc.runtime.probe", "nope.py", "build", "{}", "4"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("probe:")
