"""The independent transfer checker's fast paths (planc/resharding/check.py) against the direct
definitions they replace: the lower bound counted per elementary cell and per host set equals the
device bit-mask count host by host, and the holders found through the corner index equal a scan of
every region. On random regions (tiled, replicated, overlapping, empty, scalar) and on planned plans."""

from __future__ import annotations

import itertools
import random

import pytest

from planc import ir
from planc.resharding import check


def _random_regions(rng: random.Random, shape, devices, tiles_only: bool):
    out = {}
    grids = [sorted({0, n, *rng.sample(range(n + 1), min(n + 1, rng.randint(0, 3)))}) for n in shape]
    for d in devices:
        box = []
        for n, g in zip(shape, grids):
            if tiles_only or rng.random() < 0.7:
                i = rng.randrange(len(g) - 1)
                box.append((g[i], g[i + 1]))
            else:   # any interval, possibly empty
                a, b = sorted(rng.sample(range(n + 1), 2)) if n > 0 else (0, 0)
                box.append((a, b))
        out[d] = box
    return out


def _case(seed: int):
    rng = random.Random(seed)
    shape = [rng.choice([1, 3, 4, 8]) for _ in range(rng.randint(0, 3))]
    per_host = rng.choice([1, 2, 4])
    hosts = [list(range(h * per_host, (h + 1) * per_host)) for h in range(rng.randint(1, 6))]
    devs = [d for h in hosts for d in h]
    rng.shuffle(devs)
    k = rng.randint(1, len(devs))
    src_devs = devs[:max(1, k // 2)]
    dst_devs = devs[max(1, k // 2):k] or devs[:1]     # sometimes the same device on both sides
    src = _random_regions(rng, shape, src_devs, rng.random() < 0.5)
    dst = _random_regions(rng, shape, dst_devs, rng.random() < 0.5)
    cluster = {"hosts": hosts, "host_level": "node", "levels": [{"name": "node", "bandwidth": 3e9}]}
    entry = {"shape": shape, "dtype": rng.choice(["f32", "bf16", "u8"])}
    return entry, src, dst, cluster


@pytest.mark.parametrize("seed", range(300))
def test_lower_bound_by_cells_equals_the_bit_mask_count(seed):
    entry, src, dst, cluster = _case(seed)
    assert check.recompute_lower_bound(entry, src, dst, cluster) == \
        check.recompute_lower_bound_masks(entry, src, dst, cluster)


def test_lower_bound_is_not_trivially_zero_in_these_cases():
    values = [check.recompute_lower_bound(*_case(seed)) for seed in range(300)]
    assert sum(v > 0 for v in values) > 100


@pytest.mark.parametrize("seed", range(100))
def test_holders_through_the_corner_index_equal_a_scan(seed):
    entry, src, _, _ = _case(seed)
    shape = entry["shape"]
    holding = check._Holding(src, shape)
    rng = random.Random(seed)
    boxes = [[(a, b) for a, b in box] for box in src.values()]
    for _ in range(30):   # sub-boxes of regions, and arbitrary boxes
        if boxes and rng.random() < 0.6:
            base = rng.choice(boxes)
            box = []
            for lo, hi in base:
                if hi <= lo:
                    break
                a = rng.randrange(lo, hi)
                box.append((a, rng.randint(a + 1, hi)))
            else:
                boxes.append(box)
            if len(box) != len(shape):
                continue
        else:
            box = []
            for n in shape:
                a = rng.randrange(n)
                box.append((a, rng.randint(a + 1, n)))
        scan = sorted(d for d, r in src.items() if check._inside(box, r))
        assert holding.of(box) == scan


def test_planned_transfers_check_clean_and_bounds_agree():
    """A planned plan's transfers (from the planner) check clean, and both lower bounds agree on them."""
    from planc.placement import place
    from planc.resharding import plan_transfers

    levels = (ir.Level("node", 4, 1.25e10, 2e-5), ir.Level("gpu", 4, 1.5e11, 2e-6))
    cl = ir.Cluster(levels, "node")
    par = ir.Parallel((ir.Axis("pipe", 2), ir.Axis("data", 4), ir.Axis("tensor", 2)), None)
    specs = [ir.ShardingSpec(((0,), (), ())), ir.ShardingSpec(((), (1,), ())), ir.ShardingSpec(((), (), ()))]
    for a, b in itertools.product(specs, repeat=2):
        tr = ir.Transfer("h", "f32", (8, 6, 4), 0, None, a, 1, b)
        prog = ir.Program("t", "t.plan", "0" * 64, ".", cl, par, ir.StageMode.PIPE_AXIS,
                          (ir.Stage(0, None), ir.Stage(1, None)), (tr,), train=ir.Train(micro_batches=2))
        layouts = place(prog).stages
        plans = plan_transfers(prog, layouts)
        plan = {"cluster": {"hosts": [list(range(h * 4, h * 4 + 4)) for h in range(4)], "host_level": "node",
                            "levels": [{"name": "node", "bandwidth": 1.25e10}, {"name": "gpu", "bandwidth": 1.5e11}]},
                "stages": [{"index": s.index, "devices": sorted(s.devices), "mesh": _lists(s.mesh())}
                           for s in layouts],
                "transfers": [p.to_json() for p in plans]}
        assert check.check_plan(plan) == []
        entry = plan["transfers"][0]
        stages = {s["index"]: s for s in plan["stages"]}
        src = check._regions(stages[0], entry["src"]["spec"], entry["shape"])
        dst = check._regions(stages[1], entry["dst"]["spec"], entry["shape"])
        assert check.recompute_lower_bound(entry, src, dst, plan["cluster"]) == \
            check.recompute_lower_bound_masks(entry, src, dst, plan["cluster"]) == entry["lower_bound"]


def _lists(x):
    return [_lists(y) for y in x] if isinstance(x, tuple) else x
