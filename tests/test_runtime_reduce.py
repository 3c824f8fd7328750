"""Reduction executor: the semantics checker alone, then N-process gloo runs.

Programs are built here from DESIGN.md's collective semantics on small
hierarchies (2 hosts x 2 devices, 2 x 4); every valid one must give exactly
the flat allreduce result (integer-valued floats, so sums are exact).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc.runtime.reduce import ReductionError, simulate  # noqa: E402


def hier(hosts, per):
    """Groups on a hosts x per hierarchy: inside each host, across hosts (same local index), all."""
    inside = [list(range(h * per, (h + 1) * per)) for h in range(hosts)]
    across = [[h * per + i for h in range(hosts)] for i in range(per)]
    return inside, across, [list(range(hosts * per))]


def programs(hosts, per):
    inside, across, every = hier(hosts, per)
    return {
        "allreduce": [("allreduce", every)],
        "rs-ar-ag": [("reduce_scatter", inside), ("allreduce", across), ("all_gather", inside)],
        "reduce-ar-bcast": [("reduce", inside), ("allreduce", [[g[0] for g in inside]]), ("broadcast", inside)],
        "rs-rs-ag-ag": [("reduce_scatter", inside), ("reduce_scatter", across),
                        ("all_gather", across), ("all_gather", inside)],
        "rs-across-ar-inside-ag": [("reduce_scatter", across), ("allreduce", inside), ("all_gather", across)],
    }


def reduction(name, steps, red_groups):
    groups = []
    for _, gs in steps:
        for g in gs:
            if len(g) > 1 and g not in groups:
                groups.append(g)
    return {"name": name, "groups": red_groups,
            "program": {"text": name, "steps": [{"collective": c, "groups": gs} for c, gs in steps]}}, groups


# ----------------------------------------------------------------- pure
@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_programs_valid(shape):
    for name, steps in programs(*shape).items():
        n = shape[0] * shape[1]
        hist = simulate([{"collective": c, "groups": g} for c, g in steps], list(range(n)))
        for d in range(n):
            assert hist[d][-1] == (0, 1, frozenset(range(n))), name


def test_invalid_programs_rejected():
    inside, across, every = hier(2, 2)
    bad = [
        [("all_gather", inside)],                              # pieces not consecutive
        [("allreduce", inside), ("allreduce", every)],         # contributors overlap (Fig. 4 style)
        [("reduce", inside), ("allreduce", across)],           # members holding nothing
        [("broadcast", inside)],                               # others already hold
    ]
    for steps in bad:
        with pytest.raises(ReductionError):
            simulate([{"collective": c, "groups": g} for c, g in steps], list(range(4)))


def test_incomplete_program_rejected_at_construction():
    from planc.runtime.reduce import ReductionExecutor
    inside, _, every = hier(2, 2)
    red, _ = reduction("half", [("allreduce", inside)], every)
    with pytest.raises(ReductionError, match="leaves device"):
        ReductionExecutor(red, {tuple(g): None for g in inside}, 0)


# ----------------------------------------------------------------- multi-process
def reduce_worker(rank, world, payload):
    import torch

    import torch.distributed as dist

    from planc.runtime.reduce import ReductionExecutor
    done = 0
    for red, groups_list, n, bucket, impl in payload:
        groups = {}   # every group in the same order on every rank (dist.new_group is collective)
        for g in groups_list:
            pg = dist.new_group(ranks=list(g))
            groups[tuple(g)] = pg if rank in g else None
        ex = ReductionExecutor(red, groups, rank, bucket_bytes=bucket, impl=impl)
        base = torch.arange(n, dtype=torch.float32) % 97

        def contrib(d):
            return base * (d + 1) - d

        flat = contrib(rank).clone()
        out = ex.run(flat)
        grp = next((g for g in red["groups"] if rank in g), None)
        want = sum(contrib(d) for d in grp) if grp else contrib(rank)
        if not torch.equal(out, want):
            bad = (out != want).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{red['name']} n={n} bucket={bucket}: rank {rank} differs at {bad}")
        done += 1
    return done


def _payload(hosts, per, sizes, buckets, impls=(None,)):
    out = []
    inside, across, every = hier(hosts, per)
    for name, steps in programs(hosts, per).items():
        for n, b in zip(sizes, buckets):
            for impl in impls:
                red, groups = reduction(name, steps, every)
                out.append((red, groups, n, b, impl))
    return out


def test_reduce_gloo_2x2():
    H.run_ranks(reduce_worker, 4, _payload(2, 2, sizes=[37, 1000], buckets=[None, 64],
                                           impls=(None, {"reduce_scatter": "native"})))


def test_reduce_gloo_2x4():
    payload = _payload(2, 4, sizes=[203], buckets=[48])
    # reduction groups smaller than the world: a data axis of size 2 inside each host
    data = [[0, 2], [1, 3], [4, 6], [5, 7]]
    red, groups = reduction("data-allreduce", [("allreduce", data)], data)
    payload.append((red, groups, 50, None, None))
    red, groups = reduction("data-rs-ag", [("reduce_scatter", data), ("all_gather", data)], data)
    payload.append((red, groups, 51, 40, None))
    H.run_ranks(reduce_worker, 8, payload)
