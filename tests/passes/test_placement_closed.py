"""Placement ranking's closed forms (planc/placement/closed.py) against the device walk they replace:
the same floats, bit for bit, on every matrix of small clusters; and the linear helpers of the
mapping (coordinates, stage meshes) against direct definitions."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from planc import ir
from planc.cost import Network, step_coefficients
from planc.placement import _Costing, coords_for, place, stage_layouts
from planc.placement import closed
from planc.placement.matrices import count_matrices, enumerate_matrices
from planc.reduction import stage_reduction_groups

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def programs(draw):
    """A 2-3 level cluster (some fanout 1, sizes with 2s and 3s), axes pipe x data x tensor (and
    sometimes another), declared stages or none, transfers between stages, tensor traffic per stage."""
    n_levels = draw(st.integers(2, 3))
    primes = draw(st.lists(st.sampled_from([2, 2, 3]), min_size=2, max_size=5))
    fanouts = [1] * n_levels
    names = ["pipe", "data", "tensor"] + (["x"] if draw(st.booleans()) else [])
    if draw(st.booleans()):
        names.remove("tensor")
    sizes = dict.fromkeys(names, 1)
    sizes["pipe"] = 2
    fanouts[draw(st.integers(0, n_levels - 1))] *= 2
    for p in primes:
        fanouts[draw(st.integers(0, n_levels - 1))] *= p
        sizes[draw(st.sampled_from(names))] *= p
    levels = tuple(ir.Level(f"l{j}", f, draw(st.sampled_from([1e9, 3e9, 1.25e10, 1.5e11])),
                            draw(st.sampled_from([0.0, 2e-6, 3e-5])))
                   for j, f in enumerate(fanouts))
    cl = ir.Cluster(levels, "l0")
    par = ir.Parallel(tuple(ir.Axis(n, s) for n, s in sizes.items()), None)
    pipe = sizes["pipe"]
    declared = draw(st.sampled_from(["all", "none", "some"]))
    if declared == "all":
        stages = tuple(ir.Stage(i, None) for i in range(pipe))
    elif declared == "some":
        stages = tuple(ir.Stage(i, None) for i in sorted(draw(st.sets(st.integers(0, pipe - 1), min_size=2))))
    else:
        stages = ()
    mesh_dims = len(names) - 1
    transfers = []
    for k in range(draw(st.integers(0, 3))):
        src, dst = draw(st.lists(st.integers(0, pipe - 1), min_size=2, max_size=2, unique=True))
        shape = tuple(draw(st.lists(st.sampled_from([1, 3, 12, 35, 64]), min_size=1, max_size=2)))
        specs = []
        for _ in range(2):
            free = list(range(mesh_dims))
            dims = []
            for _ in shape:
                use = draw(st.lists(st.sampled_from(free), max_size=1, unique=True)) if free else []
                free = [a for a in free if a not in use]
                dims.append(tuple(use))
            specs.append(ir.ShardingSpec(tuple(dims)))
        transfers.append(ir.Transfer(f"t{k}", draw(st.sampled_from(["f32", "bf16"])), shape, src, None, specs[0],
                                     dst, specs[1]))
    traffic = {}
    present = [x.index for x in stages] or list(range(pipe))
    keys = draw(st.sets(st.sampled_from(present), max_size=2))
    if keys and len(present) < pipe and draw(st.booleans()):   # and one stage the plan does not lay out
        keys |= {min(set(range(pipe)) - set(present))}
    for s in keys:
        fwd = tuple(draw(st.lists(st.sampled_from([0, 4096, 3000, 1 << 20]), min_size=1, max_size=2)))
        traffic[s] = (fwd, tuple(draw(st.lists(st.sampled_from([4096, 7777]), max_size=2))))
    prog = ir.Program("t", "t.plan", "0" * 64, ".", cl, par, ir.StageMode.PIPE_AXIS, stages, tuple(transfers),
                      train=ir.Train(micro_batches=draw(st.sampled_from([1, 3, 4]))))
    return prog, traffic


@FEW
@given(programs())
def test_closed_costs_equal_the_device_walk_on_every_matrix(case):
    prog, traffic = case
    fast = _Costing(prog, None, tensor_traffic=traffic, method="closed")
    slow = _Costing(prog, None, tensor_traffic=traffic, method="devices")
    fanouts, sizes = prog.cluster.fanouts, tuple(a.size for a in prog.parallel.axes)
    for mx in enumerate_matrices(fanouts, sizes):
        assert fast(mx) == slow(mx), mx
        assert fast.parts[mx] == slow.parts[mx], mx


@FEW
@given(programs())
def test_place_is_the_same_either_way(case):
    prog, traffic = case
    assert place(prog, tensor_traffic=traffic) == place(prog, tensor_traffic=traffic, method="devices")


BIG = (4, 12, 4)


def _big_case():
    """Rack x pod x node x gpu with a level of 3: regions whose bytes are not dyadic, so a link's load
    (added flow by flow) is not ``count * region`` in floating point."""
    cl = ir.Cluster((ir.Level("rack", 2, 1e9, 1e-4), ir.Level("pod", 3, 2.5e9, 5e-5),
                     ir.Level("node", 4, 1.25e10, 2e-5), ir.Level("gpu", 8, 1.5e11, 2e-6)), "node")
    par = ir.Parallel(tuple(ir.Axis(n, s) for n, s in zip(("pipe", "data", "tensor"), BIG)), None)
    spec = ir.ShardingSpec(((0,), ()))
    transfers = tuple(ir.Transfer(f"h{i}", "f32", (35, 13), i, None, spec, i + 1, ir.ShardingSpec(((0,), (1,))))
                      for i in range(3))
    prog = ir.Program("t", "t.plan", "0" * 64, ".", cl, par, ir.StageMode.PIPE_AXIS,
                      tuple(ir.Stage(i, None) for i in range(4)), transfers, train=ir.Train(micro_batches=5))
    return prog, {0: ((4096, 3001), (7777,)), 2: ((1 << 20,), ())}


def test_closed_costs_on_a_four_level_cluster():
    prog, traffic = _big_case()
    fast = _Costing(prog, None, tensor_traffic=traffic, method="closed")
    slow = _Costing(prog, None, tensor_traffic=traffic, method="devices")
    seen = 0
    for mx in enumerate_matrices(prog.cluster.fanouts, BIG):
        assert fast(mx) == slow(mx) and fast.parts[mx] == slow.parts[mx], mx
        seen += 1
    assert seen == count_matrices(prog.cluster.fanouts, BIG) > 10
    assert place(prog, tensor_traffic=traffic) == place(prog, tensor_traffic=traffic, method="devices")


def test_repeated_sum_is_the_left_to_right_sum():
    x = 28 / 3
    total = 0.0
    for n in range(200):
        assert closed.repeated_sum(x, n) == total
        total += x
    assert any(closed.repeated_sum(0.1, n) != n * 0.1 for n in range(100))   # the point of it


def test_tensor_coefficients_equal_step_coefficients_on_the_groups():
    prog, _ = _big_case()
    net = Network(prog.cluster)
    for mx in enumerate_matrices(prog.cluster.fanouts, BIG):
        for st_ in stage_layouts(prog, coords_for(mx, prog.cluster.fanouts, BIG)):
            groups = tuple(g for g in stage_reduction_groups((st_,), ("tensor",)) if len(g) > 1)
            assert closed.tensor_coefficients(net, mx, (0,), 2) == step_coefficients(net, "allreduce", groups)


def test_unknown_method_is_refused():
    prog, _ = _big_case()
    with pytest.raises(ValueError, match="unknown costing method"):
        place(prog, method="fast")


# ---------------------------------------------------------------- the mapping's linear helpers

def _coords_by_definition(matrix, fanouts, sizes):
    """DESIGN.md's rank mapping, device by device: split each level coordinate into the column's
    digits (axis 0 most significant), read each axis's digits outermost level first."""
    out = []
    for d in range(math.prod(fanouts)):
        c = ir.level_coords(d, fanouts)
        digits = [ir.level_coords(c[j], [row[j] for row in matrix]) for j in range(len(fanouts))]
        out.append(tuple(sum(digits[j][i] * math.prod(matrix[i][j + 1:]) for j in range(len(fanouts)))
                         for i in range(len(sizes))))
    return tuple(out)


@pytest.mark.parametrize("fanouts,sizes", [((2, 4), (4, 2)), ((3, 4, 4), (4, 3, 4)), ((1, 6, 2), (2, 3, 2)),
                                           ((2, 2, 2), (8,))])
def test_coords_for_is_the_rank_mapping(fanouts, sizes):
    for mx in enumerate_matrices(fanouts, sizes):
        assert coords_for(mx, fanouts, sizes) == _coords_by_definition(mx, fanouts, sizes)


def test_stage_layouts_are_the_pipe_coordinates_ordered_by_the_rest():
    prog, _ = _big_case()
    sizes = BIG
    for mx in itertools.islice(enumerate_matrices(prog.cluster.fanouts, sizes), 0, None, 7):
        coords = coords_for(mx, prog.cluster.fanouts, sizes)
        for lay in stage_layouts(prog, coords):
            members = sorted((d for d, c in enumerate(coords) if c[0] == lay.index), key=lambda d: coords[d][1:])
            assert lay.devices == tuple(members) and lay.shape == BIG[1:] and lay.axes == ("data", "tensor")
