"""Placement synthesis: matrices, rank mapping, stage layouts, ranking."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from planc import ir
from planc.lang.errors import PlanError
from planc.placement import Placement, coords_for, place, stage_layouts
from planc.placement.matrices import (
    count_matrices, divisors, enumerate_matrices, is_matrix, matrix_problems,
)


# ---------------------------------------------------------------- helpers

def cluster(*levels: tuple[str, int, float]) -> ir.Cluster:
    return ir.Cluster(tuple(ir.Level(n, f, bw, 1e-6) for n, f, bw in levels), levels[0][0])


NODE_GPU = cluster(("node", 2, 1.25e10), ("gpu", 4, 1.5e11))


def program(cl: ir.Cluster, axes: dict[str, int] | None, *, matrix=None, stages=(), mode=ir.StageMode.PIPE_AXIS,
            reductions=(), transfers=(), micro_batches=4) -> ir.Program:
    par = None
    if axes is not None:
        par = ir.Parallel(tuple(ir.Axis(n, s) for n, s in axes.items()), matrix)
    return ir.Program("t", "t.plan", "0" * 64, ".", cl, par, mode, tuple(stages), tuple(transfers),
                      tuple(reductions), train=ir.Train(micro_batches=micro_batches))


def brute_force(fanouts, sizes):
    """Every matrix by trying every column product (independent of the DP)."""
    cols = []
    for h in fanouts:
        cols.append([c for c in itertools.product(divisors(h), repeat=len(sizes)) if math.prod(c) == h])
    out = set()
    for choice in itertools.product(*cols):
        rows = tuple(tuple(c[i] for c in choice) for i in range(len(sizes)))
        if all(math.prod(r) == p for r, p in zip(rows, sizes)):
            out.add(rows)
    return out


@st.composite
def hierarchy_and_axes(draw):
    primes = draw(st.lists(st.sampled_from([2, 2, 2, 3, 5]), min_size=0, max_size=5))
    n_levels = draw(st.integers(1, 4))
    n_axes = draw(st.integers(1, 3))
    fanouts, sizes = [1] * n_levels, [1] * n_axes
    for p in primes:
        fanouts[draw(st.integers(0, n_levels - 1))] *= p
        sizes[draw(st.integers(0, n_axes - 1))] *= p
    return tuple(fanouts), tuple(sizes)


# ---------------------------------------------------------------- matrices

@settings(max_examples=60, deadline=None)
@given(hierarchy_and_axes())
def test_count_equals_brute_force_enumeration(case):
    fanouts, sizes = case
    listed = list(enumerate_matrices(fanouts, sizes))
    assert len(listed) == len(set(listed)) == count_matrices(fanouts, sizes)
    assert set(listed) == brute_force(fanouts, sizes)
    for mx in listed:
        assert is_matrix(mx, fanouts, sizes)
        assert all(math.prod(r) == p for r, p in zip(mx, sizes))
        assert all(math.prod(r[j] for r in mx) == h for j, h in enumerate(fanouts))


def test_enumeration_is_deterministic_and_column_major_sorted():
    a = list(enumerate_matrices((2, 2, 4), (4, 4)))
    assert a == list(enumerate_matrices((2, 2, 4), (4, 4)))
    keys = [tuple(m[i][j] for j in range(3) for i in range(2)) for m in a]
    assert keys == sorted(keys)


def test_mismatched_products_have_no_matrix():
    assert count_matrices((2, 4), (3, 2)) == 0
    assert list(enumerate_matrices((2, 4), (3, 2))) == []


def test_p2_fig2_example_count():
    # H = [1, 2, 2, 4], P = [4, 4]: Fig. 2b, 2c and 2d are among them.
    listed = set(enumerate_matrices((1, 2, 2, 4), (4, 4)))
    assert ((1, 2, 2, 1), (1, 1, 1, 4)) in listed
    assert count_matrices((1, 2, 2, 4), (4, 4)) == len(listed)


def test_counting_4096_devices_five_levels_four_axes():
    # 3,772 was checked once against brute_force (400,000 column combinations; too slow for the suite).
    assert count_matrices((4, 4, 4, 8, 8), (16, 16, 4, 4)) == 3772
    assert count_matrices((16, 4, 4, 4, 4), (64, 8, 4, 2)) > 0
    first = next(enumerate_matrices((4, 4, 4, 8, 8), (16, 16, 4, 4)))
    assert is_matrix(first, (4, 4, 4, 8, 8), (16, 16, 4, 4))


def test_matrix_problems_name_the_row_and_column():
    probs = matrix_problems(((2, 2), (1, 2)), (2, 4), (4, 2))
    assert probs == []
    probs = matrix_problems(((2, 1), (1, 4)), (2, 4), (4, 2))
    assert any("row 0" in p for p in probs) and any("row 1" in p for p in probs)


# ---------------------------------------------------------------- mapping

def test_fig2b_rank_mapping():
    H = (1, 2, 2, 4)
    mx = ((1, 2, 2, 1), (1, 1, 1, 4))
    coords = coords_for(mx, H, (4, 4))
    for s, c, g in itertools.product(range(2), range(2), range(4)):
        d = (s * 2 + c) * 4 + g
        assert coords[d] == (2 * s + c, g)


@settings(max_examples=40, deadline=None)
@given(hierarchy_and_axes(), st.data())
def test_mapping_is_a_bijection(case, data):
    fanouts, sizes = case
    listed = list(enumerate_matrices(fanouts, sizes))
    mx = listed[data.draw(st.integers(0, len(listed) - 1))]
    coords = coords_for(mx, fanouts, sizes)
    assert len(coords) == math.prod(fanouts)
    assert set(coords) == set(itertools.product(*(range(p) for p in sizes)))


def test_axis_inside_level_groups_devices_of_one_unit():
    # data entirely on the gpu level: data-groups live inside one node.
    coords = coords_for(((1, 4), (2, 1)), (2, 4), (4, 2))
    assert [c[0] for c in coords[:4]] == [0, 1, 2, 3]
    assert {c[1] for c in coords[:4]} == {0} and {c[1] for c in coords[4:]} == {1}


# ---------------------------------------------------------------- stage layouts

def test_pipe_axis_stages_are_meshes_over_the_other_axes():
    stages = (ir.Stage(0, (0, 3)), ir.Stage(1, (3, 6)))
    prog = program(NODE_GPU, {"pipe": 2, "data": 2, "tensor": 2}, matrix=((2, 1), (1, 2), (1, 2)), stages=stages)
    pl = place(prog)
    assert [s.devices for s in pl.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert pl.stages[0].mesh() == ((0, 1), (2, 3))
    assert pl.stages[0].axes == ("data", "tensor") and pl.stages[0].shape == (2, 2)
    assert pl.stages[1].layers == (3, 6)


def test_stage_devices_are_ordered_by_mesh_coordinates_not_device_id():
    # tensor outermost (across nodes), pipe and data inside the node.
    prog = program(NODE_GPU, {"pipe": 2, "data": 2, "tensor": 2}, matrix=((1, 2), (1, 2), (2, 1)),
                   stages=(ir.Stage(0, None), ir.Stage(1, None)))
    pl = place(prog)
    for layout in pl.stages:
        for pos, d in enumerate(layout.devices):
            _, data, tensor = pl.coords[d]
            assert pos == data * 2 + tensor
            assert pl.coords[d][0] == layout.index
    assert pl.stages[0].devices == (0, 4, 1, 5)


def test_no_pipe_axis_gives_one_stage_on_all_devices():
    prog = program(NODE_GPU, {"data": 4, "model": 2}, matrix=((2, 2), (1, 2)))
    (st0,) = place(prog).stages
    assert st0.index == 0 and sorted(st0.devices) == list(range(8))
    assert st0.axes == ("data", "model") and st0.shape == (4, 2)


def test_explicit_stages_without_parallel():
    stages = (ir.Stage(0, (0, 2), 0, (2, 2), ("data", "tensor")), ir.Stage(1, (2, 4), 4, (1, 4)))
    prog = program(NODE_GPU, None, stages=stages, mode=ir.StageMode.EXPLICIT)
    pl = place(prog)
    assert pl.matrix is None and pl.to_json() is None and pl.coords == ()
    assert pl.stages[0].mesh() == ((0, 1), (2, 3)) and pl.stages[0].axes == ("data", "tensor")
    assert pl.stages[1].mesh() == ((4, 5, 6, 7),) and pl.stages[1].axes == ("m0", "m1")


def test_explicit_stages_with_parallel_decide_no_matrix():
    """Explicit meshes fix every device's role; a matrix would only contradict them."""
    stages = (ir.Stage(0, None, 0, (2, 2), ("data", "tensor")), ir.Stage(1, None, 4, (2, 2), ("data", "tensor")))
    prog = program(NODE_GPU, {"data": 4, "tensor": 2}, matrix=((2, 2), (1, 2)), stages=stages,
                   mode=ir.StageMode.EXPLICIT)
    pl = place(prog)
    assert pl.matrix is None and pl.to_json() is None and pl.coords == ()
    assert [s.devices for s in pl.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_stage_layouts_helper_matches_place():
    prog = program(NODE_GPU, {"pipe": 2, "data": 4}, matrix=((2, 1), (1, 4)), stages=(ir.Stage(0, None), ir.Stage(1, None)))
    pl = place(prog)
    assert stage_layouts(prog, pl.coords) == pl.stages


# ---------------------------------------------------------------- place / ranking

def test_pinned_matrix_is_used_and_ranked_alone():
    mx = ((2, 2), (1, 2))
    prog = program(NODE_GPU, {"data": 4, "model": 2}, matrix=mx,
                   reductions=(ir.Reduction("gradients", ("data",)),))
    pl = place(prog, {0: 4 << 20})
    assert pl.matrix == mx and len(pl.ranked) == 1 and pl.ranked[0][0] == mx
    assert pl.candidates == count_matrices((2, 4), (4, 2))
    js = pl.to_json()
    assert js["matrix"] == [[2, 2], [1, 2]] and js["axes"] == [{"name": "data", "size": 4}, {"name": "model", "size": 2}]
    assert js["ranked"][0]["matrix"] == [[2, 2], [1, 2]] and js["coords"] == [list(c) for c in pl.coords]


def test_invalid_pinned_matrix_is_a_plan_error():
    prog = program(NODE_GPU, {"data": 4, "model": 2}, matrix=((2, 1), (1, 4)))
    with pytest.raises(PlanError, match="row 0"):
        place(prog)


def test_auto_keeps_the_reduction_axis_inside_the_node():
    prog = program(NODE_GPU, {"data": 4, "model": 2}, reductions=(ir.Reduction("gradients", ("data",)),))
    pl = place(prog, {0: 64 << 20})
    assert pl.search == "exhaustive" and pl.candidates == len(list(enumerate_matrices((2, 4), (4, 2))))
    assert pl.matrix == ((1, 4), (2, 1))
    assert 1 <= len(pl.ranked) <= 10
    times = [t for _, t in pl.ranked]
    assert times == sorted(times) and times[0] < times[-1]


def test_auto_reducing_over_model_moves_model_inside():
    prog = program(NODE_GPU, {"data": 4, "model": 2}, reductions=(ir.Reduction("gradients", ("model",)),))
    pl = place(prog)
    assert pl.matrix[1] == (1, 2)


def test_ranking_is_deterministic_on_ties():
    prog = program(NODE_GPU, {"data": 4, "model": 2})  # nothing to communicate: all tie at 0
    pl = place(prog)
    assert all(t == 0 for _, t in pl.ranked)
    assert pl.matrix == min(enumerate_matrices((2, 4), (4, 2)))
    assert place(prog) == pl


def test_heavy_transfer_keeps_the_pipe_axis_inside_the_node():
    # pipe x data on 2 nodes x 4 with no reduction: the transfers decide.
    tr = ir.Transfer("h", "f32", (1024, 1024), 0, None, ir.ShardingSpec(((), ())), 1, ir.ShardingSpec(((), ())))
    prog = program(NODE_GPU, {"pipe": 2, "data": 4}, stages=(ir.Stage(0, None), ir.Stage(1, None)), transfers=(tr,))
    pl = place(prog)
    assert pl.matrix[0] == (1, 2)  # pipe inside the node: transfers stay on fast links


def test_branch_and_bound_prunes_and_keeps_the_best():
    cl = cluster(("rack", 2, 1e9), ("node", 2, 1e10), ("cpu", 2, 5e10), ("gpu", 4, 1e11))
    prog = program(cl, {"data": 4, "model": 4, "extra": 2}, reductions=(ir.Reduction("gradients", ("model",)),))
    pl = place(prog)
    assert pl.search == "branch_and_bound" and pl.evaluated < pl.candidates
    assert pl.matrix[1][3] == 4  # model entirely on the gpu level
    # the ranked best equals the best of every matrix costed by the reduction pass's own model
    from planc.reduction import best_time
    every = min(best_time(cl, m, ("data", "model", "extra"), ("model",), 1 << 20)
                for m in enumerate_matrices(cl.fanouts, (4, 4, 2)))
    assert pl.ranked[0][1] == pytest.approx(every, rel=1e-8)


def test_placement_is_frozen():
    pl = place(program(NODE_GPU, {"data": 8}))
    assert isinstance(pl, Placement)
    with pytest.raises(AttributeError):
        pl.matrix = None  # type: ignore[misc]
