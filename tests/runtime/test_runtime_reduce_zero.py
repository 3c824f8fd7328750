"""ZeRO-1's reduction programs executed: N-process gloo runs of compiled plans with ``zero = 1``.

A plan of 2 hosts x 2 devices with a data axis of 4 is compiled with ``train { zero = 1 }`` (set on the
checked program: the front end's ``zero`` setting is not relied on here) and a reduce bucket of 64 bytes,
so buffers that are not a multiple of the unit span several buckets. Every rank builds the executors the
way the runtime does (``ReductionExecutor.for_plan``) and checks, against sums the test computes from
every member's input:

* after the gradients' reduce-scatter, each of the rank's ``owned_slices(n)`` holds exactly the sum, and
  the members' slices (gathered from every rank) partition ``[0, n)``;
* the parameters' all-gather, started from a buffer holding the values only in those slices (garbage
  elsewhere), leaves every rank the whole buffer — also in bf16, whose chunking must give the same slices.

Run with the shared-memory in-host path (the default) and with ``in_host = backend``, and with
``using allreduce`` (the flat reduce_scatter and all_gather).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc import plan as planfile  # noqa: E402
from planc.driver.compile import compile_program  # noqa: E402
from planc.lang import load_text  # noqa: E402

from test_reduction_zero import TWO_BY_TWO as PLAN  # noqa: E402  (the same 2 x 2 plan, zero = 1 set by the test)

SIZES = (37, 16, 45)      # elements: not a multiple of the unit, one bucket exactly, several buckets


def compiled(using: str = "", in_host: str = "shared_memory", bucket: int = 64) -> dict:
    """plan.json of the test plan with zero = 1 (and the runtime's bucket and in-host path)."""
    program = load_text(PLAN.format(using=using), os.path.join(H.ROOT, "plans", "zero-test.plan"))
    runtime = dataclasses.replace(program.train.runtime, reduce_bucket_bytes=bucket,
                                  in_host=planfile.InHost(in_host))
    program = dataclasses.replace(program, train=dataclasses.replace(program.train, zero=1, runtime=runtime))
    return compile_program(program, None, verify=True).plan_json


def zero_worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    from planc.plan import Collective, Plan
    from planc.runtime.reduce import ReductionExecutor

    checked = 0
    for doc in payload:
        plan = Plan.from_json(doc)
        groups = {}    # the plan's groups, created in its order on every rank (dist.new_group is collective)
        for g in plan.groups:
            pg = dist.new_group(ranks=list(g))
            groups[tuple(g)] = pg if rank in g else None
        rs_red = next(r for r in plan.reductions if r.target is Collective.REDUCE_SCATTER)
        ag_red = next(r for r in plan.reductions if r.target is Collective.ALL_GATHER)
        rs = ReductionExecutor.for_plan(plan, rs_red, groups, rank)
        ag = ReductionExecutor.for_plan(plan, ag_red, groups, rank)
        group = next(g for g in rs_red.groups if rank in g)
        for n in SIZES:
            base = torch.arange(n, dtype=torch.float32) % 97

            def contrib(d):
                return base * (d + 1) - d

            want = sum(contrib(d) for d in group)
            slices = rs.owned_slices(n)
            if ag.owned_slices(n) != slices:
                raise AssertionError(f"n={n}: the all-gather's slices {ag.owned_slices(n)} are not the "
                                     f"reduce-scatter's {slices}")
            every = [None] * world
            dist.all_gather_object(every, slices)
            cover = sorted(x for r in group for x in every[r])
            if [a for a, _ in cover] != [0] + [b for _, b in cover[:-1]] or cover[-1][1] != n:
                raise AssertionError(f"n={n}: the members' owned slices {cover} do not partition [0, {n})")
            out = rs.run(contrib(rank).clone())
            for a, b in slices:
                if not torch.equal(out[a:b], want[a:b]):
                    bad = (out[a:b] != want[a:b]).nonzero().flatten()[:5] + a
                    raise AssertionError(f"n={n}: rank {rank}'s reduce-scatter differs at {bad.tolist()} in {(a, b)}")
            for dtype in (torch.float32, torch.bfloat16):
                full = (want if dtype is torch.float32 else base % 13 - 6).to(dtype)
                start = torch.full((n,), -12345.0 - rank, dtype=dtype)   # garbage outside the owned slices
                for a, b in slices:
                    start[a:b] = full[a:b]
                got = ag.run(start)
                if not torch.equal(got, full):
                    bad = (got != full).nonzero().flatten()[:5]
                    raise AssertionError(f"n={n} {dtype}: rank {rank}'s all-gather differs at {bad.tolist()}")
            checked += 1
        if rs.shm_groups != ag.shm_groups:
            raise AssertionError(f"in-host groups differ: {rs.shm_groups} vs {ag.shm_groups}")
        checked += 100 * len(rs.shm_groups)
    return checked


def test_zero_plan_is_hierarchical_and_permutes_the_pieces():
    """What the gloo run executes: on 2 slow hosts the reduce-scatter is in-host then across, so the
    pieces are permuted (device 1 owns the third quarter), and the all-gather mirrors it. (Compiled
    without a probe the sizes are 0: the two hierarchical orders tie on latency and the ranking's tie
    rule, shorter then by text, picks in-host first.)"""
    doc = compiled()
    rs, ag = doc["reductions"]
    assert (rs["name"], rs["target"], ag["name"], ag["target"]) == ("gradients", "reduce_scatter",
                                                                    "parameters", "all_gather")
    assert rs["program"]["text"] == ("reduce_scatter(slice=node, form=inside); "
                                     "reduce_scatter(slice=node, form=parallel(root))")
    assert ag["program"]["text"] == ("all_gather(slice=node, form=parallel(root)); "
                                     "all_gather(slice=node, form=inside)")
    assert rs["program"]["unit"] == ag["program"]["unit"] == 4
    assert rs["owned"] == ag["owned"] == [[[0, 1], [2, 3], [1, 2], [3, 4]]]
    assert doc["runtime"]["reduce_bucket_bytes"] == 64


@pytest.mark.parametrize("in_host", ["shared_memory", "backend"])
def test_zero_reduce_scatter_then_all_gather_gloo(in_host):
    done = H.run_ranks(zero_worker, 4, [compiled(in_host=in_host)])
    shm = 100 if in_host == "shared_memory" else 0      # one in-host group per rank goes through /dev/shm
    assert all(int(v) == len(SIZES) + shm for v in done.values()), done


def test_zero_using_allreduce_runs_the_flat_pair_gloo():
    doc = compiled(using=" using allreduce", bucket=48)
    rs, ag = doc["reductions"]
    assert (rs["program"]["text"], ag["program"]["text"]) == ("reduce_scatter(slice=root, form=inside)",
                                                              "all_gather(slice=root, form=inside)")
    assert rs["owned"] == [[[0, 1], [1, 2], [2, 3], [3, 4]]]
    done = H.run_ranks(zero_worker, 4, [doc])
    assert all(int(v) == len(SIZES) for v in done.values()), done
