"""A device's region of a tensor under a sharding spec on a stage mesh.

Vocabulary: an *axis* is a mesh dimension, a *dim* is a tensor dimension.
Spec strings (LANGUAGE.md "Sharding specs"): one entry per tensor dim, `R`,
`S0`, `S1`, `S01` (sharded over both mesh dims, mesh dim 0 major), or the
named forms `S(data)`, `S(data,tensor)`; the compact form `S0RR` is accepted.

Public API (stable):

    parse_spec(spec, ndim=None, mesh_axes=None) -> tuple[tuple[int, ...], ...]
        per tensor dim, the mesh dims sharding it (() for R)
    region(spec, shape, mesh, rank, mesh_axes=None) -> tuple[tuple[int, int], ...]
        half-open global ranges of `rank`'s shard (None if rank not in mesh)
    Layout(shape, mesh, spec, mesh_axes=None)
        .devices, .region(rank), .local_shape
    to_local(global_slice, region) -> tuple[slice, ...]
        global half-open ranges inside `region` -> indices into the local shard
    intersect(a, b) -> ranges | None;  numel(ranges) -> int
"""
from __future__ import annotations

import re

from .plan import mesh_devices, mesh_position, mesh_shape

__all__ = ["parse_spec", "region", "Layout", "to_local", "intersect", "numel", "SpecError"]


class SpecError(ValueError):
    pass


_TOKEN = re.compile(r"\s*(R|S\(([^)]*)\)|S([0-9]+))")


def parse_spec(spec: str, ndim: int | None = None, mesh_axes=None):
    """'S0 R R' -> ((0,), (), ()); 'S01 R' -> ((0, 1), ())."""
    entries = []
    pos = 0
    text = spec.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise SpecError(f"spec {spec!r}: cannot read at column {pos + 1}: {text[pos:]!r}")
        if m.group(1) == "R":
            entries.append(())
        elif m.group(2) is not None:
            names = [n.strip() for n in m.group(2).split(",") if n.strip()]
            if mesh_axes is None:
                raise SpecError(f"spec {spec!r}: named axes need the mesh's axis names")
            dims = []
            for n in names:
                if n not in mesh_axes:
                    raise SpecError(f"spec {spec!r}: no mesh axis {n!r} (mesh axes: {list(mesh_axes)})")
                dims.append(list(mesh_axes).index(n))
            entries.append(tuple(dims))
        else:
            entries.append(tuple(int(c) for c in m.group(3)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    used = [d for e in entries for d in e]
    if len(used) != len(set(used)):
        raise SpecError(f"spec {spec!r}: a mesh dimension shards more than one tensor dimension")
    if ndim is not None and len(entries) != ndim:
        raise SpecError(f"spec {spec!r} has {len(entries)} entries for a tensor of {ndim} dimensions")
    return tuple(entries)


def region(spec, shape, mesh, rank, mesh_axes=None):
    """Half-open global ranges of the shard `rank` holds, or None if not in mesh."""
    pos = mesh_position(mesh, rank)
    if pos is None:
        return None
    return _region_at(parse_spec(spec, len(shape), mesh_axes) if isinstance(spec, str) else spec,
                      tuple(shape), mesh_shape(mesh), pos, spec)


def _region_at(entries, shape, mshape, pos, spec_text):
    out = []
    for dim, (size, axes) in enumerate(zip(shape, entries)):
        parts, index = 1, 0
        for a in axes:
            if a >= len(mshape):
                raise SpecError(f"spec {spec_text!r}: mesh dimension {a} does not exist on a "
                                f"mesh of shape {mshape}")
            parts *= mshape[a]
            index = index * mshape[a] + pos[a]
        if size % parts:
            raise SpecError(f"spec {spec_text!r}: dimension {dim} of size {size} does not divide "
                            f"over {parts} devices")
        step = size // parts
        out.append((index * step, (index + 1) * step))
    return tuple(out)


class Layout:
    """A tensor of `shape` laid out on `mesh` under `spec`."""

    __slots__ = ("shape", "mesh", "spec", "mesh_axes", "entries", "devices", "_regions")

    def __init__(self, shape, mesh, spec: str, mesh_axes=None):
        self.shape = tuple(int(s) for s in shape)
        self.mesh = mesh
        self.spec = spec
        self.mesh_axes = tuple(mesh_axes) if mesh_axes else None
        self.entries = parse_spec(spec, len(self.shape), self.mesh_axes)
        self.devices = tuple(mesh_devices(mesh))
        ms = mesh_shape(mesh)
        self._regions = {d: _region_at(self.entries, self.shape, ms, mesh_position(mesh, d), spec)
                         for d in self.devices}

    def region(self, rank):
        return self._regions.get(rank)

    @property
    def local_shape(self):
        r = next(iter(self._regions.values()))
        return tuple(b - a for a, b in r)

    def __repr__(self):
        return f"Layout(shape={self.shape}, spec={self.spec!r}, devices={self.devices})"


def intersect(a, b):
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def numel(ranges) -> int:
    n = 1
    for a, b in ranges:
        n *= b - a
    return n


def to_local(global_slice, reg) -> tuple:
    """Indices into a local shard (holding `reg`) of a global slice inside it."""
    out = []
    for (g0, g1), (r0, r1) in zip(global_slice, reg):
        if not (r0 <= g0 <= g1 <= r1):
            raise ValueError(f"slice {tuple(global_slice)} is not inside region {tuple(reg)}")
        out.append(slice(g0 - r0, g1 - r0))
    return tuple(out)
