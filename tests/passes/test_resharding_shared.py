"""Transfers between two stages of one mesh (interleaved_1f1b, zbv): with equal specs nothing moves (no
tasks, the route ``local``); with other specs a device receives only what it does not hold; meshes that
only overlap are refused. The planner's output passes the independent checker (planc/resharding/check.py),
which also refuses what is not exactly that."""
from __future__ import annotations

import copy

import pytest

from planc import ir
from planc.resharding import plan_group, unit_tasks
from planc.resharding.check import check_plan

CLUSTER = ir.Cluster((ir.Level("node", 2, 1e9, 1e-5), ir.Level("gpu", 2, 1e11, 1e-6)), "node")
MESH = ir.StageLayout(0, None, (2, 2), ("data", "tensor"), (0, 1, 2, 3))
SAME = ir.StageLayout(1, None, (2, 2), ("data", "tensor"), (0, 1, 2, 3))
SPEC = ir.ShardingSpec.parse


def transfer(src: str, dst: str) -> ir.Transfer:
    return ir.Transfer("t", "f32", (8, 16), 0, None, SPEC(src), 1, SPEC(dst))


def view(plan) -> dict:
    stages = [{"index": s.index, "mesh": [[0, 1], [2, 3]], "devices": [0, 1, 2, 3]} for s in (MESH, SAME)]
    return {"cluster": {"levels": [{"name": lv.name, "fanout": lv.fanout, "bandwidth": lv.bandwidth,
                                    "latency": lv.latency} for lv in CLUSTER.levels],
                        "host_level": "node", "devices": 4, "hosts": [[0, 1], [2, 3]]},
            "stages": stages, "transfers": [plan.to_json()]}


def planned(src: str, dst: str):
    return plan_group([transfer(src, dst)], [(MESH, SAME)], CLUSTER, ir.Resharding())[0]


@pytest.mark.parametrize("src, dst", [("S0 R", "S0 R"), ("S0 S1", "S0 S1"), ("R R", "S0 R"), ("R R", "R S1")])
def test_a_device_that_holds_its_region_receives_nothing(src, dst):
    p = planned(src, dst)
    assert p.local and p.tasks == () and p.makespan == 0.0 and p.lower_bound == 0.0
    assert p.to_json()["local"] is True
    assert check_plan(view(p)) == []


@pytest.mark.parametrize("src, dst", [("S0 R", "R R"), ("S0 R", "S1 R"), ("S0 R", "R S0")])
def test_other_specs_on_one_mesh_exchange_only_what_is_missing(src, dst):
    p = planned(src, dst)
    assert not p.local and p.tasks and "local" not in p.to_json()
    src_regions = {d: r for d, r in _regions(src)}
    for t in p.tasks:
        for r in t.receivers:
            assert not all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(t.slice, src_regions[r]))
    assert check_plan(view(p)) == []


def _regions(spec):
    from planc.resharding import device_region
    return [(d, device_region((8, 16), MESH, SPEC(spec), d)) for d in MESH.devices]


def test_the_checker_accepts_local_exactly_for_one_mesh_without_tasks():
    p = planned("S0 R", "S0 R")
    doc = view(p)
    doc["transfers"][0]["local"] = False
    assert any("local" in e for e in check_plan(doc))
    q = planned("S0 R", "R R")
    doc = view(q)
    doc["transfers"][0]["local"] = True
    assert any("local" in e for e in check_plan(doc))
    doc = view(q)   # a task to a device that holds the slice already
    t = doc["transfers"][0]["tasks"][0]
    holder = t["holders"][0]
    doc["transfers"][0]["tasks"][0] = dict(t, receivers=sorted(set(t["receivers"]) | {holder}))
    assert any("holds the slice already" in e for e in check_plan(doc))


def test_meshes_that_only_overlap_are_refused():
    half = ir.StageLayout(1, None, (2,), ("data",), (0, 1))
    with pytest.raises(ValueError, match="overlap"):
        unit_tasks((8, 16), MESH, SPEC("S0 R"), half, SPEC("S0 R"))
    other = ir.StageLayout(1, None, (4,), ("data",), (0, 1, 2, 3))   # the same devices, another shape
    with pytest.raises(ValueError, match="overlap"):
        unit_tasks((8, 16), MESH, SPEC("S0 R"), other, SPEC("S0 R"))
    doc = view(planned("S0 R", "S0 R"))
    doc = copy.deepcopy(doc)
    doc["stages"][1]["mesh"] = [[0, 2], [1, 3]]   # the same devices in another mesh: not one mesh
    assert any("overlap" in e for e in check_plan(doc))
