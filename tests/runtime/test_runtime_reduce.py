"""Reduction executor: N-process gloo runs of typed programs.

Programs are written here on small hierarchies (2 hosts x 2 devices, 2 x 4); the compiler's
``planc.reduction.regions`` gives each step's regions (what plan.json carries), its independent
checker accepts them, and every rank's result must be exactly the sum, computed here, of every
member's input (integer-valued floats, so sums are exact).
"""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc.reduction.check import check_program  # noqa: E402
from planc.reduction.regions import RegionError, program_regions  # noqa: E402
from planc.reduction.semantics import SemanticsError  # noqa: E402
from planc.plan import At, PlanFileError, Reduction  # noqa: E402


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
    """The plan.json entry the compiler writes for ``steps`` (regions from planc.reduction.regions),
    and the groups it uses."""
    groups = []
    for _, gs in steps:
        for g in gs:
            if len(g) > 1 and g not in groups:
                groups.append(g)
    unit, regions = program_regions(steps, red_groups)
    return {"name": name, "axes": ["data"], "bytes": 0, "groups": red_groups,
            "program": {"text": name, "unit": unit, "predicted": 0.0,
                        "steps": [{"collective": c, "groups": gs, "regions": [list(r) for r in rs]}
                                  for (c, gs), rs in zip(steps, regions)]}}, groups


def record(red: dict) -> Reduction:
    return Reduction.read(At(red, "reductions[0]"))


# ----------------------------------------------------------------- pure
@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_programs_valid_and_their_regions_checked_independently(shape):
    for name, steps in programs(*shape).items():
        red, _ = reduction(name, steps, hier(*shape)[2])
        r = record(red)
        assert check_program(steps, red["groups"], unit=r.unit, regions=[s.regions for s in r.steps]) is None, name


def test_rs_rs_ag_ag_regions():
    """2 hosts x 2: quarters after the two reduce_scatters, one region per group of each step."""
    inside, across, every = hier(2, 2)
    red, _ = reduction("rs-rs-ag-ag", programs(2, 2)["rs-rs-ag-ag"], every)
    assert red["program"]["unit"] == 4
    assert [s["regions"] for s in red["program"]["steps"]] == [[[0, 4], [0, 4]], [[0, 2], [2, 4]],
                                                               [[0, 2], [2, 4]], [[0, 4], [0, 4]]]
    r = record(red)
    assert r.steps[1].slices(1, 1) == ((2, 4), (3, 4))     # across [1, 3]: member 1 keeps the last quarter
    assert r.steps[3].slices(0, 0) == ((0, 2), (0, 4))     # inside [0, 1]: member 0 brings the first half


def test_invalid_programs_rejected():
    inside, across, every = hier(2, 2)
    bad = [
        [("all_gather", inside)],                              # pieces not consecutive
        [("allreduce", inside), ("allreduce", every)],         # contributors overlap (Fig. 4 style)
        [("reduce", inside), ("allreduce", across)],           # members holding nothing
        [("broadcast", inside)],                               # others already hold
    ]
    for steps in bad:
        assert check_program(steps, every) is not None
        with pytest.raises((SemanticsError, RegionError)):
            program_regions(steps, every)


def test_regions_that_do_not_match_the_semantics_are_caught():
    """A plan whose regions were tampered with: the independent checker names the step; the reader
    refuses regions outside the buffer or that a reduce_scatter cannot split."""
    inside, across, every = hier(2, 2)
    steps = programs(2, 2)["rs-ar-ag"]
    red, _ = reduction("rs-ar-ag", steps, every)
    r = record(red)
    wrong = [list(s.regions) for s in r.steps]
    wrong[1] = [(1, 2), (0, 1)]                                # the across groups swapped
    assert "step 2 (allreduce)" in check_program(steps, every, unit=r.unit, regions=wrong)
    for regions, why in (([[0, 3], [0, 2]], "inside [0, 2]"), ([[0, 1], [0, 2]], "does not split into 2")):
        bad = {**red, "program": {**red["program"], "steps": [{**red["program"]["steps"][0], "regions": regions},
                                                              *red["program"]["steps"][1:]]}}
        with pytest.raises(PlanFileError, match=re.escape(why)):
            record(bad)


# ----------------------------------------------------------------- multi-process
def reduce_worker(rank, world, payload):
    import torch

    import torch.distributed as dist

    from planc.plan import At, Reduction
    from planc.runtime.reduce import ReductionExecutor
    done = 0
    for red, groups_list, n, bucket, impl in payload:
        groups = {}   # every group in the same order on every rank (dist.new_group is collective)
        for g in groups_list:
            pg = dist.new_group(ranks=list(g))
            groups[tuple(g)] = pg if rank in g else None
        ex = ReductionExecutor(Reduction.read(At(red, "reduction")), groups, rank, bucket_bytes=bucket, impl=impl)
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
