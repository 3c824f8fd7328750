"""The ``parallel`` block: named axes and, optionally, a pinned parallelism matrix."""

from __future__ import annotations

import math

from planc import ir
from planc.lang import ast
from planc.lang.check.values import Diagnostics, int_of

__all__ = ["check_parallel"]


def check_parallel(errs: Diagnostics, block: ast.ParallelBlock | None,
                   cluster: ir.Cluster | None) -> ir.Parallel | None:
    """The axes, whose sizes must multiply to the cluster's devices, and the matrix if pinned."""
    if block is None:
        return None
    axes, seen = [], set()
    for a in block.axes:
        size = int_of(errs, a.size, f"axis '{a.name.value}' size")
        if a.name.value in seen:
            errs.add(f"axis '{a.name.value}' is declared twice", a.name.span)
        seen.add(a.name.value)
        if size is not None:
            axes.append(ir.Axis(a.name.value, size, a.span))
    if not block.axes:
        errs.add("a parallel block needs at least one axis (e.g. 'data = 8')", block.span)
        return None
    if len(axes) != len(block.axes):
        return None
    if cluster is not None and math.prod(a.size for a in axes) != cluster.devices:
        sizes = " x ".join(f"{a.name} {a.size}" for a in axes)
        errs.add(f"axis sizes multiply to {math.prod(a.size for a in axes)} ({sizes}) but the cluster has "
                 f"{cluster.devices} devices", block.span)
        return None
    matrix = None
    if block.place is not None:
        matrix = _matrix(errs, block.place, axes, cluster)
        if matrix is None:
            return None
    return ir.Parallel(tuple(axes), matrix, block.span)


def _matrix(errs: Diagnostics, lv: ast.ListValue, axes: list[ir.Axis], cluster: ir.Cluster | None):
    """One row per axis multiplying to its size, one column per level multiplying to its fanout."""
    rows = []
    for row in lv.items:
        if not isinstance(row, ast.ListValue):
            errs.add("a placement matrix is a list of rows, e.g. [[2,1],[1,4]]", row.span)
            return None
        vals = []
        for x in row.items:
            if not isinstance(x, ast.Num):
                errs.add("matrix entries must be whole numbers", x.span)
                return None
            v = int_of(errs, x, "a matrix entry")
            if v is None:
                return None
            vals.append(v)
        rows.append(tuple(vals))
    if len(rows) != len(axes):
        errs.add(f"the matrix has {len(rows)} rows but there are {len(axes)} axes "
                 f"({', '.join(a.name for a in axes)}); one row per axis", lv.span)
        return None
    if cluster is None:
        return tuple(rows)
    n = len(cluster.levels)
    ok = True
    for row, a, node in zip(rows, axes, lv.items):
        if len(row) != n:
            errs.add(f"row for axis '{a.name}' has {len(row)} entries but the cluster has {n} levels "
                     f"({', '.join(l.name for l in cluster.levels)}); one column per level", node.span)
            ok = False
        elif math.prod(row) != a.size:
            errs.add(f"row for axis '{a.name}' multiplies to {math.prod(row)}, but the axis size is {a.size}",
                     node.span)
            ok = False
    if not ok:
        return None
    for j, level in enumerate(cluster.levels):
        col = math.prod(r[j] for r in rows)
        if col != level.fanout:
            errs.add(f"column for level '{level.name}' multiplies to {col}, but the level has {level.fanout} units",
                     lv.span)
            ok = False
    return tuple(rows) if ok else None
