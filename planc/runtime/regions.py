"""Small arithmetic on regions (one half-open range per tensor dim); no spec parsing here.

Regions come from plan.json (the compiler computes every device's region);
the runtime only intersects them and indexes local shards with them.

    intersect(a, b) -> ranges | None;  numel(ranges) -> int
    to_local(global_slice, region) -> tuple[slice, ...]
        global half-open ranges inside ``region`` → indices into the local shard
"""
from __future__ import annotations

__all__ = ["to_local", "intersect", "numel"]


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
