"""The contract reader (planc.plan) on plans whose stages share meshes (interleaved_1f1b, zbv): what it accepts
(identical meshes run by one rank class, pipeline.virtual, local routes) and what it refuses, naming the key."""
from __future__ import annotations

import copy
import dataclasses
from functools import lru_cache
from pathlib import Path

import pytest

from planc import plan as planfile
from planc.driver.compile import compile_file
from planc.plan.file import _check_shared

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=None)
def _doc(name: str) -> dict:
    return compile_file(ROOT / "tests" / "plans" / name, probe=False).plan_json


def doc(name: str) -> dict:
    return copy.deepcopy(_doc(name))


def refused(d: dict, words: str) -> None:
    with pytest.raises(planfile.PlanFileError, match=words):
        planfile.Plan.from_json(d)


def test_the_compiled_plans_read_back():
    for name in ("gpt-interleaved-2x2.plan", "gpt-zbv-2.plan", "mlp-interleaved-meshes.plan"):
        d = doc(name)
        plan = planfile.Plan.from_json(d)
        assert plan.to_json() == d
        by_mesh: dict = {}
        for st in plan.stages:
            by_mesh.setdefault(st.mesh_devices, set()).add(st.index)
        assert {frozenset(c.stages) for c in plan.pipeline.actions} == {frozenset(v) for v in by_mesh.values()}
    assert _doc("gpt-interleaved-2x2.plan")["pipeline"]["virtual"] == 2
    assert "virtual" not in _doc("gpt-zbv-2.plan")["pipeline"]


def test_the_virtual_degree_goes_with_interleaved_only():
    d = doc("gpt-interleaved-2x2.plan")
    del d["pipeline"]["virtual"]
    refused(d, "interleaved_1f1b needs its virtual degree")
    d = doc("gpt-zbv-2.plan")
    d["pipeline"]["virtual"] = 2
    refused(d, "only interleaved_1f1b has a virtual degree")


def test_classes_other_than_the_schedules_are_refused():
    d = doc("gpt-interleaved-2x2.plan")
    d["pipeline"]["schedule"] = "zbv"
    del d["pipeline"]["virtual"]
    refused(d, r"zbv runs the stages in classes \[\[0, 3\], \[1, 2\]\]")


def test_stages_on_one_mesh_run_in_one_class():
    plan = planfile.Plan.from_json(doc("gpt-zbv-2.plan"))
    with pytest.raises(planfile.PlanFileError, match="only a pipeline running them in one rank class"):
        _check_shared(plan.stages, None)
    split = dataclasses.replace(plan.pipeline, actions=(planfile.RankClass((0, 1), ()), planfile.RankClass((2, 3), ())))
    with pytest.raises(planfile.PlanFileError, match="stages 1 and 2 share a mesh but"):
        _check_shared(plan.stages, split)


def test_a_partly_shared_mesh_is_refused():
    d = doc("gpt-zbv-2.plan")
    st = d["stages"][2]
    st["mesh"], st["mesh_devices"] = list(reversed(st["mesh"])), list(reversed(st["mesh_devices"]))
    refused(d, r"device \d is in stages 1 and 2")


def test_local_routes():
    d = doc("gpt-zbv-2.plan")
    h12 = next(t for t in d["transfers"] if t["name"] == "h12")
    other = next(t for t in d["transfers"] if t["name"] == "h01")
    h12["tasks"] = copy.deepcopy(other["tasks"])
    refused(d, "a local transfer has no tasks")
    d = doc("gpt-zbv-2.plan")
    h12 = next(t for t in d["transfers"] if t["name"] == "h12")
    dev, region = next(iter(h12["regions"]["src"].items()))
    h12["regions"]["src"][dev] = [[0, 1]] + region[1:]
    refused(d, "a local transfer: device")
