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
from functools import lru_cache

from planc import ir
from planc.cost import Network
from planc.cost.collectives import _RING, _edge_bytes_and_rounds   # the step model counted in closed form
from planc.ir import level_coords
from planc.plan import class_stages, stages_per_class
from planc.reduction import FLAT_ALLREDUCE, Hierarchy, program_coefficients, resolve, synthesize

Coords = tuple[tuple[int, ...], ...]


def coords_for(matrix: Sequence[Sequence[int]], fanouts: Sequence[int], axis_sizes: Sequence[int]) -> Coords:
    """Per device (global rank), its coordinate on every axis, in axis order.

    Device ``d``'s level coordinates ``c_0..c_n`` run row-major, and ``c_j`` runs over column ``j``'s
    digits ``d_{0,j}..d_{m,j}`` row-major too; axis ``i``'s coordinate is ``Σ_j d_{i,j}·inner[i][j]``.
    So the coordinates in device order are the sums of one contribution per level, levels nested
    outermost first: built level by level, one tuple per device (no per-device decoding).
    """
    m, n = len(axis_sizes), len(fanouts)
    # inner[i][j]: product of M[i][j+1..n] (the weight of digit d_{i,j} inside x_i)
    inner = [[math.prod(matrix[i][k] for k in range(j + 1, n)) for j in range(n)] for i in range(m)]
    out: list[tuple[int, ...]] = [(0,) * m]
    for j in range(n):
        column = tuple(matrix[i][j] for i in range(m))
        # per value of c_j: what its digits add to each axis coordinate
        adds = [tuple(x * inner[i][j] for i, x in enumerate(level_coords(c, column))) for c in range(fanouts[j])]
        if all(not any(a) for a in adds):
            out = [x for x in out for _ in adds]
            continue
        out = [tuple(map(int.__add__, x, a)) for x in out for a in adds]
    return tuple(out)


def device_of(coords: Coords) -> dict[tuple[int, ...], int]:
    """The inverse of a mapping: axis coordinates → global rank."""
    return {c: d for d, c in enumerate(coords)}


def stage_coordinate(program: ir.Program, index: int) -> int:
    """The ``pipe`` coordinate of derived stage ``index``: the index, but under the schedules that run
    several stages on one coordinate (``planc.plan.class_stages``: interleaved_1f1b's ``p + kP``, zbv's V)."""
    t = program.train
    schedule = str(t.schedule) if t is not None else ""
    per = stages_per_class(schedule, t.virtual if t is not None else 1)
    if per == 1:
        return index
    n = max(len(program.stages), index + 1)
    n += -n % per
    return next(c for c, members in enumerate(class_stages(schedule, n, t.virtual)) if index in members)


def _explicit_layout(stage: ir.Stage) -> ir.StageLayout:
    shape, axes = ir.stage_mesh(stage, None) or ((), tuple(stage.mesh_axes))
    return ir.StageLayout(stage.index, stage.layers, shape, axes, stage.explicit_devices or ())


def stage_layouts(program: ir.Program, coords: Coords) -> tuple[ir.StageLayout, ...]:
    """The stage meshes of a program, given the device coordinates of its placement.

    Explicit stages use their written device ranges (``mesh[i][j] = C + i·M2 + j``).
    Derived stages: stage ``I`` holds the devices whose ``pipe`` coordinate is
    ``I`` (:func:`stage_coordinate`: under interleaved_1f1b and zbv several stages share one), as a mesh over the other axes in declared order, listed row-major by
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
    if pipe is None:   # one pipe coordinate: every stage on every device (more than one: interleaved, zbv)
        order = tuple(sorted(range(len(coords)), key=lambda d: coords[d]))
        return tuple(ir.StageLayout(i, declared[i].layers if i in declared else None, shape, axes, order)
                     for i in (sorted(declared) or [0]))

    p = names.index(pipe)
    rest = tuple(k for k in range(len(names)) if k != p)
    sizes = tuple(a.size for a in program.parallel.axes)
    indices = sorted(declared) if declared else list(range(sizes[p]))
    by_stage: dict[int, list[int]] = {}
    for d, c in enumerate(coords):   # one pass: devices by pipe coordinate, in device order
        by_stage.setdefault(c[p], []).append(d)
    out = []
    for index in indices:
        members = sorted(by_stage.get(stage_coordinate(program, index), []), key=lambda d: tuple(coords[d][k]
                                                                                                for k in rest))
        layers = declared[index].layers if index in declared else None
        out.append(ir.StageLayout(index, layers, shape, axes, tuple(members)))
    return tuple(out)


# ---------------------------------------------------------------- reductions in closed form

def reduction_factors(matrix: Sequence[Sequence[int]], rows: Sequence[int]) -> tuple[int, ...]:
    """Per cluster level (1 included), the product of the reduction axes' entries: ``f_j = Π_{i∈rows} M[i][j]``.

    The synthesis hierarchy is the levels with ``f_j > 1``; every cost of a reduction under the
    matrix is a function of this vector and the cluster alone (see :func:`step_coefficients_by_factors`)."""
    return tuple(math.prod(matrix[i][j] for i in rows) for j in range(len(matrix[0]) if matrix else 0))


def step_coefficients_by_factors(cluster: ir.Cluster, levels: Sequence[int], factors: Sequence[int],
                                 collective: ir.Collective, varying: range, master_below: int | None
                                 ) -> tuple[float, float, int]:
    """``(a, b, k)`` of one lowered instruction, from the factors alone (no device list).

    ``levels[x]``/``factors[x]``: cluster level and factor of hierarchy level ``x + 1``; ``varying``
    the hierarchy levels (0-based) a group's members differ in; ``master_below``: for ``master``
    forms the first hierarchy level whose digit must be 0. It counts what
    ``planc.cost.collectives._step`` counts on the lowered groups: members sorted by rank enumerate
    the varying digits outermost first, so at cluster level ``l`` a group touches
    ``U_l = Π f (varying, at or above l)`` units with ``I_l = Π f (varying, below l)`` members each;
    a unit holds ``D_l`` participating devices (all of its devices, or for master forms those
    whose master digits below ``l`` are 0), hence ``D_l / I_l`` groups, each loading its up- and
    down-link with one ``per_edge`` (ring; a chain loads all but its last / first unit, and some
    unit is never last / first). A ring's latency is ``rounds ×`` the latency of the outermost
    level spanned; a chain's is the sum of its hops, ``Π_{<x} f · (f_x − 1)`` of them first
    crossing varying level ``x``.
    """
    net = _network(cluster)
    fan = cluster.fanouts
    k = math.prod(factors[x] for x in varying)
    per_edge, rounds = _edge_bytes_and_rounds(collective, k, 1.0)
    masked = range(master_below, len(levels)) if master_below is not None else range(0)
    bandwidth = 0.0
    for l in range(len(fan)):
        units = math.prod(factors[x] for x in varying if levels[x] <= l)
        if fan[l] < 2 or units < 2:
            continue
        inside = math.prod(factors[x] for x in varying if levels[x] > l)
        devices = math.prod(fan[l + 1:]) // math.prod(factors[x] for x in masked if levels[x] > l)
        bandwidth = max(bandwidth, per_edge * (devices // inside) / net.level_bandwidth(l))
    if collective in _RING:
        latency = rounds * net.latency_from(min(levels[x] for x in varying))
    else:
        latency, outer = 0.0, 1
        for x in varying:
            latency += outer * (factors[x] - 1) * net.latency_from(levels[x])
            outer *= factors[x]
    return bandwidth, latency, k


@lru_cache(maxsize=64)
def _network(cluster: ir.Cluster) -> Network:
    return Network(cluster)


@lru_cache(maxsize=4096)
def program_costs(cluster: ir.Cluster, factors: tuple[int, ...], synthesis: ir.Synthesis
                  ) -> tuple[tuple[float, float], ...]:
    """Per synthesized program ``(a, b)``, its time ``a·S + b`` for ``S`` bytes, from the per-level
    reduction factors alone: what ``planc.reduction.best_time`` computes on the lowered groups of
    any matrix with these factors, up to float rounding. Cached by exactly what it depends on:
    the cluster, the factor vector and the synthesis settings (the programs themselves come from
    ``synthesize``, cached by the hierarchy's factors)."""
    kept = tuple(j for j, f in enumerate(factors) if f > 1)
    if not kept:
        return ((0.0, 0.0),)
    hier = Hierarchy(tuple((cluster.levels[j].name, factors[j]) for j in kept))
    fs = tuple(factors[j] for j in kept)
    programs = synthesize(hier, synthesis.max_size, synthesis.collectives) or (FLAT_ALLREDUCE,)

    def step(instr):
        s, t = resolve(instr, hier)
        varying = range(s, len(fs)) if t is None else range(t, s)
        master = s if instr.form is ir.FormKind.MASTER else None
        return step_coefficients_by_factors(cluster, kept, fs, instr.collective, varying, master)

    return tuple(program_coefficients(programs, step))


def reduction_lower_bound(cluster: ir.Cluster, factors: Sequence[int], nbytes: float) -> float:
    """A lower bound on the time of every valid reduction program under these factors.

    For each linked level ``l`` at or below the outermost level with factor > 1 (so that every
    reduction group spans two or more units of ``l``): a unit ``u`` of ``l`` holds ``D_l`` devices,
    ``I_l`` of each reduction group, so ``D_l / I_l`` groups. Every device outside ``u`` of such a
    group needs ``u``'s contributions at every point of the buffer, so over the program the points
    carried out of ``u`` measure at least ``S`` per group; a step carries out of ``u`` no more
    than it charges ``u``'s up-link (docs/placement.md, "The lower bound"). A program's time is at
    least the sum over its steps of the load on that link ÷ its bandwidth, plus the latency of one
    step that crosses ``l``: ``D_l / I_l · S ÷ bandwidth_l + latency_from(l)``. The bound is the
    largest of these.
    """
    kept = [j for j, f in enumerate(factors) if f > 1]
    if not kept:
        return 0.0
    net = _network(cluster)
    fan = cluster.fanouts
    best = 0.0
    for l in range(kept[0], len(fan)):
        if fan[l] < 2:
            continue
        groups = math.prod(fan[l + 1:]) // math.prod(factors[l + 1:])
        best = max(best, groups * nbytes / net.level_bandwidth(l) + net.latency_from(l))
    return best
