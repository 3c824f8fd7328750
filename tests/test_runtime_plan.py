"""plan.py, regions.py, dist_util.py checks, topology.py: pure tests, plus one
small gloo job for the collective start-up checks and group creation."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc.runtime import dist_util, plan as P, regions as R  # noqa: E402

PLAN = {
    "format": "planc/1", "name": "t",
    "cluster": {"devices": 8, "hosts": [[0, 1, 2, 3], [4, 5, 6, 7]], "host_level": "node"},
    "placement": {"axes": [{"name": "pipe", "size": 2}, {"name": "data", "size": 2}, {"name": "tensor", "size": 2}],
                  "coords": [[0, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1]]},
    "groups": [[0, 1], [2, 3], [4, 5], [6, 7], [0, 4, 5]],
    "stages": [{"index": 0, "devices": [0, 1, 2, 3], "mesh": [[0, 2], [1, 3]], "mesh_axes": ["data", "tensor"]},
               {"index": 1, "devices": [4, 5, 6, 7], "mesh": [[4, 6], [5, 7]], "mesh_axes": ["data", "tensor"]}],
}


def test_load_and_digest(tmp_path):
    raw = json.dumps(PLAN, indent=1).encode()
    f = tmp_path / "plan.json"
    f.write_bytes(raw)
    plan = P.load_plan(f)
    assert P.plan_digest(plan) == P.plan_digest(raw) == __import__("hashlib").sha256(raw).hexdigest()
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(P.PlanError, match="planc/1"):
        P.load_plan(tmp_path / "bad.json")


def test_accessors():
    assert P.stage_of(PLAN, 5) == 1 and P.stage_of(PLAN, 9) is None
    assert P.mesh_shape(PLAN["stages"][0]["mesh"]) == (2, 2) and P.mesh_shape([4, 5, 6]) == (3,)
    assert P.mesh_position(PLAN["stages"][1]["mesh"], 5) == (1, 0)
    assert P.host_of(PLAN, 6) == 1 and P.host_devices(PLAN, 2) == (0, 1, 2, 3)


def test_regions():
    mesh = [[0, 1], [2, 3]]
    assert R.region("S0 R R", (4, 2, 2), mesh, 2) == ((2, 4), (0, 2), (0, 2))
    assert R.region("S01 R", (8, 3), mesh, 1) == ((2, 4), (0, 3))
    assert R.region("R S1", (2, 6), mesh, 3) == ((0, 2), (3, 6))
    assert R.region("S(tensor) R", (4, 1), mesh, 1, mesh_axes=("data", "tensor")) == ((2, 4), (0, 1))
    assert R.region("S0RR", (2, 2, 2), mesh, 5) is None
    assert R.to_local(((3, 4), (1, 3)), ((2, 4), (0, 3))) == (slice(1, 2), slice(1, 3))
    with pytest.raises(R.SpecError, match="does not divide"):
        R.region("S0 R", (3, 2), mesh, 0)
    with pytest.raises(R.SpecError, match="entries"):
        R.parse_spec("S0 R", 3)
    with pytest.raises(R.SpecError, match="more than one"):
        R.parse_spec("S0 S0")


def test_host_and_digest_checks():
    ok = [("a", 4)] * 4 + [("b", 4)] * 4
    assert dist_util.check_hosts(PLAN, ok) == []
    assert dist_util.check_hosts(PLAN, [("one", 8)] * 8) == []          # emulated cluster
    bad = [("a", 3)] * 3 + [("b", 5)] * 5
    msgs = dist_util.check_hosts(PLAN, bad)
    assert any("host 'a' runs ranks [0, 1, 2]" in m for m in msgs)
    m = dist_util.check_digests(["x" * 64, "x" * 64, "y" * 64])
    assert len(m) == 1 and "ranks [2]" in m[0] and "ranks [0, 1]" in m[0]
    with pytest.raises(dist_util.StartupError, match="world size 4"):
        dist_util.check_world(PLAN, 4)


def test_timeout_env(monkeypatch):
    monkeypatch.setenv(dist_util.TIMEOUT_ENV, "12.5")
    assert dist_util.collective_timeout().total_seconds() == 12.5
    monkeypatch.delenv(dist_util.TIMEOUT_ENV)
    assert dist_util.collective_timeout().total_seconds() == dist_util.DEFAULT_TIMEOUT_S


def test_topology_mapping():
    from planc.runtime.topology import PlanTopology
    t = PlanTopology(PLAN)
    assert t.get_rank(pipe=0, data=1, tensor=0) == 1 and t.get_rank(pipe=1, data=0, tensor=1) == 6
    assert t.get_coord(3) == t.ProcessCoord(0, 1, 1)
    assert sorted(t.get_axis_comm_lists("pipe")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    explicit = {"stages": [{"index": 0, "mesh": [[0]]}, {"index": 1, "mesh": [[1, 2], [3, 4]]}]}
    e = PlanTopology(explicit)
    assert e.axes == ["pipe", "m0", "m1"] and e.get_rank(pipe=1, m0=1, m1=0) == 3
    assert e.world_size() == 5 and e.stage_of(2) == 1 and e.mesh_position(4) == (1, 1)


def startup_worker(rank, world, payload):
    from planc.runtime import dist_util as D
    plan, digests = payload
    groups = D.create_groups(plan)
    assert all((pg is None) == (rank not in g) for g, pg in groups.items())
    with pytest.raises(D.GroupMissing, match=r"\[0, 3\]"):
        D.lookup_group(groups, (3, 0))
    try:
        D.startup_checks(plan, digest=digests[rank])
    except D.StartupError as e:
        return "StartupError: " + str(e).replace("\n", " ")
    return "ok"


def test_startup_checks_gloo():
    plan = {"format": "planc/1", "name": "s", "cluster": {"devices": 3, "hosts": [[0, 1, 2]]},
            "groups": [[0, 1], [1, 2], [0, 1, 2]]}
    out = H.run_ranks(startup_worker, 3, (plan, ["a" * 64] * 3))
    assert all(v == "'ok'" for v in out.values()), out
    out = H.run_ranks(startup_worker, 3, (plan, ["a" * 64, "b" * 64, "a" * 64]))
    assert all("ranks disagree on the plan" in v and "ranks [1]" in v for v in out.values()), out
