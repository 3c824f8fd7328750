"""In-host collectives through shared memory (planc/runtime/shmcoll.py), run on real gloo ranks.

Each collective is checked against its definition computed here from every member's input
(integer-valued floats, so sums are exact), over regions several windows long (a tiny slot),
and the reduction executor is checked to give exactly the flat allreduce result with its in-host
steps on shared memory, to keep cross-host groups off it, and to fall back to gloo when the
members share no memory.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402
from test_runtime_reduce import hier, programs, reduction  # noqa: E402


def _contrib(d, n, dtype):
    import torch
    return ((torch.arange(n, dtype=torch.float64) * (d + 3)) % 61 - d).to(dtype)


def collectives_worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    from planc.runtime.shmcoll import HostSegment
    os.environ["PLANC_SHM_DIR"] = payload["dir"]
    members = tuple(range(world))
    pg = dist.new_group(ranks=list(members))
    seg = HostSegment.open(pg, members, rank, slot_bytes=payload["slot"])
    assert seg is not None, "members on one machine must share the segment"
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for n, x, y in payload["regions"]:
            inputs = [_contrib(d, n, dtype) for d in members]
            total = sum(v[x:y].double() for v in inputs).to(dtype)
            # allreduce
            buf = inputs[rank].clone()
            seg.allreduce(buf, x, y)
            assert torch.equal(buf[x:y], total) and torch.equal(buf[:x], inputs[rank][:x]) \
                and torch.equal(buf[y:], inputs[rank][y:]), f"allreduce {dtype} {n} [{x},{y})"
            # reduce_scatter: member r keeps piece r
            cuts = [x + (y - x) * j // world for j in range(world + 1)]
            p, q = cuts[rank], cuts[rank + 1]
            buf = inputs[rank].clone()
            seg.reduce_scatter(buf, x, y, p, q)
            assert torch.equal(buf[p:q], total[p - x:q - x]), f"reduce_scatter {dtype} {n}"
            # all_gather of the pieces just reduced
            seg.all_gather(buf, x, y, p, q)
            assert torch.equal(buf[x:y], total), f"all_gather {dtype} {n}"
            # reduce to the first member
            buf = inputs[rank].clone()
            seg.reduce(buf, x, y)
            if rank == 0:
                assert torch.equal(buf[x:y], total), f"reduce {dtype} {n}"
            # broadcast from the first member
            buf = inputs[rank].clone()
            seg.broadcast(buf, x, y)
            assert torch.equal(buf[x:y], inputs[0][x:y]), f"broadcast {dtype} {n}"
            checked += 1
    # random floats: every member ends with the same bits (one member forms each sum)
    g = torch.Generator().manual_seed(rank)
    buf = torch.randn(1001, generator=g)
    seg.allreduce(buf, 0, 1001)
    every = [torch.empty_like(buf) for _ in members]
    dist.all_gather(every, buf)
    assert all(torch.equal(every[0], e) for e in every), "members disagree on an allreduce's bits"
    return checked


def test_shm_collectives_three_ranks_many_windows(tmp_path):
    # a 64-byte slot: 16 float32 / 8 float64 / 32 bf16 elements per window, so every region below
    # is cut into windows, some ending inside a member's piece
    regions = [(1, 0, 1), (7, 0, 7), (100, 0, 100), (203, 17, 190), (64, 5, 6)]
    H.run_ranks(collectives_worker, 3, {"dir": str(tmp_path), "slot": 64, "regions": regions})
    assert list(tmp_path.iterdir()) == [], "the segment's file is left behind"


def executor_worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    from planc.runtime.reduce import ReductionExecutor
    per = payload["per"]
    dirs = payload["dirs"]
    os.environ["PLANC_SHM_DIR"] = dirs[rank % len(dirs)]
    os.environ["PLANC_SHM_SLOT_BYTES"] = str(payload["slot"])
    results = []
    for red, groups_list, n in payload["cases"]:
        groups = {}
        for g in groups_list:
            pg = dist.new_group(ranks=list(g))
            groups[tuple(g)] = pg if rank in g else None
        ex = ReductionExecutor(red, groups, rank, host_of=lambda d: d // per)
        flat = _contrib(rank, n, torch.float32)
        grp = next(g for g in red["groups"] if rank in g)
        want = sum(_contrib(d, n, torch.float64) for d in grp).float()
        out = ex.run(flat)
        if not torch.equal(out, want):
            bad = (out != want).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{red['name']} n={n}: rank {rank} differs at {bad}")
        results.append((red["name"], [list(g) for g in ex.shm_groups]))
    return results


def _cases(hosts, per, n):
    out = []
    _, _, every = hier(hosts, per)
    for name, steps in programs(hosts, per).items():
        red, groups = reduction(name, steps, every)
        out.append((red, groups, n))
    return out


def _shm_groups(texts):
    import ast
    return {r: dict(ast.literal_eval(t.strip().splitlines()[-1])) for r, t in texts.items()}


def test_executor_puts_in_host_steps_on_shared_memory(tmp_path):
    texts = H.run_ranks(executor_worker, 8, {"per": 4, "dirs": [str(tmp_path)], "slot": 256,
                                            "cases": _cases(2, 4, 1003)})
    inside, _, _ = hier(2, 4)
    for rank, by_program in _shm_groups(texts).items():
        host_group = inside[rank // 4]
        for name, groups in by_program.items():
            uses_inside = name != "allreduce"       # every other program has an in-host step
            assert groups == ([host_group] if uses_inside else []), (rank, name, groups)
    assert list(tmp_path.iterdir()) == []


def test_executor_falls_back_to_gloo_when_members_share_no_memory(tmp_path):
    # each rank looks in its own directory: the leader's nonce is not found, every member agrees
    # on gloo, and the sums are still exact
    dirs = [str(tmp_path / f"r{i}") for i in range(4)]
    for d in dirs:
        os.makedirs(d)
    texts = H.run_ranks(executor_worker, 4, {"per": 2, "dirs": dirs, "slot": 256, "cases": _cases(2, 2, 301)})
    assert all(groups == [] for by in _shm_groups(texts).values() for groups in by.values())
    assert all(os.listdir(d) == [] for d in dirs)
