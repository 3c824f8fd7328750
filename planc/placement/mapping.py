"""From a parallelism matrix to device coordinates and stage meshes.

The rank mapping is the normative one of DESIGN.md: a device's level
coordinate ``c_j`` is split into mixed-radix digits ``d_{0,j}..d_{m,j}``
with radices ``M[0][j]..M[m][j]`` (axis 0 most significant); axis ``i``'s
coordinate is the mixed-radix number ``d_{i,0}..d_{i,n}`` with radices
``M[i][0]..M[i][n]`` (outermost level most significant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planc import ir
from planc.ir import level_coords

Coords = tuple[tuple[int, ...], ...]


def coords_for(matrix: Sequence[Sequence[int]], fanouts: Sequence[int], axis_sizes: Sequence[int]) -> Coords:
    """Per device (global rank), its coordinate on every axis, in axis order."""
    m, n = len(axis_sizes), len(fanouts)
    columns = [tuple(matrix[i][j] for i in range(m)) for j in range(n)]
    # inner[i][j]: product of M[i][j+1..n] (the weight of digit d_{i,j} inside x_i)
    inner = [[math.prod(matrix[i][k] for k in range(j + 1, n)) for j in range(n)] for i in range(m)]
    out = []
    for d in range(math.prod(fanouts)):
        # digits[j][i] = d_{i,j}: level coordinate c_j split over column j, axis 0 most significant
        digits = [level_coords(c, col) for c, col in zip(level_coords(d, fanouts), columns)]
        out.append(tuple(sum(digits[j][i] * inner[i][j] for j in range(n)) for i in range(m)))
    return tuple(out)


def device_of(coords: Coords) -> dict[tuple[int, ...], int]:
    """The inverse of a mapping: axis coordinates → global rank."""
    return {c: d for d, c in enumerate(coords)}


def _explicit_layout(stage: ir.Stage) -> ir.StageLayout:
    shape, axes = ir.stage_mesh(stage, None) or ((), tuple(stage.mesh_axes))
    return ir.StageLayout(stage.index, stage.layers, shape, axes, stage.explicit_devices or ())


def stage_layouts(program: ir.Program, coords: Coords) -> tuple[ir.StageLayout, ...]:
    """The stage meshes of a program, given the device coordinates of its placement.

    Explicit stages use their written device ranges (``mesh[i][j] = C + i·M2 + j``).
    Derived stages: stage ``I`` holds the devices whose ``pipe`` coordinate is
    ``I``, as a mesh over the other axes in declared order, listed row-major by
    those coordinates; without a ``pipe`` axis there is one stage, index 0, on
    every device. Without a ``parallel`` block (and derived stages) the single
    stage is a flat mesh ``m0`` over all devices.
    """
    if program.stage_mode is ir.StageMode.EXPLICIT:
        return tuple(_explicit_layout(s) for s in sorted(program.stages, key=lambda s: s.index))

    declared = {s.index: s for s in program.stages}
    if program.parallel is None:
        n = program.cluster.devices
        layers = declared[0].layers if 0 in declared else None
        return (ir.StageLayout(0, layers, (n,), ("m0",), tuple(range(n))),)

    names = program.parallel.axis_names()
    shape, axes = ir.derived_mesh(program.parallel)
    pipe = program.pipe_axis
    if pipe is None:
        layers = declared[0].layers if 0 in declared else None
        order = sorted(range(len(coords)), key=lambda d: coords[d])
        return (ir.StageLayout(0, layers, shape, axes, tuple(order)),)

    p = names.index(pipe)
    rest = tuple(k for k in range(len(names)) if k != p)
    sizes = tuple(a.size for a in program.parallel.axes)
    indices = sorted(declared) if declared else list(range(sizes[p]))
    out = []
    for index in indices:
        members = [d for d, c in enumerate(coords) if c[p] == index]
        members.sort(key=lambda d: tuple(coords[d][k] for k in rest))
        layers = declared[index].layers if index in declared else None
        out.append(ir.StageLayout(index, layers, shape, axes, tuple(members)))
    return tuple(out)
