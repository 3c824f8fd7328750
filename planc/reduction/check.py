"""An independent checker for lowered reduction programs (msccl-tools style).

It re-implements DESIGN.md's collective semantics on its own terms and shares
no code with ``semantics.py`` (the synthesizer's state machinery): intervals
are integers in ``[0, D)`` with ``D`` the product over reduce_scatter steps of the
lcm of their group sizes (so every cut is exact), contributor sets are int bitmasks. It also
checks the structural invariants of PLAN_FORMAT.md (groups of a step disjoint,
members sorted, no one-device groups, no empty step).
"""

from __future__ import annotations

import math
from typing import Sequence

_SUMMING = ("allreduce", "reduce_scatter", "reduce")


def check_program(steps: Sequence[tuple[str, Sequence[Sequence[int]]]],
                  reduction_groups: Sequence[Sequence[int]], unit: int | None = None,
                  regions: Sequence[Sequence[tuple[int, int]]] | None = None) -> str | None:
    """None if the lowered ``steps`` reduce exactly over ``reduction_groups``; else why not.

    With ``regions`` (plan.json's, in units of ``1/unit``), also that each step's group works on the
    interval the semantics give it: what its members hold before a summing step, what they hold
    after an all_gather, what the first member holds before a broadcast (one interval each)."""
    D = 1
    for collective, groups in steps:
        if str(collective) == "reduce_scatter" and groups:
            # groups of one step may differ in size (stages of different shapes): every size must cut exactly
            D *= math.lcm(*(len(g) for g in groups))
    held: dict[int, list[tuple[int, int, int]]] = {}
    for g in reduction_groups:
        for d in g:
            held[d] = [(0, D, 1 << d)]
    for n, (collective, groups) in enumerate(steps, 1):
        name = str(collective)
        where = f"step {n} ({name})"
        if not groups:
            return f"{where}: no groups"
        used: set[int] = set()
        for g in groups:
            if len(g) < 2:
                return f"{where}: one-device group {list(g)}"
            if list(g) != sorted(g):
                return f"{where}: members of {list(g)} not sorted"
            if used & set(g):
                return f"{where}: groups overlap"
            used |= set(g)
            if any(d not in held for d in g):
                return f"{where}: group {list(g)} has a device outside every reduction group"
            why = _one(name, [held[d] for d in g])
            if isinstance(why, str):
                return f"{where} on {list(g)}: {why}"
            if regions is not None:
                gi = list(groups).index(g)
                bad = _region_mismatch(why[0] if name == "all_gather" else held[g[0]], D, unit,
                                       regions[n - 1][gi] if len(regions) >= n and len(regions[n - 1]) > gi else None)
                if bad:
                    return f"{where} on {list(g)}: {bad}"
            for d, s in zip(g, why):
                held[d] = s
    for g in reduction_groups:
        mask = 0
        for d in g:
            mask |= 1 << d
        for d in g:
            if held[d] != [(0, D, mask)]:
                return f"device {d} does not end with the full sum over its group"
    return None


def _region_mismatch(pieces, D: int, unit: int | None, region) -> str | None:
    """Why the plan's ``region`` (units of 1/unit) is not the one interval ``pieces`` cover (units 1/D)."""
    if region is None or not unit:
        return "the plan gives no region"
    if len(pieces) != 1:
        return f"works on {len(pieces)} intervals, not one"
    a, b, _ = pieces[0]
    if (a * unit, b * unit) != (region[0] * D, region[1] * D):
        return f"the plan's region [{region[0]}, {region[1]}) of 1/{unit} is not [{a}, {b}) of 1/{D}"
    return None


def _one(name: str, states: list[list[tuple[int, int, int]]]):
    k = len(states)
    if name in _SUMMING:
        if any(not s for s in states):
            return "a member holds nothing"
        spans = [[(a, b) for a, b, _ in s] for s in states]
        if any(x != spans[0] for x in spans):
            return "different intervals"
        merged = []
        for i, (a, b) in enumerate(spans[0]):
            acc = 0
            for s in states:
                if acc & s[i][2]:
                    return "overlapping contributors"
                acc |= s[i][2]
            merged.append((a, b, acc))
        merged = _join(merged)
        if name == "allreduce":
            return [list(merged) for _ in range(k)]
        if name == "reduce":
            return [list(merged)] + [[] for _ in range(k - 1)]
        length = sum(b - a for a, b, _ in merged)
        if length % k:
            return "region does not split evenly"
        part = length // k
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(k)]
        pos = 0
        for a, b, m in merged:
            x = a
            while x < b:
                r = (pos + x - a) // part
                y = min(b, a + (r + 1) * part - pos)
                out[r].append((x, y, m))
                x = y
            pos += b - a
        return [_join(o) for o in out]
    if name == "all_gather":
        if any(not s for s in states):
            return "a member holds nothing"
        masks = {m for s in states for _, _, m in s}
        if len(masks) != 1:
            return "different contributor sets"
        lengths = set()
        prev_end = None
        for s in states:
            for i in range(1, len(s)):
                if s[i - 1][1] != s[i][0]:
                    return "non-contiguous region"
            if prev_end is not None and s[0][0] != prev_end:
                return "pieces not consecutive in rank order"
            prev_end = s[-1][1]
            lengths.add(s[-1][1] - s[0][0])
        if len(lengths) != 1:
            return "unequal pieces"
        whole = _join([p for s in states for p in s])
        return [list(whole) for _ in range(k)]
    if name == "broadcast":
        if not states[0] or any(states[1:]):
            return "root must hold data and the others nothing"
        return [list(states[0]) for _ in range(k)]
    return f"unknown collective {name}"


def _join(pieces):
    out = []
    for a, b, m in pieces:
        if out and out[-1][1] == a and out[-1][2] == m:
            out[-1] = (out[-1][0], b, m)
        else:
            out.append((a, b, m))
    return out
