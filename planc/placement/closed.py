"""The ranking's device-level costs of a matrix in closed form: no device list, no stage meshes.

Placement ranking costs every matrix it cannot prune. Two parts of that cost are defined on the
devices (``_Costing.transfer_time`` and ``tensor_records``, with ``method="devices"``): each
destination device of a transfer pulls from its nearest source device, and every tensor group of a
stage runs a ring all-reduce. Under a parallelism matrix both are functions of the matrix's digits
alone (DESIGN.md's rank mapping): a device is a tuple of digits ``d[i][j] < M[i][j]``, one per axis
``i`` and level ``j``, and its level coordinate ``c_j`` holds the digits of column ``j``. So a stage
(``pipe`` digits fixed) and a tensor group (every digit fixed but ``tensor``'s) are boxes of digits,
and every link of the tree carries a count of equal flows that the digits give. The functions here
count them and add the equal loads in the order the device walk adds them (:func:`repeated_sum`), so
their floats are the device walk's, bit for bit (tests/passes/test_placement_closed.py compares them on
every matrix of small clusters). Cost: per matrix, levels x axes, whatever the number of devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planc import ir
from planc.cost import Network
from planc.cost.collectives import _edge_bytes_and_rounds
from planc.placement.mapping import stage_coordinate

__all__ = ["repeated_sum", "axis_digits", "stage_indices", "transfer_time", "tensor_coefficients",
           "tensor_predictions", "applies"]

_PARTIALS: dict[float, list[float]] = {}   # x -> its partial sums so far (0, x, x + x, ...)
_PARTIALS_KEPT = 256


def repeated_sum(x: float, n: int) -> float:
    """``0.0 + x + x + ... + x`` (``n`` terms, left to right): what a link's load is after ``n``
    equal flows were added to it one by one (not always ``n * x`` in floating point)."""
    sums = _PARTIALS.get(x)
    if sums is None:
        if len(_PARTIALS) >= _PARTIALS_KEPT:   # a long-lived process: keep the table small
            _PARTIALS.clear()
        sums = _PARTIALS[x] = [0.0]
    while len(sums) <= n:
        sums.append(sums[-1] + x)
    return sums[n]


def axis_digits(matrix: Sequence[Sequence[int]], row: int, value: int) -> tuple[int, ...]:
    """The digits ``d[row][0..n]`` of an axis coordinate: mixed radix over the row, outermost level
    most significant (DESIGN.md's rank mapping)."""
    return ir.level_coords(value, matrix[row])


def applies(program: ir.Program) -> bool:
    """Whether the closed forms describe this program: derived stages of a ``parallel`` block
    with a ``pipe`` axis (the stages are the ``pipe`` coordinates)."""
    return (program.parallel is not None and program.stage_mode is not ir.StageMode.EXPLICIT
            and program.pipe_axis is not None)


def stage_indices(program: ir.Program) -> tuple[int, ...]:
    """The stages ``stage_layouts`` lays out: the declared ones, else one per ``pipe`` coordinate."""
    declared = sorted(s.index for s in program.stages)
    if declared:
        return tuple(declared)
    return tuple(range(program.parallel.size_of(ir.MeshAxis.PIPE)))


def transfer_time(program: ir.Program, net: Network, matrix: Sequence[Sequence[int]],
                  region_of) -> float | None:
    """``_Costing.transfer_time`` of this matrix's stage layouts, from the digits.

    ``region_of(transfer)``: the bytes of one destination device's region. None when a transfer
    stays in its stage (the device walk then decides). Stage ``s`` is the devices whose ``pipe``
    digits are ``σ = digits(s)``. A destination device (digits ``τ``) shares its level coordinates
    ``c_0..c_{K-1}`` with some source device exactly when ``σ_j = τ_j`` for ``j < K``; so its
    deepest shared prefix ends at ``K``, the first level where ``σ`` and ``τ`` differ, and its
    source is the lowest device under that prefix. Every flow crosses levels ``K..n`` (latency
    ``latency_from(K)``); each chosen source sends to the ``Π_{j≥K} h_j / M[p][j]`` destination
    devices under its prefix (its up-links' load), and a unit of level ``l ≥ K`` holds
    ``Π_{j>l} h_j / M[p][j]`` destination devices (its down-link's load).
    """
    names = program.parallel.axis_names()
    p = names.index(ir.MeshAxis.PIPE)
    size_p = program.parallel.axes[p].size
    present = set(stage_indices(program))
    fan = program.cluster.fanouts
    free = [fan[j] // matrix[p][j] for j in range(len(fan))]   # per level: units a stage spans inside one
    total = 0.0
    for tr in program.transfers:
        a, b = stage_coordinate(program, tr.src_stage), stage_coordinate(program, tr.dst_stage)
        if tr.src_stage not in present or tr.dst_stage not in present or not 0 <= a < size_p:
            continue   # no layout, or a source stage without devices
        if a == b:     # inside one mesh (one stage, or two on one coordinate): the device walk decides
            return None
        region = region_of(tr)
        if not 0 <= b < size_p or not region > 0:
            t = 0.0    # no flows
        else:
            sigma, tau = axis_digits(matrix, p, a), axis_digits(matrix, p, b)
            k = next(j for j in range(len(fan)) if sigma[j] != tau[j])
            up = repeated_sum(region, math.prod(free[k:]))
            bandwidth = 0.0
            for l in range(k, len(fan)):
                if fan[l] < 2:
                    continue   # no link
                bw = net.level_bandwidth(l)
                bandwidth = max(bandwidth, up / bw, repeated_sum(region, math.prod(free[l + 1:])) / bw)
            t = bandwidth + net.latency_from(k)
        total += t * program.train.micro_batches * 2
    return total


def tensor_coefficients(net: Network, matrix: Sequence[Sequence[int]], fixed: Sequence[int], tensor: int
                        ) -> tuple[float, float]:
    """``step_coefficients(net, ALLREDUCE, groups)`` for the tensor groups of one stage: every
    device whose digits on the axes ``fixed`` are given, grouped by all digits but ``tensor``'s.

    A group spans ``U_l = Π_{j≤l} M[t][j]`` units of level ``l``; a unit of level ``l`` meets the
    ``G_l = Π_{i∉fixed∪{t}} Π_{j>l} M[i][j]`` groups that differ only in digits below it, and a ring
    loads the up- and down-link of every unit it spans twice or more with one ``per_edge`` per group.
    """
    k = math.prod(matrix[tensor])
    if k < 2:
        return 0.0, 0.0
    per_edge, rounds = _edge_bytes_and_rounds(ir.Collective.ALLREDUCE, k, 1.0)
    n = len(matrix[0])
    others = [i for i in range(len(matrix)) if i != tensor and i not in fixed]
    bandwidth = 0.0
    spans: list[tuple[int, int]] = []
    for l, _ in net.linked_inner_first:
        units = math.prod(matrix[tensor][:l + 1])
        if units < 2:
            break
        spans.append((l, units))
        groups = math.prod(matrix[i][j] for i in others for j in range(l + 1, n))
        bandwidth = max(bandwidth, repeated_sum(per_edge, groups) / net.level_bandwidth(l))
    worst = 0.0
    for x, (l, units) in enumerate(spans):
        outer = spans[x + 1][1] if x + 1 < len(spans) else 1
        if units > outer:
            worst = max(worst, net.latency_from(l))
    lat = rounds * worst
    latency = lat if lat > 0.0 else 0.0
    return (bandwidth + latency) - latency, latency


def tensor_predictions(program: ir.Program, net: Network, traffic, matrix: Sequence[Sequence[int]]
                       ) -> list[float]:
    """The ``predicted`` seconds of ``tensor_records`` for this matrix (stages in the same order)."""
    names = program.parallel.axis_names()
    p = names.index(ir.MeshAxis.PIPE)
    size_p = program.parallel.axes[p].size
    present = set(stage_indices(program))
    t = names.index(ir.MeshAxis.TENSOR) if ir.MeshAxis.TENSOR in names else None
    m = program.train.micro_batches if program.train is not None else 1
    coeffs = None
    out = []
    for s, (fwd, bwd) in sorted((traffic or {}).items()):
        if s not in present:
            continue
        if t is None or not 0 <= stage_coordinate(program, s) < size_p:
            a, b = 0.0, 0.0    # no tensor groups
        else:
            if coeffs is None:   # every stage's groups look alike: same counts per unit
                coeffs = tensor_coefficients(net, matrix, (p,), t)
            a, b = coeffs
        ops = tuple(fwd) + tuple(bwd)
        out.append(m * (a * sum(ops) + b * len(ops)))
    return out
