"""Synthesis depends on the hierarchy's shape only, and its fast paths agree with the plain ones.

* every program synthesized on the abstract hierarchy of some factors is valid, by the independent
  checker, on real layouts of that shape: a cluster and parallelism matrix with many reduction groups
  (the per-member path the verify pass takes for the chosen program), for allreduce, reduce-scatter
  and the all-gathers from each reduce-scatter's pieces;
* ``synthesize.disagreement`` (the checker replay that left the compile path) accepts the synthesizer's
  output and names a program the checker rejects;
* reduce-scatter synthesis equals brute force (every instruction sequence, the checker deciding);
* a program's regions computed once per reduction-group shape and mapped (``regions.program_regions``)
  equal running every device (``regions._whole``), and a failure still names its devices;
* the synthesizer's shared group sum (``semantics.group_sum`` + ``semantics.summed``) equals
  ``semantics.apply`` per collective, and the integer cut equals cutting with Fractions.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

from hypothesis import given, settings, strategies as st

from planc import ir
from planc.reduction import check, regions, semantics
from planc.reduction.hierarchy import Hierarchy, matrix_positions
from planc.reduction.lower import distinct_instructions, lower_program
from planc.reduction.synthesize import (canonical_assignment, disagreement, synthesize, synthesize_all_gather,
                                        synthesize_reduce_scatter)

C = ir.Collective
FACTORS = st.lists(st.integers(2, 4), min_size=1, max_size=3).filter(lambda f: math.prod(f) <= 16)


def _cluster_and_matrix(factors, rnd):
    """A cluster with one level per factor, each level's fanout the factor times a random other
    factor, and the matrix putting the reduction axis ``data`` on exactly ``factors``."""
    other = [rnd.choice((1, 2, 3)) for _ in factors]
    levels = tuple(ir.Level(f"l{i}", f * o, 1e9 * (i + 1), 1e-6) for i, (f, o) in enumerate(zip(factors, other)))
    cluster = ir.Cluster((ir.Level("top", 1, None),) + levels, "l0")
    matrix = ((1,) + tuple(other), (1,) + tuple(factors))    # rows: axes "rest", "data"
    return cluster, matrix


@settings(max_examples=20, deadline=None)
@given(FACTORS, st.integers(1, 4), st.integers(0, 10 ** 6))
def test_abstract_programs_are_valid_on_every_real_group_of_that_shape(factors, max_size, seed):
    cluster, matrix = _cluster_and_matrix(factors, random.Random(seed))
    hier, positions = matrix_positions(cluster, matrix, ("rest", "data"), ("data",))
    assert hier.factors == tuple(factors)
    by_gid: dict[int, list[int]] = {}
    for d, (gid, _) in positions.items():
        by_gid.setdefault(gid, []).append(d)
    groups = [tuple(sorted(g)) for _, g in sorted(by_gid.items())]
    assert len(groups) == math.prod(matrix[0])
    for program in synthesize(hier, max_size):
        steps = [(str(c), g) for c, g in lower_program(program, hier, positions)]
        assert check.check_program(steps, groups) is None, ir.program_text(program)
    for program in synthesize_reduce_scatter(hier, max_size):
        steps = [(str(c), g) for c, g in lower_program(program, hier, positions)]
        assert check.check_program(steps, groups, target="reduce_scatter") is None, ir.program_text(program)
        start = canonical_assignment(program, hier)
        unit = math.lcm(*(x.denominator for ab in start for x in ab))
        owned = check.final_owned(steps, groups, unit)
        for back in synthesize_all_gather(hier, start, max_size)[:20]:
            ag = [(str(c), g) for c, g in lower_program(back, hier, positions)]
            assert check.check_program(ag, groups, unit=unit, target="all_gather", owned=owned) is None


@settings(max_examples=20, deadline=None)
@given(FACTORS, st.integers(1, 4))
def test_the_checker_agrees_with_every_program_synthesized_on_the_abstract_hierarchy(factors, max_size):
    hier = Hierarchy(tuple((f"_{i}", f) for i, f in enumerate(factors, 1)))   # the abstract spelling
    factors = tuple(factors)
    found = synthesize(hier, max_size)
    assert disagreement(factors, found) is None
    rs = synthesize_reduce_scatter(hier, max_size)
    assert disagreement(factors, rs, C.REDUCE_SCATTER) is None
    for program in rs[:5]:
        start = canonical_assignment(program, hier)
        assert disagreement(factors, synthesize_all_gather(hier, start, max_size), C.ALL_GATHER, start) is None
    # a program the checker rejects is named: a reduce-scatter is no allreduce, an allreduce no reduce-scatter
    assert "fails" not in (disagreement(factors, rs[:1]) or "fails")
    assert disagreement(factors, rs[:1]).startswith(ir.program_text(rs[0]))
    assert disagreement(factors, found[:1], C.REDUCE_SCATTER).startswith(ir.program_text(found[0]))


def _brute_force_reduce_scatter(hier, max_size, collectives):
    instrs = distinct_instructions(hier, collectives)
    group = [tuple(range(hier.size))]
    out = set()
    for n in range(1, max_size + 1):
        for seq in itertools.product(instrs, repeat=n):
            if check.check_program([(str(i.collective), g) for i, g in seq], group, target="reduce_scatter") is None:
                out.add(tuple(i for i, _ in seq))
    return out


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(2, 3), min_size=1, max_size=3).filter(lambda f: math.prod(f) <= 12),
       st.integers(1, 3), st.lists(st.sampled_from(tuple(C)), min_size=1, max_size=5, unique=True))
def test_reduce_scatter_synthesis_equals_brute_force(factors, size, colls):
    hier = Hierarchy(tuple((f"l{i}", f) for i, f in enumerate(factors)))
    colls = tuple(c for c in C if c in colls)
    assert set(synthesize_reduce_scatter(hier, size, colls)) == _brute_force_reduce_scatter(hier, size, colls)


def _reference_cut(state, k):
    """Cut with Fractions, piece by piece: part r is [r·L/k, (r+1)·L/k) of the concatenated region."""
    total = sum((b - a for a, b, _ in state), Fraction(0))
    parts = []
    for r in range(k):
        lo_r, hi_r = total * r / k, total * (r + 1) / k
        out, offset = [], Fraction(0)
        for a, b, c in state:
            x, y = max(lo_r, offset), min(hi_r, offset + (b - a))
            if x < y:
                piece = (a + (x - offset), a + (y - offset), c)
                if out and out[-1][1] == piece[0] and out[-1][2] == c:
                    out[-1] = (out[-1][0], piece[1], c)
                else:
                    out.append(piece)
            offset += b - a
        parts.append(tuple(out))
    return parts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 24), st.sampled_from((1, 2, 3, 4, 6, 8, 12, 24))), min_size=2,
                max_size=7), st.integers(1, 9), st.integers(0, 10 ** 6))
def test_group_sum_and_cut_equal_apply_and_a_fraction_reference(points, k, seed):
    rnd = random.Random(seed)
    cuts = sorted({Fraction(n, d) for n, d in points if n <= d})
    pieces = tuple((a, b) for a, b in zip(cuts, cuts[1:]) if rnd.random() < 0.8)
    if not pieces:
        return
    # k members holding the same intervals, each summed over its own devices (disjoint): summable
    members = [tuple((a, b, frozenset({r, k + rnd.randrange(3) * k + r})) for a, b in pieces) for r in range(k)]
    total = semantics.group_sum(members)
    for c in (C.ALLREDUCE, C.REDUCE, C.REDUCE_SCATTER):
        assert semantics.summed(c, total, k) == semantics.apply(c, members)
    assert semantics.summed(C.REDUCE_SCATTER, total, k) == tuple(_reference_cut(total, k))
    mixed = [tuple((a, b, frozenset({0, r})) for a, b in pieces) for r in range(max(k, 2))]
    try:
        semantics.group_sum(mixed)
        raise AssertionError("overlapping contributors summed")
    except semantics.SemanticsError as e:
        assert "overlap" in e.reason


@settings(max_examples=20, deadline=None)
@given(FACTORS, st.integers(1, 3), st.integers(0, 10 ** 6))
def test_regions_by_group_shape_equal_running_every_device(factors, max_size, seed):
    rnd = random.Random(seed)
    cluster, matrix = _cluster_and_matrix(factors, rnd)
    hier, positions = matrix_positions(cluster, matrix, ("rest", "data"), ("data",))
    by_gid: dict[int, list[int]] = {}
    for d, (gid, _) in positions.items():
        by_gid.setdefault(gid, []).append(d)
    groups = [tuple(sorted(g)) for _, g in sorted(by_gid.items())]
    programs = list(synthesize(hier, max_size)) + list(synthesize_reduce_scatter(hier, max_size))
    for program in rnd.sample(programs, min(len(programs), 12)):
        steps = lower_program(program, hier, positions)
        assert regions.program_regions(steps, groups) == regions._whole(steps, groups, None)
    for program in synthesize_reduce_scatter(hier, max_size)[:3]:
        start = canonical_assignment(program, hier)
        state = semantics.assigned_state(groups, [start] * len(groups))
        for back in synthesize_all_gather(hier, start, max_size)[:5]:
            steps = lower_program(back, hier, positions)
            assert regions.program_regions(steps, groups, state) == regions._whole(steps, groups, state)
    # a program that is not one on these groups fails with the devices of the whole run
    bad = lower_program(synthesize_reduce_scatter(hier, max_size)[0], hier, positions) * 2
    try:
        regions.program_regions(bad, groups)
        raise AssertionError("a reduce-scatter run twice has regions")
    except (semantics.SemanticsError, regions.RegionError) as e:
        try:
            regions._whole(bad, groups, None)
        except type(e) as whole:
            assert str(e) == str(whole)


def test_regions_of_groups_of_different_sizes_are_scaled_to_one_unit():
    """Groups of 4 and 9 members: per shape the units are 4 and 9, written in their lcm 36."""
    groups = [tuple(range(4)), tuple(range(4, 13))]
    steps = [(C.REDUCE_SCATTER, groups), (C.ALL_GATHER, groups)]
    found = regions.program_regions(steps, groups)
    assert found == regions._whole(steps, groups, None)
    assert found == (36, (((0, 36), (0, 36)), ((0, 36), (0, 36))))


def _D(steps, unit=None):
    D = 1
    for c, groups in steps:
        if str(c) == "reduce_scatter" and groups:
            D *= math.lcm(*(len(g) for g in groups))
    return D * (unit or 1)


@settings(max_examples=20, deadline=None)
@given(FACTORS, st.integers(1, 3), st.integers(0, 10 ** 6))
def test_checking_once_per_group_shape_gives_the_verdict_of_checking_every_device(factors, max_size, seed):
    """check.check_program (per shape, the whole on failure) against check._check (every device at
    once) on real layouts: synthesized programs, programs cut short or reordered, tampered regions."""
    rnd = random.Random(seed)
    cluster, matrix = _cluster_and_matrix(factors, rnd)
    hier, positions = matrix_positions(cluster, matrix, ("rest", "data"), ("data",))
    by_gid: dict[int, list[int]] = {}
    for d, (gid, _) in positions.items():
        by_gid.setdefault(gid, []).append(d)
    groups = [tuple(sorted(g)) for _, g in sorted(by_gid.items())]
    programs = list(synthesize(hier, max_size)) + list(synthesize_reduce_scatter(hier, max_size))
    for program in rnd.sample(programs, min(len(programs), 8)):
        steps = [(str(c), g) for c, g in lower_program(program, hier, positions)]
        variants = [steps, steps[:-1], steps[::-1], steps + steps[:1]]
        unit, spans = regions.program_regions(lower_program(program, hier, positions), groups)
        for target in ("allreduce", "reduce_scatter"):
            for v in variants:
                if v:
                    assert check.check_program(v, groups, target=target) == check._check(
                        v, groups, None, None, target, None, _D(v))
            tampered = [list(row) for row in spans]
            i = rnd.randrange(len(tampered))
            j = rnd.randrange(len(tampered[i]))
            tampered[i][j] = (tampered[i][j][0], tampered[i][j][1] + 1)
            for r in (spans, tampered):
                assert check.check_program(steps, groups, unit=unit, regions=r, target=target) == check._check(
                    steps, groups, unit, r, target, None, _D(steps))
    for program in synthesize_reduce_scatter(hier, max_size)[:2]:
        rs = [(str(c), g) for c, g in lower_program(program, hier, positions)]
        start = canonical_assignment(program, hier)
        unit = math.lcm(*(x.denominator for ab in start for x in ab))
        owned = check.final_owned(rs, groups, unit)
        wrong = [list(row) for row in owned]
        wrong[-1] = wrong[-1][1:] + wrong[-1][:1]
        for back in synthesize_all_gather(hier, start, max_size)[:3]:
            ag = [(str(c), g) for c, g in lower_program(back, hier, positions)]
            for o in (owned, wrong):
                assert check.check_program(ag, groups, unit=unit, target="all_gather", owned=o) == check._check(
                    ag, groups, unit, None, "all_gather", o, _D(ag, unit))
