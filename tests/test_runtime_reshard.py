"""Resharding executor: N-process gloo runs against the single-process reference.

Every destination rank must end with exactly its region of the global tensor,
bit for bit, and backward must deliver every source rank its gradient region,
for many spec pairs, meshes of different shapes, and all four strategies.
Plans come from the compiler's planner (planc.resharding) when it can be
used, else from the runtime's own simple task builder.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc.runtime.plan import mesh_devices, mesh_shape  # noqa: E402
from planc.runtime.regions import Layout, intersect, numel  # noqa: E402
from planc.runtime.reshard import STRATEGIES, build_tasks, tag_for  # noqa: E402

HOSTS = [[0, 1, 2, 3], [4, 5, 6, 7]]

# (name, shape, dtype, src mesh, src spec, dst mesh, dst spec)
CASES = [
    ("S0->S0", (4, 4, 2), "f32", [[0, 1], [2, 3]], "S0 R R", [[4, 5], [6, 7]], "S0 R R"),
    ("R->S0", (4, 2, 2), "i32", [[0, 1], [2, 3]], "R R R", [[4, 5], [6, 7]], "S0 R R"),
    ("RS0->S0", (4, 4, 2), "f32", [[0, 1], [2, 3]], "R S0 R", [[4, 5], [6, 7]], "S0 R R"),
    ("S1->S0", (4, 2, 3), "f64", [[0, 1], [2, 3]], "S1 R R", [[4, 5], [6, 7]], "S0 R R"),
    ("S01->R", (8, 3), "bf16", [[0, 1], [2, 3]], "S01 R", [[4, 5], [6, 7]], "R R"),
    ("1-to-(2,2)", (4, 6), "f32", [[0]], "R R", [[4, 5], [6, 7]], "S0 S1"),
    ("(1,4)->(2,1)", (6, 4), "i64", [[0, 1, 2, 3]], "R S1", [[4], [5]], "S0 R"),
    ("(4,)->(1,3) odd", (4, 6), "f32", [0, 1, 2, 3], "S0 R", [[5, 6, 7]], "R S1"),
    ("cross-host both", (4, 5), "f32", [[0, 4]], "S1 R", [[1, 2], [5, 6]], "R R"),
]


def _planner_tasks(shape, dtype, src, dst, strategy, chunks):
    """Tasks from planc.resharding (src -> dst); a planner error fails the test."""
    from planc import ir
    from planc.resharding import plan_group
    cluster = ir.Cluster((ir.Level("node", 2, 1.25e9, 2e-5), ir.Level("gpu", 4, 1.5e10, 2e-6)), "node")

    def lay(index, mesh, axes=("m0", "m1")):
        ms = mesh_shape(mesh)
        return ir.StageLayout(index, None, ms, tuple(axes[:len(ms)]), tuple(mesh_devices(mesh)))

    tr = ir.Transfer("t", dtype, tuple(shape), src[0], None, ir.ShardingSpec.parse(src[2]),
                     dst[0], ir.ShardingSpec.parse(dst[2]))
    cfg = ir.Resharding(strategy=ir.Strategy(strategy), chunks=chunks,
                        scheduler=ir.SchedulerKind.RANDOMIZED_GREEDY, trials=4, seed=0)
    (p,) = plan_group([tr], [(lay(src[0], src[1]), lay(dst[0], dst[1]))], cluster, cfg)
    return [t.to_json() for t in p.tasks]


def make_plan(case, strategy, chunks=3, use_planner=True):
    name, shape, dtype, smesh, sspec, dmesh, dspec = case
    src, dst = (0, smesh, sspec), (1, dmesh, dspec)
    fwd = _planner_tasks(shape, dtype, src, dst, strategy, chunks) if use_planner else None
    bwd = _planner_tasks(shape, dtype, (0, dmesh, dspec), (1, smesh, sspec), strategy, chunks) if use_planner else None
    source = "planner" if fwd is not None and bwd is not None else "builder"
    sl, dl = Layout(shape, smesh, sspec), Layout(shape, dmesh, dspec)
    if source == "builder":
        fwd = build_tasks(sl, dl, HOSTS, strategy)
        bwd = build_tasks(dl, sl, HOSTS, strategy)
    groups = []
    host = {d: h for h, ds in enumerate(HOSTS) for d in ds}
    for t in fwd + bwd:
        cand = [sorted({t["sender"], *t["receivers"]})]
        if strategy == "global_allgather":
            cand.append(sorted(t["receivers"]))
        if strategy == "local_allgather":
            per = {}
            for r in t["receivers"]:
                per.setdefault(host[r], []).append(r)
            cand += [sorted(v) for v in per.values()]
        for g in cand:
            if len(g) > 1 and g not in groups:
                groups.append(g)

    def stage(i, mesh):
        return {"index": i, "devices": mesh_devices(mesh), "mesh": mesh,
                "mesh_axes": ["m0", "m1"][:len(mesh_shape(mesh))]}

    plan = {
        "format": "planc/1", "name": f"{name}/{strategy}",
        "cluster": {"devices": 8, "hosts": HOSTS, "host_level": "node"},
        "groups": groups, "stage_mode": "explicit",
        "stages": [stage(0, smesh), stage(1, dmesh)],
        "transfers": [{"name": name, "dtype": dtype, "shape": list(shape),
                       "src": {"stage": 0, "spec": sspec}, "dst": {"stage": 1, "spec": dspec},
                       "strategy": strategy, "chunks": chunks, "tasks": fwd,
                       "backward": {"strategy": strategy, "chunks": chunks, "tasks": bwd}}],
    }
    return plan, source


# ----------------------------------------------------------------- worker (runs in each rank)
def _global(shape, dtype, salt):
    import torch

    from planc.runtime.reshard import DTYPES
    n = 1
    for s in shape:
        n *= s
    x = torch.arange(n, dtype=torch.int64).reshape(shape) * (1 if salt == 0 else -3) + salt
    return x.to(DTYPES[dtype])


def reshard_worker(rank, world, payload):
    import torch

    from planc.runtime.dist_util import create_groups
    from planc.runtime.reshard import TransferExecutor
    checked = 0
    for plan, reorder in payload:
        groups = create_groups(plan)
        tr = plan["transfers"][0]
        shape = tuple(tr["shape"])
        for direction, salt in (("forward", 0), ("backward", 1000)):
            ex = TransferExecutor(tr, plan, groups, rank, direction=direction, index=0)
            ref = _global(shape, tr["dtype"], salt)
            mbs = [0, 1] if reorder else [0]
            if ex.my_src is not None:
                works, keep = [], []
                for mb in mbs:
                    shard = ref[tuple(slice(a, b) for a, b in ex.my_src)].clone() + mb
                    keep.append(shard)
                    works += ex.send(shard, micro_batch=mb)
                for w in works:
                    w.wait()
            if ex.my_dst is not None:
                for mb in reversed(mbs):  # receive out of order: tags keep micro-batches apart
                    got = ex.recv(micro_batch=mb)
                    want = ref[tuple(slice(a, b) for a, b in ex.my_dst)] + mb
                    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
                    if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                        raise AssertionError(f"{plan['name']} {direction} mb{mb}: rank {rank} region "
                                             f"{ex.my_dst} differs from the reference")
                    checked += 1
    return checked


# ----------------------------------------------------------------- pure tests
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plans_cover_every_region(case, strategy):
    """The plans fed to the executor are valid (receivers covered exactly, senders hold)."""
    plan, _ = make_plan(case, strategy)
    _, shape, _, smesh, sspec, dmesh, dspec = case
    for tasks, sl, dl in ((plan["transfers"][0]["tasks"], Layout(shape, smesh, sspec), Layout(shape, dmesh, dspec)),
                          (plan["transfers"][0]["backward"]["tasks"], Layout(shape, dmesh, dspec),
                           Layout(shape, smesh, sspec))):
        for d in dl.devices:
            mine = [tuple(map(tuple, t["slice"])) for t in tasks if d in t["receivers"]]
            assert sum(numel(s) for s in mine) == numel(dl.region(d))
            for i, a in enumerate(mine):
                assert intersect(a, dl.region(d)) == a
                assert all(intersect(a, b) is None for b in mine[i + 1:])
        for t in tasks:
            s = tuple(map(tuple, t["slice"]))
            assert intersect(s, sl.region(t["sender"])) == s


def test_tags_distinct():
    tags = {tag_for(i, d, mb, t) for i in range(4) for d in ("forward", "backward")
            for mb in range(8) for t in range(50)}
    assert len(tags) == 4 * 2 * 8 * 50 and max(tags) < 2 ** 31


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_case_runs_the_compilers_plan(strategy):
    for case in CASES:
        _, source = make_plan(case, strategy)
        assert source == "planner"


# ----------------------------------------------------------------- multi-process
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reshard_gloo_bit_exact(strategy):
    payload = []
    for i, case in enumerate(CASES):
        plan, _ = make_plan(case, strategy)
        payload.append((plan, strategy in ("broadcast", "send_recv") and i % 3 == 0))
    out = H.run_ranks(reshard_worker, 8, payload)
    assert sum(int(v) for v in out.values()) > 0


def test_reshard_gloo_builder_plans():
    """The runtime's own fallback tasks (used when a transfer lacks `backward`)."""
    payload = [(make_plan(c, s, use_planner=False)[0], False)
               for c, s in zip(CASES[:4], STRATEGIES)]
    H.run_ranks(reshard_worker, 8, payload)


def test_missing_allgather_group_is_a_clear_error():
    from planc.runtime.dist_util import GroupMissing
    from planc.runtime.reshard import TransferExecutor
    plan, _ = make_plan(CASES[1], "global_allgather")
    with pytest.raises(GroupMissing, match="not in plan.json"):
        TransferExecutor(plan["transfers"][0], plan, {}, 4, backend="gloo")


def test_sender_must_hold_its_slice():
    from planc.runtime.plan import PlanError
    from planc.runtime.reshard import TransferExecutor
    plan, _ = make_plan(CASES[0], "send_recv")
    t = plan["transfers"][0]["tasks"][0]
    t["sender"] = 3 if t["sender"] != 3 else 0   # a device of the other half of dim 0
    with pytest.raises(PlanError, match="does not hold slice"):
        TransferExecutor(plan["transfers"][0], plan, {}, t["sender"], backend="gloo")
