"""In-host collectives through shared memory (planc/runtime/shmcoll.py), run on real gloo ranks.

Each collective is checked against its definition computed here from every member's input
(integer-valued floats, so sums are exact), over regions several windows long (a tiny slot),
and the reduction executor is checked to give exactly the flat allreduce result with its in-host
steps on shared memory, to keep cross-host groups off it, and to fall back to gloo when the
members share no memory.
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402
from test_runtime_reduce import hier, programs, reduction  # noqa: E402


def _contrib(d, n, dtype):
    import torch
    return ((torch.arange(n, dtype=torch.float64) * (d + 3)) % 61 - d).to(dtype)


def collectives_worker(rank, world, payload):
    import torch.distributed as dist

    os.environ["PLANC_SHM_DIR"] = payload["dir"]
    checked = 0
    every_rank = tuple(range(world))
    pg_all = dist.new_group(ranks=list(every_rank))
    pg_two = dist.new_group(ranks=[0, 1])               # collective on every rank; used by 0 and 1
    for members, pg in ((every_rank, pg_all), ((0, 1), pg_two)):
        if rank in members:
            checked += _check_collectives(rank, members, pg, payload)
    return checked


def _check_collectives(rank, members, pg, payload):
    import torch
    import torch.distributed as dist

    from planc.runtime.shmcoll import HostSegment
    world = len(members)
    seg, why = HostSegment.open(pg, members, rank, slot_bytes=payload["slot"])
    assert seg is not None and why == "", f"members on one machine must share the segment: {why}"
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for n, x, y in payload["regions"]:
            inputs = [_contrib(d, n, dtype) for d in members]
            me = members.index(rank)
            total = sum(v[x:y].double() for v in inputs).to(dtype)
            # allreduce
            buf = inputs[me].clone()
            seg.allreduce(buf, x, y)
            assert torch.equal(buf[x:y], total) and torch.equal(buf[:x], inputs[me][:x]) \
                and torch.equal(buf[y:], inputs[me][y:]), f"allreduce {dtype} {n} [{x},{y}) on {members}"
            # reduce_scatter: member r keeps piece r
            cuts = [x + (y - x) * j // world for j in range(world + 1)]
            p, q = cuts[me], cuts[me + 1]
            buf = inputs[me].clone()
            seg.reduce_scatter(buf, x, y, p, q)
            assert torch.equal(buf[p:q], total[p - x:q - x]), f"reduce_scatter {dtype} {n}"
            # all_gather of the pieces just reduced
            seg.all_gather(buf, x, y, p, q)
            assert torch.equal(buf[x:y], total), f"all_gather {dtype} {n}"
            # reduce to the first member
            buf = inputs[me].clone()
            seg.reduce(buf, x, y)
            if me == 0:
                assert torch.equal(buf[x:y], total), f"reduce {dtype} {n}"
            # broadcast from the first member
            buf = inputs[me].clone()
            seg.broadcast(buf, x, y)
            assert torch.equal(buf[x:y], inputs[0][x:y]), f"broadcast {dtype} {n}"
            checked += 1
    # random floats: every member ends with the same bits (one member forms each sum)
    g = torch.Generator().manual_seed(rank)
    buf = torch.randn(1001, generator=g)
    seg.allreduce(buf, 0, 1001)
    every = [torch.empty_like(buf) for _ in members]
    dist.all_gather(every, buf, group=pg)
    assert all(torch.equal(every[0], e) for e in every), "members disagree on an allreduce's bits"
    return checked


def test_shm_collectives_three_and_two_members_many_windows(tmp_path):
    # a 64-byte slot: 16 float32 / 8 float64 / 32 bf16 elements per window, so every region below
    # is cut into windows, some ending inside a member's piece
    regions = [(1, 0, 1), (7, 0, 7), (100, 0, 100), (203, 17, 190), (64, 5, 6)]
    H.run_ranks(collectives_worker, 3, {"dir": str(tmp_path), "slot": 64, "regions": regions})
    assert list(tmp_path.iterdir()) == [], "the segment's file is left behind"


def executor_worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    from planc.plan import At, Reduction
    from planc.runtime.reduce import ReductionExecutor
    per = payload["per"]
    results = []
    for run in payload["runs"]:            # each run: its own directories and switches per rank
        dirs, off = run["dirs"], run.get("off", ())
        os.environ["PLANC_SHM_DIR"] = dirs[rank % len(dirs)]
        for red, groups_list, n in payload["cases"]:
            groups = {}
            for g in groups_list:
                pg = dist.new_group(ranks=list(g))
                groups[tuple(g)] = pg if rank in g else None
            ex = ReductionExecutor(Reduction.read(At(red, "reduction")), groups, rank, host_of=lambda d: d // per, shared_memory=rank not in off,
                                   slot_bytes=payload["slot"])
            flat = _contrib(rank, n, torch.float32)
            grp = next(g for g in red["groups"] if rank in g)
            want = sum(_contrib(d, n, torch.float64) for d in grp).float()
            out = ex.run(flat)
            if not torch.equal(out, want):
                bad = (out != want).nonzero()[:5].flatten().tolist()
                raise AssertionError(f"{red['name']} n={n}: rank {rank} differs at {bad}")
            results.append((red["name"], [list(g) for g in ex.shm_groups], sorted(set(ex.shm_fallback.values()))))
    return results


def _cases(hosts, per, n):
    out = []
    _, _, every = hier(hosts, per)
    for name, steps in programs(hosts, per).items():
        red, groups = reduction(name, steps, every)
        out.append((red, groups, n))
    return out


def _outcomes(texts):
    """rank -> [(program, groups on shared memory, reasons for gloo)], one entry per run and program."""
    import ast
    return {r: ast.literal_eval(t.strip().splitlines()[-1]) for r, t in texts.items()}


def test_executor_puts_in_host_steps_on_shared_memory(tmp_path):
    texts = H.run_ranks(executor_worker, 8, {"per": 4, "slot": 256, "runs": [{"dirs": [str(tmp_path)]}],
                                            "cases": _cases(2, 4, 1003)})
    inside, _, _ = hier(2, 4)
    for rank, outcomes in _outcomes(texts).items():
        host_group = inside[rank // 4]
        for name, groups, why in outcomes:
            uses_inside = name != "allreduce"       # every other program has an in-host step
            assert groups == ([host_group] if uses_inside else []) and why == [], (rank, name, groups, why)
    assert list(tmp_path.iterdir()) == []


def test_executor_falls_back_to_gloo_and_every_member_agrees(tmp_path):
    """Three ways a one-host group keeps gloo, each with its reason on every member and exact sums:
    each rank looks in its own directory (the leader's nonce is not found); the directory is a
    file (the leader cannot create its segment); one member is built with shared_memory=False (the
    plan gives every rank the same, but the vote must hold without that: the others must not wait
    for it in the set-up)."""
    dirs = [str(tmp_path / f"r{i}") for i in range(4)]
    for d in dirs:
        os.makedirs(d)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    runs = [{"dirs": dirs}, {"dirs": [str(not_a_dir)]}, {"dirs": [str(tmp_path)], "off": (1,)}]
    cases = _cases(2, 2, 301)
    texts = H.run_ranks(executor_worker, 4, {"per": 2, "slot": 256, "runs": runs, "cases": cases})
    reasons = ["could not map the first member's file", "could not create and reserve", "turned off"]
    for rank, outcomes in _outcomes(texts).items():
        assert len(outcomes) == len(runs) * len(cases)
        for i, (name, groups, why) in enumerate(outcomes):
            if name == "allreduce":                 # no in-host step at all
                assert groups == [] and why == [], (rank, name, groups, why)
            elif i // len(cases) == 2 and rank in (2, 3):   # host 1's members all said yes
                assert groups == [[2, 3]] and why == [], (rank, name, groups, why)
            else:
                assert groups == [] and len(why) == 1 and reasons[i // len(cases)] in why[0], (rank, name, why)
    assert all(os.listdir(d) == [] for d in dirs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] + [f"r{i}" for i in range(4)]


def test_slot_size_is_the_plans_rounded_to_64_bytes():
    """plan.json runtime.shm_slot_bytes (train { shm_slot = SIZE }), not the environment: the executor
    passes it to every segment, which rounds it up to a multiple of 64 bytes."""
    import pytest

    from planc.plan import DEFAULT_SHM_SLOT_BYTES
    from planc.runtime import shmcoll
    assert shmcoll.slot_size(100) == 128 and shmcoll.slot_size(64) == 64 and shmcoll.slot_size(1) == 64
    assert shmcoll.slot_size() == shmcoll.slot_size(None) == DEFAULT_SHM_SLOT_BYTES == 8 << 20
    for bad in (0, -64):
        with pytest.raises(ValueError, match=re.escape(
                f"a shared-memory slot must be at least 1 byte (plan.json runtime.shm_slot_bytes), not {bad}")):
            shmcoll.slot_size(bad)


def test_the_executor_takes_the_slot_from_the_plan():
    """``ReductionExecutor.for_plan`` (the engine and --comm-only build it so) passes plan.json's
    runtime.shm_slot_bytes to every segment it opens, beside in_host and the bucket size."""
    from types import SimpleNamespace

    from planc.plan import InHost, Runtime
    from planc.runtime.reduce import ReductionExecutor

    class Built(ReductionExecutor):
        def __init__(self, *args, **kwargs):
            self.kwargs = kwargs

    runtime = Runtime(in_host=InHost.BACKEND, reduce_bucket_bytes=1 << 20, shm_slot_bytes=4096)
    plan = SimpleNamespace(runtime=runtime, cluster=SimpleNamespace(host_of=lambda d: d // 2))
    kw = Built.for_plan(plan, None, {}, 0).kwargs
    assert (kw["slot_bytes"], kw["shared_memory"], kw["bucket_bytes"]) == (4096, False, 1 << 20)
