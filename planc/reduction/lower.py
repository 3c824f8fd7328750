"""Lowering reduction instructions to explicit device groups (LANGUAGE.md "Reduction programs").

Hierarchy levels are indexed ``0 = root, 1..p``; a device's position is its
digits ``(r_1..r_p)`` inside its reduction group (``hierarchy.py``). For an
instruction with slice level ``s``:

* ``inside``: devices of one reduction group that agree on ``r_1..r_s`` (the
  subset under one unit of ``s``; ``s = root``: the whole group);
* ``parallel(t)``, ``t < s``: devices that agree on ``r_1..r_t`` (same unit of
  ``t``) and on ``r_{s+1}..r_p`` (same position inside their subsets);
* ``master(t)``: as ``parallel(t)``, only the groups at position 0
  (``r_{s+1} = .. = r_p = 0``).

Groups are repeated over every reduction group, members sorted by global
rank, one-device groups dropped, groups ordered by their first member. A step
left with no group is invalid (:class:`LoweringError`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from planc import ir
from planc.reduction.hierarchy import Hierarchy

Groups = tuple[tuple[int, ...], ...]
Step = tuple[ir.Collective, Groups]


class LoweringError(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def resolve(instr: ir.Instruction, hierarchy: Hierarchy) -> tuple[int, int | None]:
    """``(slice index, form level index or None)``; LoweringError if the levels do not fit."""
    names = hierarchy.names
    if instr.slice not in names:
        raise LoweringError(f"unknown level {instr.slice!r} (synthesis hierarchy: {', '.join(names)})")
    s = names.index(instr.slice)
    if instr.form is ir.FormKind.INSIDE:
        if instr.form_level is not None:
            raise LoweringError("form inside takes no level")
        return s, None
    if instr.form_level not in names:
        raise LoweringError(f"unknown level {instr.form_level!r} (synthesis hierarchy: {', '.join(names)})")
    t = names.index(instr.form_level)
    if t >= s:
        raise LoweringError(f"{instr.form}({instr.form_level}) needs a level above the slice {instr.slice!r}")
    return s, t


def lower(instr: ir.Instruction, hierarchy: Hierarchy,
          positions: Mapping[int, tuple[int, tuple[int, ...]]]) -> Groups:
    """The device groups of one instruction on the whole system."""
    s, t = resolve(instr, hierarchy)
    buckets: dict[tuple, list[int]] = {}
    if t is None:
        for d, (gid, pos) in positions.items():
            key = (gid, pos[:s])
            if key in buckets:
                buckets[key].append(d)
            else:
                buckets[key] = [d]
    else:
        master = instr.form is ir.FormKind.MASTER
        for d, (gid, pos) in positions.items():
            inner = pos[s:]
            if master and any(inner):
                continue
            key = (gid, pos[:t], inner)
            if key in buckets:
                buckets[key].append(d)
            else:
                buckets[key] = [d]
    groups = sorted(tuple(sorted(g)) for g in buckets.values() if len(g) > 1)
    if not groups:
        raise LoweringError(f"{instr} leaves no group of two or more devices")
    return tuple(groups)


def lower_program(program: Sequence[ir.Instruction], hierarchy: Hierarchy,
                  positions: Mapping[int, tuple[int, tuple[int, ...]]]) -> tuple[Step, ...]:
    """Lower every instruction; LoweringError names the failing step (1-based)."""
    out = []
    for i, instr in enumerate(program, 1):
        try:
            out.append((instr.collective, lower(instr, hierarchy, positions)))
        except LoweringError as e:
            raise LoweringError(f"step {i} {instr}: {e.reason}") from None
    return tuple(out)


def instructions(hierarchy: Hierarchy, collectives: Sequence[ir.Collective]) -> tuple[ir.Instruction, ...]:
    """Every syntactically valid instruction over the hierarchy, in a fixed order."""
    names = hierarchy.names
    out = []
    for c in collectives:
        for s, slice_name in enumerate(names):
            out.append(ir.Instruction(ir.Collective(c), slice_name, ir.FormKind.INSIDE))
            for kind in (ir.FormKind.PARALLEL, ir.FormKind.MASTER):
                for t in range(s):
                    out.append(ir.Instruction(ir.Collective(c), slice_name, kind, names[t]))
    return tuple(out)


def distinct_instructions(hierarchy: Hierarchy, collectives: Sequence[ir.Collective]
                          ) -> tuple[tuple[ir.Instruction, Groups], ...]:
    """The instructions synthesis enumerates, with their groups on the canonical layout.

    Instructions that leave no group are skipped, and so are aliases: an
    instruction whose groups equal an earlier one's for the same collective
    (e.g. ``parallel(t)`` at the innermost slice is ``inside`` at ``t``, and
    ``master`` there is ``parallel``). The first spelling in
    :func:`instructions` order is kept.
    """
    positions = hierarchy.canonical_positions()
    seen: set = set()
    out = []
    for instr in instructions(hierarchy, collectives):
        try:
            groups = lower(instr, hierarchy, positions)
        except LoweringError:
            continue
        if (instr.collective, groups) in seen:
            continue
        seen.add((instr.collective, groups))
        out.append((instr, groups))
    return tuple(out)
