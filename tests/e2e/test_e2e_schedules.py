"""The schedules of issue 48 trained end to end against the independent single-process reference (plain
torch, SGD, rtol 1e-4; e2e_util.independent_reference) with its negative controls: interleaved_1f1b with
2 virtual stages on pipe 2 x data 2 across hosts and on explicit shared meshes, zb_h1 on unequal meshes
(data 2 -> data 4), zbv with two stages per mesh (a transfer between stages of one mesh moves nothing).
The reference knows nothing of the schedule: matching it means each computes what 1f1b computes."""
from __future__ import annotations

import pytest

from test_e2e_zero2 import run_and_compare, variant

pytestmark = pytest.mark.xdist_group("schedules")
SGD = [(r"optimizer = adam\(lr = 1e-3\)", "optimizer = sgd(lr = 0.1)")]
STEPS = 2


@pytest.mark.parametrize("name, edits, schedule, classes", [
    ("gpt-interleaved-2x2.plan", SGD, "interleaved_1f1b", [[0, 2], [1, 3]]),
    ("mlp-interleaved-meshes.plan", [], "interleaved_1f1b", [[0, 2], [1, 3]]),
    ("mlp-zb-h1-data2-to-data4.plan", [], "zb_h1", [[0], [1]]),
    ("gpt-zbv-2.plan", SGD, "zbv", [[0, 3], [1, 2]]),
])
def test_schedule_trains_the_reference(tmp_path, name, edits, schedule, classes):
    src, out, plan = variant(tmp_path, name, edits)
    assert plan["pipeline"]["schedule"] == schedule
    assert [c["stages"] for c in plan["pipeline"]["actions"]] == classes
    splits = schedule in ("zb_h1", "zbv")
    assert any(a[0] == "W" for c in plan["pipeline"]["actions"] for a in c["list"]) == splits
    r, _ = run_and_compare(tmp_path, src, out, plan, STEPS)
    if schedule == "zbv":   # the V's turn moves nothing between devices
        assert [t["name"] for t in plan["transfers"] if t.get("local")] == ["h12"]
