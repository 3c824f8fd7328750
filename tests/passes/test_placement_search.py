"""Placement ranking by branch and bound: the closed-form reduction costs, the lower bound, and the
pruned search against full enumeration costed by the reduction pass's own (group-lowering) model."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from planc import ir
from planc.placement import MAX_RANKED, place
from planc.placement.mapping import program_costs, reduction_factors, reduction_lower_bound
from planc.placement.matrices import enumerate_matrices
from planc.reduction import _matrix_costs, best_time

NAMES = ("a", "b", "c")


@st.composite
def layouts(draw, max_devices=16):
    """A cluster of 2-3 levels (some of fanout 1), 2-3 axes of the same device count, reductions."""
    n_levels = draw(st.integers(2, 3))
    primes = draw(st.lists(st.sampled_from([2, 2, 3]), min_size=1, max_size=4))
    while math.prod(primes) > max_devices:
        primes = primes[:-1]
    fanouts, sizes = [1] * n_levels, [1] * draw(st.integers(2, 3))
    for p in primes:
        fanouts[draw(st.integers(0, n_levels - 1))] *= p
        sizes[draw(st.integers(0, len(sizes) - 1))] *= p
    levels = tuple(ir.Level(f"l{j}", f, draw(st.sampled_from([1e9, 1e10, 5e10, 2e11])),
                            draw(st.sampled_from([0.0, 2e-6, 3e-5])))
                   for j, f in enumerate(fanouts))
    cluster = ir.Cluster(levels, "l0")
    axes = NAMES[:len(sizes)]
    n_red = draw(st.integers(1, 2))
    reductions = []
    for r in range(n_red):
        over = draw(st.lists(st.sampled_from(axes), min_size=1, max_size=2, unique=True))
        size = draw(st.sampled_from([1 << 10, 1 << 20, 1 << 26]))
        reductions.append(ir.Reduction(f"r{r}", tuple(over), dtype="u8", shape=(size,)))
    return cluster, tuple(sizes), tuple(reductions)


def _program(cluster, sizes, reductions, synthesis=ir.Synthesis()):
    par = ir.Parallel(tuple(ir.Axis(n, s) for n, s in zip(NAMES, sizes)), None)
    return ir.Program("t", "t.plan", "0" * 64, ".", cluster, par, ir.StageMode.PIPE_AXIS, (),
                      reductions=reductions, synthesis=synthesis)


def _reference(cluster, sizes, reductions, synthesis=ir.Synthesis()) -> dict:
    """Every matrix costed by planc.reduction.best_time, which lowers each program to device groups."""
    axes = NAMES[:len(sizes)]
    return {m: sum(best_time(cluster, m, axes, r.axes, math.prod(r.shape), synthesis) for r in reductions)
            for m in enumerate_matrices(cluster.fanouts, sizes)}


SMALL = ir.Synthesis(max_size=4)
FEW = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(layouts())
def test_closed_form_program_costs_equal_the_lowered_groups_model(case):
    cluster, sizes, reductions = case
    axes = NAMES[:len(sizes)]
    for m in enumerate_matrices(cluster.fanouts, sizes):
        for r in reductions:
            rows = tuple(sorted(axes.index(a) for a in r.axes))
            mine = program_costs(cluster, reduction_factors(m, rows), SMALL)
            theirs = _matrix_costs(cluster, m, axes, tuple(r.axes), SMALL)
            assert len(mine) == len(theirs)
            for (a, b), (x, y) in zip(mine, theirs):
                # the lowered model's a = (bandwidth + latency) - latency keeps only latency's ulps
                assert a == pytest.approx(x, rel=1e-8, abs=1e-18) and b == pytest.approx(y, rel=1e-12, abs=1e-300)


@FEW
@given(layouts())
def test_the_bound_never_exceeds_the_cost_of_any_completion(case):
    """Every matrix with a reduction's factors costs at least its bound, with every synthesized
    program (default max_size 5) costed on the lowered groups, not just the best."""
    cluster, sizes, reductions = case
    axes = NAMES[:len(sizes)]
    for m in enumerate_matrices(cluster.fanouts, sizes):
        for r in reductions:
            rows = tuple(sorted(axes.index(a) for a in r.axes))
            bound = reduction_lower_bound(cluster, reduction_factors(m, rows), math.prod(r.shape))
            coeffs = _matrix_costs(cluster, m, axes, tuple(r.axes), ir.Synthesis())
            worst_gap = min(a * math.prod(r.shape) + b for a, b in coeffs) - bound
            assert worst_gap >= -1e-12 * bound, (m, r.axes, bound)


@FEW
@given(layouts())
def test_pruned_search_returns_the_best_of_full_enumeration(case):
    cluster, sizes, reductions = case
    ref = _reference(cluster, sizes, reductions, SMALL)
    pl = place(_program(cluster, sizes, reductions, SMALL))
    best = min(ref.values())
    assert pl.ranked[0][1] == pytest.approx(best, rel=1e-8, abs=1e-18)
    assert ref[pl.matrix] == pytest.approx(best, rel=1e-8, abs=1e-18)
    # the ranked list is the reference's best MAX_RANKED costs (up to float rounding)
    want = sorted(ref.values())[:MAX_RANKED]
    assert [t for _, t in pl.ranked] == pytest.approx(want, rel=1e-8, abs=1e-18)
    assert pl.search in ("exhaustive", "branch_and_bound") and pl.evaluated <= pl.candidates == len(ref)
    assert (pl.search == "exhaustive") == (pl.evaluated == pl.candidates)


def test_4096_devices_prune_most_matrices_and_skip_the_deep_hierarchies():
    from benchmarks.bench.synthesis import CASES, program_for
    case = next(c for c in CASES if c.label == "4,096 devices")
    prog = program_for(case)
    pl = place(prog, {0: case.grad_bytes})
    assert pl.search == "branch_and_bound" and pl.evaluated < pl.candidates // 4
    # the prediction is what the reduction pass's group-lowering model gives for the winner
    red = prog.reductions[0]
    exact = best_time(prog.cluster, pl.matrix, prog.parallel.axis_names(), red.axes, case.grad_bytes)
    assert pl.ranked[0][1] == pytest.approx(exact, rel=1e-9)
    assert len(pl.ranked) == MAX_RANKED and [t for _, t in pl.ranked] == sorted(t for _, t in pl.ranked)
