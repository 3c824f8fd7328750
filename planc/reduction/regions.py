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
    program's, ``semantics.assigned_state``); its cuts count towards ``unit``."""
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
