"""Unit tasks of a cross-mesh resharding (AlpaComm §3).

A *region* is a box of the tensor: one half-open range per tensor dim. A
device's region under a sharding spec follows from its mesh position. A
*unit task* is one box together with every source device holding it (its
*holders*) and every destination device needing it (its *receivers*).

Because the mesh axes sharding different dims are distinct, the distinct
regions of a spec are the product over dims of one partition per dim. The
unit tasks are therefore the product over dims of the pairwise intersections
of the source and destination partitions of that dim: boxes only, never
elements, and each box is the intersection of exactly one source tile with
exactly one destination tile.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from planc.ir import ShardingSpec, StageLayout

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class UnitTask:
    slice: Box                    # half-open ranges, global indices
    holders: tuple[int, ...]      # source devices holding the slice, sorted
    receivers: tuple[int, ...]    # destination devices needing it, sorted
    elements: int

    def __post_init__(self) -> None:
        if not self.holders or not self.receivers:
            raise ValueError("a unit task needs at least one holder and one receiver")


def _axis_size(mesh_shape: tuple[int, ...], axis: int) -> int:
    # A spec naming a mesh dim the mesh lacks (e.g. a 1-device mesh of shape ())
    # is read as a dim of size 1: the lang checker rejects real mismatches.
    return mesh_shape[axis] if axis < len(mesh_shape) else 1


def parts_per_dim(mesh_shape: tuple[int, ...], spec: ShardingSpec) -> tuple[int, ...]:
    """How many pieces each tensor dim is cut into under ``spec``."""
    return tuple(math.prod(_axis_size(mesh_shape, a) for a in axes) for axes in spec.dims)


def part_index(mesh_shape: tuple[int, ...], spec: ShardingSpec, pos: tuple[int, ...]) -> tuple[int, ...]:
    """Per tensor dim, which piece a device at mesh position ``pos`` holds (first listed axis major)."""
    out = []
    for axes in spec.dims:
        idx = 0
        for a in axes:
            idx = idx * _axis_size(mesh_shape, a) + (pos[a] if a < len(pos) else 0)
        out.append(idx)
    return tuple(out)


def piece(n: int, parts: int, i: int) -> tuple[int, int]:
    return (i * n // parts, (i + 1) * n // parts)


def device_region(shape: tuple[int, ...], layout: StageLayout, spec: ShardingSpec, device: int) -> Box:
    """The box of the tensor that ``device`` holds (source) or needs (destination)."""
    _check_spec(shape, layout, spec)
    counts = parts_per_dim(layout.shape, spec)
    idx = part_index(layout.shape, spec, layout.position(device))
    return tuple(piece(n, c, i) for n, c, i in zip(shape, counts, idx))


def device_regions(shape: tuple[int, ...], layout: StageLayout, spec: ShardingSpec) -> list[tuple[int, Box]]:
    """``(device, device_region(...))`` for every device of the layout, devices ascending (the spec
    checked and the piece counts found once)."""
    if not layout.devices:
        return []
    _check_spec(shape, layout, spec)
    counts = parts_per_dim(layout.shape, spec)
    out = []
    for d in sorted(layout.devices):
        idx = part_index(layout.shape, spec, layout.position(d))
        out.append((d, tuple(piece(n, c, i) for n, c, i in zip(shape, counts, idx))))
    return out


def _check_spec(shape: tuple[int, ...], layout: StageLayout, spec: ShardingSpec) -> None:
    if len(spec.dims) != len(shape):
        raise ValueError(f"spec {spec} has {len(spec.dims)} entries for a {len(shape)}-d tensor")
    used = [a for axes in spec.dims for a in axes]
    if len(used) != len(set(used)):
        raise ValueError(f"spec {spec} uses a mesh dim twice")


def _groups(layout: StageLayout, spec: ShardingSpec) -> dict[tuple[int, ...], list[int]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for d in layout.devices:
        groups.setdefault(part_index(layout.shape, spec, layout.position(d)), []).append(d)
    return groups


def _dim_cells(n: int, src_parts: int, dst_parts: int) -> list[tuple[tuple[int, int], int, int]]:
    """Nonempty intersections (range, source piece, destination piece) of one dim, in order."""
    cells = []
    i = j = 0
    while i < src_parts and j < dst_parts:
        a0, a1 = piece(n, src_parts, i)
        b0, b1 = piece(n, dst_parts, j)
        lo, hi = max(a0, b0), min(a1, b1)
        if lo < hi or (n == 0 and i == j == 0):
            cells.append(((lo, hi), i, j))
        if a1 <= b1:
            i += 1
        if b1 <= a1:
            j += 1
        if n == 0:
            break
    return cells


def unit_tasks(shape: tuple[int, ...], src: StageLayout, src_spec: ShardingSpec,
               dst: StageLayout, dst_spec: ShardingSpec) -> tuple[UnitTask, ...]:
    """All unit tasks of resharding a tensor of ``shape``, ordered by slice. Between two stages of one
    mesh (interleaved_1f1b, zbv: the same devices) a device that holds a slice keeps it: it is no receiver
    of it, and a slice every receiver holds is no task (equal specs: none at all, the transfer is local)."""
    _check_spec(shape, src, src_spec)
    _check_spec(shape, dst, dst_spec)
    shared = set(src.devices) & set(dst.devices)
    if shared and (tuple(src.devices) != tuple(dst.devices) or src.shape != dst.shape):   # one mesh, or none
        raise ValueError("source and destination meshes overlap")
    s_counts = parts_per_dim(src.shape, src_spec)
    d_counts = parts_per_dim(dst.shape, dst_spec)
    s_groups = _groups(src, src_spec)
    d_groups = _groups(dst, dst_spec)
    per_dim = [_dim_cells(n, sc, dc) for n, sc, dc in zip(shape, s_counts, d_counts)]
    tasks = []
    for combo in itertools.product(*per_dim):
        box = tuple(c[0] for c in combo)
        holders = s_groups[tuple(c[1] for c in combo)]
        receivers = [r for r in d_groups[tuple(c[2] for c in combo)] if r not in shared or r not in holders]
        if not receivers:
            continue
        tasks.append(UnitTask(box, tuple(sorted(holders)), tuple(sorted(receivers)),
                              math.prod(hi - lo for lo, hi in box)))
    return tuple(tasks)
