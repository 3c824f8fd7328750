"""An independent checker for lowered reduction programs (msccl-tools style).

It re-implements DESIGN.md's collective semantics on its own terms and shares
no code with ``semantics.py`` (the synthesizer's state machinery): intervals
are integers in ``[0, D)`` with ``D`` the product over reduce_scatter steps of the
lcm of their group sizes (times the plan's ``unit`` where owned ranges are given, so every cut
is exact), contributor sets are int bitmasks. It also
checks the structural invariants of PLAN_FORMAT.md (groups of a step disjoint,
members sorted, no one-device groups, no empty step), the three targets (allreduce,
reduce_scatter, all_gather: ZeRO-1's two programs) and, for a pair of ZeRO-1 programs
(:func:`check_pair`), that the all-gather starts where the reduce-scatter's steps end.
"""

from __future__ import annotations

import math
from typing import Sequence

_SUMMING = ("allreduce", "reduce_scatter", "reduce")
_TARGETS = ("allreduce", "reduce_scatter", "all_gather")


def check_program(steps: Sequence[tuple[str, Sequence[Sequence[int]]]],
                  reduction_groups: Sequence[Sequence[int]], unit: int | None = None,
                  regions: Sequence[Sequence[tuple[int, int]]] | None = None, target: str = "allreduce",
                  owned: Sequence[Sequence[tuple[int, int]]] | None = None) -> str | None:
    """None if the lowered ``steps`` meet ``target`` on ``reduction_groups``; else why not.

    Targets (DESIGN.md "Collective semantics"): ``allreduce``, every member ends with the whole sum;
    ``reduce_scatter``, the k members of a group end with one piece each of length 1/k, summed over the
    group, pairwise disjoint (with ``owned``, per group per member its range in units of ``1/unit``,
    each member's piece must be exactly that range); ``all_gather``, starting from member r of group g
    holding ``owned[g][r]`` (required) summed over the group, every member ends with the whole sum.

    With ``regions`` (plan.json's, in units of ``1/unit``), also that each step's group works on the
    interval the semantics give it: what its members hold before a summing step, what they hold
    after an all_gather, what the first member holds before a broadcast (one interval each)."""
    target = str(target)
    if target not in _TARGETS:
        return f"unknown target {target!r}"
    D = 1
    for collective, groups in steps:
        if str(collective) == "reduce_scatter" and groups:
            # groups of one step may differ in size (stages of different shapes): every size must cut exactly
            D *= math.lcm(*(len(g) for g in groups))
    if owned is not None or target == "all_gather":
        if not unit:
            return "owned ranges without a unit"
        D *= unit
    if _by_shape(steps, reduction_groups, unit, regions, target, owned, D):
        return None
    return _check(steps, reduction_groups, unit, regions, target, owned, D)


def _by_shape(steps, reduction_groups, unit, regions, target, owned, D) -> bool:
    """Whether the program passes when checked once per distinct reduction-group shape (its size, each
    step's groups in member indices, their regions, its owned row), every check on the same ``D``.
    Reduction groups never exchange data when every step's group lies inside one, so their checks
    are independent, and a group's verdict depends only on its shape; False when the steps do not
    split so, or a shape fails (the caller then checks the whole, for the message with devices)."""
    if owned is not None and len(owned) != len(reduction_groups):
        return False
    where: dict[int, tuple[int, int]] = {}
    for gi, g in enumerate(reduction_groups):
        if list(g) != sorted(g):
            return False
        for r, d in enumerate(g):
            if d in where:
                return False
            where[d] = (gi, r)
    n_groups = len(reduction_groups)
    local_steps: list[list[list[tuple[int, ...]]]] = [[[] for _ in steps] for _ in range(n_groups)]
    local_regions: list[list[list]] = [[[] for _ in steps] for _ in range(n_groups)]
    for n, (_, groups) in enumerate(steps):
        row = regions[n] if regions is not None and n < len(regions) else ()
        for j, g in enumerate(groups):
            hit = [where.get(d) for d in g]
            if not hit or None in hit or any(h[0] != hit[0][0] for h in hit):
                return False
            gi = hit[0][0]
            local_steps[gi][n].append(tuple(r for _, r in hit))
            local_regions[gi][n].append(tuple(row[j]) if j < len(row) else None)
    names = tuple(str(c) for c, _ in steps)
    done: set = set()
    for gi, g in enumerate(reduction_groups):
        mine = tuple(tuple(x) for x in local_steps[gi])
        spans = None if regions is None else tuple(tuple(x) for x in local_regions[gi])
        row = None if owned is None else tuple(tuple(r) for r in owned[gi])
        key = (len(g), mine, spans, row)
        if key in done:
            continue
        if _check(tuple(zip(names, mine)), (tuple(range(len(g))),), unit, spans, target,
                  None if row is None else (row,), D) is not None:
            return False
        done.add(key)
    return True


def _check(steps, reduction_groups, unit, regions, target, owned, D) -> str | None:
    """:func:`check_program` on every device at once, with the interval denominator ``D``."""
    held: dict[int, list[tuple[int, int, int]]] = {}
    if target == "all_gather":
        why = _owned_shape(reduction_groups, unit, owned)
        if why:
            return why
        scale = D // unit
        for g, row in zip(reduction_groups, owned):
            mask = _mask(g)
            for d, (a, b) in zip(g, row):
                held[d] = [(a * scale, b * scale, mask)]
    else:
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
    if target == "reduce_scatter":
        return _scattered(held, reduction_groups, D, unit, owned)
    for g in reduction_groups:
        mask = _mask(g)
        for d in g:
            if held[d] != [(0, D, mask)]:
                return f"device {d} does not end with the full sum over its group"
    return None


def check_tied(steps: Sequence[tuple[str, Sequence[Sequence[int]]]], reduction_groups: Sequence[Sequence[int]],
               contributors: Sequence[int], keys: dict, unit: int | None = None, regions=None,
               pieces=None) -> str | None:
    """A tied parameter's program (DESIGN.md: a reduction whose groups join devices of several stages): None
    when, starting from every contributor holding its own gradient and every other member zeros, every
    device of ``keys`` (each holder's device -> what its gradient is a partial sum over: its stage and
    position bar the tensor coordinate) ends with the whole buffer summed over exactly one contributor
    of each distinct key; else why not. ``unit``, ``regions``: plan.json's, checked as ``check_program`` does.
    ``pieces`` (a table split by rows: per group the rows it sums): the groups then hold some devices of
    the holding stages, each group's members ending with its piece summed over one contributor of each
    key; which devices must sum which piece is :func:`check_tied_pieces`'."""
    why = check_program(steps, reduction_groups, unit=unit, regions=regions)
    if why is not None:
        return why
    members = sorted(d for g in reduction_groups for d in g)
    if pieces is not None:
        if len(pieces) != len(reduction_groups):
            return f"{len(pieces)} pieces for {len(reduction_groups)} groups"
        if not set(members) <= set(keys):
            return f"the groups hold devices {sorted(set(members) - set(keys))} outside the holding stages"
    elif members != sorted(keys):
        return f"the groups hold devices {members}, the holding stages {sorted(keys)}"
    needed = sorted(set(keys.values()))
    for g in reduction_groups:   # the allreduce target holds: every member ends with its group's sum
        got = sorted(keys[c] for c in g if c in contributors)
        if got != needed:
            return (f"group {list(g)} ends with the contributions of {got}, not one of each of {needed} "
                    f"(contributors {sorted(contributors)})")
    return None


def _holder_rows(stage, size: int, padded: int) -> dict | str:
    """Per device of a holding stage (a ``StageLayout`` or a plan.json ``Stage``), the real rows [a, b) of
    the table it keeps: at tensor coordinate c of k, part c of k equal parts of the padded rows; without a
    ``tensor`` axis (or of size 1), all ``size`` rows."""
    layout = hasattr(stage, "axes")   # a StageLayout (the compiler's), else plan.json's Stage
    axes = tuple(stage.axes if layout else stage.mesh_axes)
    shape = tuple(stage.shape if layout else stage.mesh_shape)
    t = axes.index("tensor") if "tensor" in axes else None
    k = shape[t] if t is not None else 1
    if k > 1 and padded % k:
        return f"stage {stage.index}: {padded} padded rows do not split over its tensor axis of {k}"
    out = {}
    for d in stage.devices:
        if k <= 1:
            out[d] = (0, size)
        else:
            c = stage.position(d)[t]
            out[d] = (c * padded // k, min((c + 1) * padded // k, size))
    return out


def check_tied_pieces(records, stages, size: int, padded: int) -> str | None:
    """A tied table split by rows over holders of different tensor degrees (DESIGN.md's collective
    semantics on pieces: each piece of rows is a buffer of its own, summed over the holders that hold
    it), from the plan alone: ``records`` ``[(split, groups), ...]`` (each split's ``rows`` parallel to
    its reduction's ``groups``), ``stages`` the holding stages. None when the pieces tile the ``size``
    real rows exactly once, and each piece's group is exactly the devices whose rows contain it (none
    holding only part of it); else why not."""
    rows: dict[int, tuple[int, int]] = {}
    for st in stages:
        got = _holder_rows(st, size, padded)
        if isinstance(got, str):
            return got
        rows.update(got)
    pieces = []
    for split, groups in records:
        if split.size != size or split.padded != padded:
            return f"a piece's table of {split.size} rows padded to {split.padded}, not {size} to {padded}"
        pieces += [(tuple(ab), tuple(g)) for ab, g in zip(split.rows, groups)]
    pieces.sort()
    at = 0
    for (a, b), g in pieces:
        if a != at:
            return (f"rows [{at}, {a}) are summed by no group" if a > at else
                    f"rows [{a}, {min(b, at)}) are summed by two groups")
        at = b
        holders = sorted(d for d, (x, y) in rows.items() if x <= a and b <= y)
        partial = sorted(d for d, (x, y) in rows.items() if x < b and a < y and not (x <= a and b <= y))
        if partial:
            return f"rows [{a}, {b}): devices {partial} hold only part of the piece"
        if list(g) != holders:
            return f"rows [{a}, {b}) are summed over {list(g)}, but the devices holding them are {holders}"
    if at != size:
        return f"rows [{at}, {size}) are summed by no group"
    return None


def final_owned(steps: Sequence[tuple[str, Sequence[Sequence[int]]]], reduction_groups: Sequence[Sequence[int]],
                unit: int) -> list[list[tuple[int, int]]] | str:
    """What a reduce-scatter program leaves: per group, per member, its piece in units of ``1/unit``;
    or why it is not a valid reduce-scatter program, or its pieces are not whole units."""
    why = check_program(steps, reduction_groups, target="reduce_scatter")
    if why is not None:
        return why
    D = 1
    for collective, groups in steps:
        if str(collective) == "reduce_scatter" and groups:
            D *= math.lcm(*(len(g) for g in groups))
    held = _replay(steps, reduction_groups, D)
    out = []
    for g in reduction_groups:
        row = []
        for d in g:
            (a, b, _), = held[d]
            if (a * unit) % D or (b * unit) % D:
                return f"device {d}'s piece [{a}, {b}) of 1/{D} is not a whole number of units of 1/{unit}"
            row.append((a * unit // D, b * unit // D))
        out.append(row)
    return out


def check_pair(scatter, gather) -> str | None:
    """ZeRO-1's two programs over the same groups: each ``(steps, groups, unit, owned)`` as plan.json has
    them (``unit`` and ``owned`` in units of ``1/unit``). None when the reduce-scatter program is valid
    and leaves exactly its ``owned``, the all-gather program starts from exactly the pieces the
    reduce-scatter's *steps* leave (recomputed here, not read from its ``owned``), both use the same
    unit and ranges, and the all-gather ends with every member holding the whole buffer."""
    rs_steps, rs_groups, rs_unit, rs_owned = scatter
    ag_steps, ag_groups, ag_unit, ag_owned = gather
    if [list(g) for g in rs_groups] != [list(g) for g in ag_groups]:
        return "the all-gather runs over other groups than the reduce-scatter"
    if rs_unit != ag_unit:
        return f"the reduce-scatter's unit 1/{rs_unit} differs from the all-gather's 1/{ag_unit}"
    why = check_program(rs_steps, rs_groups, unit=rs_unit, target="reduce_scatter", owned=rs_owned)
    if why is not None:
        return f"reduce-scatter: {why}"
    left = final_owned(rs_steps, rs_groups, rs_unit)
    if isinstance(left, str):
        return f"reduce-scatter: {left}"
    got = [[tuple(r) for r in row] for row in ag_owned]
    if len(got) != len(left) or any(len(x) != len(y) for x, y in zip(got, left)):
        return "the all-gather's owned ranges do not match the reduce-scatter's groups"
    for g, want_row, got_row in zip(rs_groups, left, got):
        for d, want, have in zip(g, want_row, got_row):
            if want != have:
                return (f"the all-gather starts device {d} from [{have[0]}, {have[1]}) of 1/{ag_unit}, but the "
                        f"reduce-scatter leaves it [{want[0]}, {want[1]})")
    why = check_program(ag_steps, ag_groups, unit=ag_unit, target="all_gather", owned=ag_owned)
    return None if why is None else f"all-gather: {why}"


def _replay(steps, reduction_groups, D):
    held = {d: [(0, D, 1 << d)] for g in reduction_groups for d in g}
    for collective, groups in steps:
        for g in groups:
            for d, s in zip(g, _one(str(collective), [held[d] for d in g])):
                held[d] = s
    return held


def _span(a: int, b: int, D: int, unit: int) -> str:
    """``[a, b)`` of 1/D, in units of 1/unit where they are whole."""
    if (a * unit) % D == 0 and (b * unit) % D == 0:
        return f"[{a * unit // D}, {b * unit // D}) of 1/{unit}"
    return f"[{a}, {b}) of 1/{D}"


def _mask(g) -> int:
    mask = 0
    for d in g:
        mask |= 1 << d
    return mask


def _owned_shape(groups, unit, owned) -> str | None:
    """Why ``owned`` is not, per group and member, equally long disjoint ranges covering [0, unit)."""
    if owned is None:
        return "an all-gather program needs the pieces its members start from (owned)"
    if len(owned) != len(groups):
        return f"owned has {len(owned)} lists for {len(groups)} groups"
    for g, row in zip(groups, owned):
        if len(row) != len(g):
            return f"owned gives {len(row)} ranges for group {list(g)}"
        spans = sorted((int(a), int(b)) for a, b in row)
        if any(b - a != unit // len(g) for a, b in spans) or unit % len(g) or spans[0][0] != 0 or any(
                x[1] != y[0] for x, y in zip(spans, spans[1:])) or spans[-1][1] != unit:
            return f"owned ranges {[list(r) for r in row]} of group {list(g)} are not its 1/{len(g)} pieces of [0, {unit})"
    return None


def _scattered(held, groups, D: int, unit: int | None, owned) -> str | None:
    """The reduce-scatter target on the final state (and each member's piece = its ``owned`` range)."""
    for gi, g in enumerate(groups):
        mask, k = _mask(g), len(g)
        spans = []
        for r, d in enumerate(g):
            s = held[d]
            if len(s) != 1 or s[0][2] != mask or (s[0][1] - s[0][0]) * k != D:
                return f"device {d} does not end with one piece of 1/{k} of the sum over its group"
            spans.append((s[0][0], s[0][1], d))
            if owned is not None:
                if gi >= len(owned) or r >= len(owned[gi]):
                    return f"owned gives no range for device {d}"
                x, y = owned[gi][r]
                if (s[0][0] * unit, s[0][1] * unit) != (x * D, y * D):
                    return f"device {d} ends with {_span(s[0][0], s[0][1], D, unit)}, but owned says [{x}, {y}) of 1/{unit}"
        spans.sort()
        for (_, b, d), (a2, _, d2) in zip(spans, spans[1:]):
            if a2 < b:
                return f"devices {d} and {d2} end with overlapping pieces"
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
