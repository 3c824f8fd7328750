"""Synthesis hierarchies (P² §2.5, §3.4) and each device's place in one.

The synthesis hierarchy of a reduction is formed by the parallelism factors of
the reduction axes only: at cluster level ``j`` the factor is the product of
the reduction axes' matrix entries ``M[i][j]`` (factors of one hardware level
are collapsed: rows ``[1,2,3]`` and ``[7,8,9]`` give ``[7,16,27]``); levels
with factor 1 are dropped; an implicit ``root`` sits on top. Level names are
the cluster's level names.

A device's *position* is its digit at each hierarchy level inside its
reduction group; lowering (``lower.py``) only needs ``device -> (group id,
position)``. Positions come either from the matrix (:func:`matrix_positions`)
or from the geometry of the reduction groups (:func:`group_positions`, for
explicit-stage plans without a matrix): at level ``j`` a member's digit is the
rank of its level-``j`` unit among the distinct level-``j`` units that hold
members under the same level-``(j-1)`` unit. Geometry works when every group
has the same shape (every such parent holds the same number of distinct
children); otherwise it returns None and the caller falls back to the flat
allreduce only. For matrix placements both ways agree.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from planc import ir

Positions = Mapping[int, tuple[int, tuple[int, ...]]]   # device -> (group id, digits)


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Levels below ``root``, outermost first, each ``(cluster level name, factor > 1)``."""

    levels: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.levels]
        if len(set(names)) != len(names) or ir.ROOT_LEVEL in names:
            raise ValueError(f"bad synthesis hierarchy {self.levels}")
        if any(f < 2 for _, f in self.levels):
            raise ValueError(f"synthesis hierarchy factors must be > 1: {self.levels}")

    @property
    def names(self) -> tuple[str, ...]:
        """``root`` then the level names: index 0 is root."""
        return (ir.ROOT_LEVEL,) + tuple(n for n, _ in self.levels)

    @property
    def factors(self) -> tuple[int, ...]:
        return tuple(f for _, f in self.levels)

    @property
    def size(self) -> int:
        return math.prod(self.factors)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{n} {f}" for n, f in self.levels) + "] under root"

    def canonical_positions(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """One reduction group of ``size`` devices numbered row-major over the factors."""
        factors = self.factors
        return {d: (0, ir.level_coords(d, factors)) for d in range(self.size)}


def _axis_indices(axis_names: Sequence[str], reduction_axes: Sequence[str]) -> tuple[int, ...]:
    idx = []
    for a in reduction_axes:
        if a not in axis_names:
            raise KeyError(f"unknown reduction axis {a!r}")
        idx.append(list(axis_names).index(a))
    return tuple(sorted(set(idx)))


def hierarchy_from_matrix(cluster: ir.Cluster, matrix: Sequence[Sequence[int]],
                          axis_names: Sequence[str], reduction_axes: Sequence[str]) -> Hierarchy:
    red = _axis_indices(axis_names, reduction_axes)
    levels = []
    for j, level in enumerate(cluster.levels):
        f = math.prod(matrix[i][j] for i in red)
        if f > 1:
            levels.append((level.name, f))
    return Hierarchy(tuple(levels))


def matrix_positions(cluster: ir.Cluster, matrix: Sequence[Sequence[int]],
                     axis_names: Sequence[str], reduction_axes: Sequence[str]
                     ) -> tuple[Hierarchy, dict[int, tuple[int, tuple[int, ...]]]]:
    """Hierarchy and positions from a parallelism matrix (DESIGN.md "Rank mapping").

    A level coordinate ``c`` splits into one digit per axis (axis 0 most
    significant); the reduction axes' digits form the device's digit at that
    level and the other axes' digits identify its reduction group. Both are
    tabulated once per level and coordinate; devices are visited in rank
    order (row-major over the level coordinates) and groups numbered by
    first member.
    """
    hier = hierarchy_from_matrix(cluster, matrix, axis_names, reduction_axes)
    red = set(_axis_indices(axis_names, reduction_axes))
    m = len(matrix)
    fanouts = cluster.fanouts
    kept = {j for j in range(len(fanouts)) if math.prod(matrix[i][j] for i in red) > 1}
    tables = []
    for j, fan in enumerate(fanouts):
        table = []
        column = tuple(matrix[i][j] for i in range(m))
        for c in range(fan):
            digits = ir.level_coords(c, column)   # axis 0 most significant
            r = 0
            other = []
            for i in range(m):
                if i in red:
                    r = r * matrix[i][j] + digits[i]
                else:
                    other.append(digits[i])
            table.append((tuple(other), (r,) if j in kept else ()))
        tables.append(table)
    group_ids: dict[tuple, int] = {}
    out = {}
    for d, combo in enumerate(itertools.product(*tables)):
        other = tuple(o for o, _ in combo)
        gid = group_ids.get(other)
        if gid is None:
            gid = group_ids[other] = len(group_ids)
        out[d] = (gid, tuple(x for _, r in combo for x in r))
    return hier, out


def group_positions(cluster: ir.Cluster, groups: Sequence[Sequence[int]]
                    ) -> tuple[Hierarchy, dict[int, tuple[int, tuple[int, ...]]]] | None:
    """Hierarchy and positions from the geometry of the groups; None when the groups are irregular."""
    n = len(cluster.levels)
    factors: list[int | None] = [None] * n
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    digits_of: dict[int, list[int]] = {}
    for gid, g in enumerate(groups):
        coords = {d: cluster.level_coords(d) for d in g}
        for d in g:
            digits_of[d] = []
        for j in range(n):
            children: dict[tuple, set[int]] = {}
            for d in g:
                children.setdefault(coords[d][:j], set()).add(coords[d][j])
            ranks = {}
            for parent, cs in children.items():
                if factors[j] is None:
                    factors[j] = len(cs)
                elif factors[j] != len(cs):
                    return None
                ranks[parent] = {c: i for i, c in enumerate(sorted(cs))}
            for d in g:
                digits_of[d].append(ranks[coords[d][:j]][coords[d][j]])
        for d in g:
            out[d] = (gid, ())
    if not groups:
        return Hierarchy(()), {}
    # every parent has the same number of children at each level, so the shape is regular
    kept = [j for j in range(n) if (factors[j] or 1) > 1]
    hier = Hierarchy(tuple((cluster.levels[j].name, factors[j]) for j in kept))
    for d, (gid, _) in list(out.items()):
        out[d] = (gid, tuple(digits_of[d][j] for j in kept))
    return hier, out


def layout_for(cluster: ir.Cluster, groups: Sequence[Sequence[int]],
               layout: tuple[Hierarchy, Positions] | None = None) -> tuple[Hierarchy, Positions, bool]:
    """``(hierarchy, positions, regular)`` for reduction ``groups``: ``layout`` (the matrix's) when given,
    else the groups' geometry (:func:`group_positions`); irregular groups get the root-only hierarchy
    (``regular`` False: synthesis then offers only the flat collective)."""
    if layout is not None:
        return layout[0], layout[1], True
    found = group_positions(cluster, groups)
    if found is None:
        return Hierarchy(()), {d: (gid, ()) for gid, g in enumerate(groups) for d in g}, False
    return found[0], found[1], True
