"""The regions a lowered program's steps work on, computed once at compile time for the runtime.

The runtime executes a reduction program without knowing its semantics: plan.json gives, for every
group of every step, the one interval ``[a, b)`` of the flat buffer (in units of ``1/unit`` of it)
the group works on, and the runtime derives each member's slice by the collective's own rule:

- allreduce, reduce_scatter, reduce: ``[a, b)`` is what every member holds before the step;
  reduce_scatter leaves member ``r`` the ``r``-th of ``k`` equal pieces, reduce the first member all;
- all_gather: ``[a, b)`` is what every member holds after it; member ``r`` brings the ``r``-th piece;
- broadcast: ``[a, b)`` is what the first member holds and every member holds after it.

An all-gather program (ZeRO-1's parameters) starts from the pieces a reduce-scatter program left
(``start``). ``unit`` is the least common denominator of every cut the program makes (and starts from), so every piece is a whole
number of units and a buffer padded to a multiple of ``unit`` elements splits into whole elements.
The states come from the synthesizer's semantics (``semantics.py``); ``check.check_program``
re-derives the regions independently when verification is on.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

from planc import ir
from planc.reduction import semantics

__all__ = ["program_regions", "RegionError"]

Range = tuple[int, int]


class RegionError(ValueError):
    """A step works on a region the runtime cannot address as one interval (a compiler bug)."""


def program_regions(steps: Sequence[tuple[ir.Collective, Sequence[Sequence[int]]]],
                    groups: Sequence[Sequence[int]], start: semantics.State | None = None
                    ) -> tuple[int, tuple[tuple[Range, ...], ...]]:
    """``(unit, regions)``: ``regions[i][j]`` the interval of step ``i``'s group ``j`` in units.

    ``start``: the state the program starts from when it is not the initial one (an all-gather
    program's, ``semantics.assigned_state``); its cuts count towards ``unit``.

    Reduction groups never exchange data (every step's group lies inside one), so the program is
    run once per distinct *shape* of a reduction group — its size, each step's groups as member
    indices, its start in member indices — and the regions mapped back: linear in the plan's size,
    where running every device holds contributor sets of the whole group. Anything that does not
    split so (or fails) is run whole, which also gives failures their device numbers."""
    split = _by_shape(steps, groups, start)
    return split if split is not None else _whole(steps, groups, start)


def _by_shape(steps, groups, start) -> tuple[int, tuple[tuple[Range, ...], ...]] | None:
    where: dict[int, tuple[int, int]] = {}      # device -> (reduction group, member index)
    for gi, g in enumerate(groups):
        for r, d in enumerate(g):
            if d in where:
                return None
            where[d] = (gi, r)
    local: list[list[list[tuple[int, ...]]]] = [[[] for _ in steps] for _ in groups]
    at: list[list[tuple[int, int]]] = []        # step i, group j -> (reduction group, its index there)
    for i, (_, step_groups) in enumerate(steps):
        row = []
        for g in step_groups:
            hit = [where.get(d) for d in g]
            if not g or None in hit or any(h[0] != hit[0][0] for h in hit):
                return None
            gi = hit[0][0]
            row.append((gi, len(local[gi][i])))
            local[gi][i].append(tuple(r for _, r in hit))
        at.append(row)
    collectives = tuple(ir.Collective(c) for c, _ in steps)
    done: dict[tuple, tuple[int, tuple]] = {}
    per_group = []
    for gi, g in enumerate(groups):
        begin = None
        if start is not None:
            begin = []
            for d in g:
                pieces = []
                for a, b, c in start[d]:
                    owners = [where.get(x) for x in c]
                    if None in owners or any(o[0] != gi for o in owners):
                        return None
                    pieces.append((a, b, frozenset(r for _, r in owners)))
                begin.append(tuple(pieces))
            begin = tuple(begin)
        key = (len(g), tuple(tuple(x) for x in local[gi]), begin)
        hit = done.get(key)
        if hit is None:
            members = (tuple(range(len(g))),)
            try:
                hit = done[key] = _whole(tuple(zip(collectives, key[1])), members,
                                         None if begin is None else dict(enumerate(begin)))
            except (semantics.SemanticsError, RegionError):
                return None
        per_group.append(hit)
    unit = math.lcm(1, *(u for u, _ in done.values()))
    out = []
    for i, row in enumerate(at):
        spans = []
        for gi, j in row:
            u, rows = per_group[gi]
            a, b = rows[i][j]
            spans.append((a * (unit // u), b * (unit // u)))
        out.append(tuple(spans))
    return unit, tuple(out)


def _whole(steps, groups, start) -> tuple[int, tuple[tuple[Range, ...], ...]]:
    """Every device's state through every step (what :func:`program_regions` computes per shape)."""
    state = dict(start) if start is not None else semantics.initial_state(d for g in groups for d in g)
    spans: list[list[tuple[Fraction, Fraction]]] = []
    cuts: set[Fraction] = {Fraction(0), Fraction(1)}
    for pieces in state.values():
        cuts.update(x for a, b, _ in pieces for x in (a, b))
    for i, (collective, step_groups) in enumerate(steps, 1):
        collective = ir.Collective(collective)
        before = state
        state = semantics.apply_step(state, collective, step_groups)
        row = []
        for g in step_groups:
            held = before[g[0]] if collective is not ir.Collective.ALL_GATHER else state[g[0]]
            if len(held) != 1:
                raise RegionError(f"step {i} {collective} over {list(g)}: the region "
                                  f"({semantics.describe(held)}) is not one interval")
            a, b, _ = held[0]
            row.append((a, b))
        spans.append(row)
        for d in {d for g in step_groups for d in g}:
            for a, b, _ in state[d]:
                cuts.update((a, b))
    unit = math.lcm(*(c.denominator for c in cuts))
    regions = tuple(tuple((int(a * unit), int(b * unit)) for a, b in row) for row in spans)
    return unit, regions
