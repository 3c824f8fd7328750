"""Collective semantics of DESIGN.md: device states and the five collectives.

A device's state is an ordered tuple of held pieces ``(a, b, contributors)``:
the interval ``[a, b)`` of the reduced buffer (``Fraction``s in ``[0, 1)``)
summed over the devices in ``contributors`` (a frozenset). Initially device
``d`` holds ``((0, 1, {d}),)``. A collective on a group checks its
precondition and either returns the members' new states or raises
:class:`SemanticsError` whose ``reason`` says why (used in error messages).

:func:`goal_reason` checks a final state against a target: ``allreduce`` (and ``all_gather``,
which starts from :func:`assigned_state`) — every member holds [0, 1) summed over its group;
``reduce_scatter`` — each member one disjoint piece of 1/k summed over its group
(:func:`assignment` reads who owns which).

This module is the synthesizer's state machinery; ``check.py`` is a separate
simulator used to re-verify what the synthesizer emits.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable, Mapping, Sequence

from planc import ir

Piece = tuple[Fraction, Fraction, frozenset]
DeviceState = tuple[Piece, ...]
State = dict[int, DeviceState]   # device -> held pieces

ZERO = Fraction(0)
ONE = Fraction(1)
C = ir.Collective


class SemanticsError(Exception):
    """A failing precondition or a wrong final state; ``reason`` is user-facing."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def initial_state(devices: Iterable[int]) -> State:
    return {d: ((ZERO, ONE, frozenset((d,))),) for d in devices}


def _fmt_frac(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def describe(state: DeviceState) -> str:
    """``[0, 1/2) summed over {0, 1}; ...`` or ``nothing``."""
    if not state:
        return "nothing"
    return "; ".join(
        f"[{_fmt_frac(a)}, {_fmt_frac(b)}) summed over {{{', '.join(map(str, sorted(c)))}}}"
        for a, b, c in state
    )


def _merge(pieces: Sequence[Piece]) -> DeviceState:
    """Join adjacent pieces with the same contributors (a canonical form)."""
    out: list[Piece] = []
    for a, b, c in pieces:
        if out and out[-1][1] == a and out[-1][2] == c:
            out[-1] = (out[-1][0], b, c)
        else:
            out.append((a, b, c))
    return tuple(out)


def _intervals(s: DeviceState) -> tuple[tuple[Fraction, Fraction], ...]:
    return tuple((a, b) for a, b, _ in s)


def _summable(states: Sequence[DeviceState]) -> str | None:
    """The allreduce precondition: same non-empty intervals, pairwise disjoint contributors."""
    if any(not s for s in states):
        return "some members hold nothing"
    first = _intervals(states[0])
    if any(_intervals(s) != first for s in states[1:]):
        return "members hold different intervals"
    for i in range(len(first)):
        seen: set = set()
        for s in states:
            c = s[i][2]
            if seen & c:
                return "members' contributions overlap (a device would be summed twice)"
            seen |= c
    return None


def _sum(states: Sequence[DeviceState]) -> DeviceState:
    return _merge(tuple(
        (a, b, frozenset().union(*(s[i][2] for s in states)))
        for i, (a, b, _) in enumerate(states[0])
    ))


def _cut(state: DeviceState, k: int) -> list[DeviceState]:
    """Cut the held region into k equal consecutive parts (by length).

    Exact, in integers: every endpoint times ``D`` (a common denominator times k) is an integer,
    and so is the part length."""
    unit = math.lcm(*(x.denominator for a, b, _ in state for x in (a, b))) * k
    ends = [(a.numerator * (unit // a.denominator), b.numerator * (unit // b.denominator), c) for a, b, c in state]
    size = sum(b - a for a, b, _ in ends) // k
    parts: list[list[tuple[int, int, frozenset]]] = [[] for _ in range(k)]
    offset = 0  # position along the concatenated region
    for a, b, c in ends:
        lo = a
        while lo < b:
            r = min((offset + (lo - a)) // size, k - 1)
            # end of part r, mapped back into this piece
            hi = min(b, a + (size * (r + 1) - offset))
            parts[r].append((lo, hi, c))
            lo = hi
        offset += b - a
    frac: dict[int, Fraction] = {}

    def f(x: int) -> Fraction:
        hit = frac.get(x)
        if hit is None:
            hit = frac[x] = Fraction(x, unit)
        return hit

    return [_merge([(f(lo), f(hi), c) for lo, hi, c in p]) for p in parts]


SUMMING = frozenset((C.ALLREDUCE, C.REDUCE_SCATTER, C.REDUCE))


def group_sum(members: Sequence[DeviceState]) -> DeviceState:
    """What a summing collective (allreduce, reduce_scatter, reduce) sums over a group: the members'
    pieces summed, or SemanticsError(reason) when the members cannot be summed (its precondition)."""
    why = _summable(members)
    if why:
        raise SemanticsError(why)
    return _sum(members)


def summed(collective: ir.Collective, total: DeviceState, k: int) -> tuple[DeviceState, ...]:
    """The k members' new states after a summing collective whose group sum is ``total``
    (:func:`group_sum`): every member holds it (allreduce), the first member (reduce), or member r
    its r-th of k equal consecutive parts (reduce_scatter)."""
    if collective is C.ALLREDUCE:
        return (total,) * k
    if collective is C.REDUCE:
        return (total,) + ((),) * (k - 1)
    if collective is C.REDUCE_SCATTER:
        return tuple(_cut(total, k))
    raise SemanticsError(f"{collective} does not sum")


def apply(collective: ir.Collective, members: Sequence[DeviceState]) -> tuple[DeviceState, ...]:
    """New states of a group's members (in rank order), or SemanticsError(reason)."""
    k = len(members)
    if collective in SUMMING:
        return summed(collective, group_sum(members), k)
    if collective is C.ALL_GATHER:
        if any(not s for s in members):
            raise SemanticsError("some members hold nothing")
        contributors = {c for s in members for _, _, c in s}
        if len(contributors) != 1:
            raise SemanticsError("members hold pieces with different contributor sets")
        length = members[0][-1][1] - members[0][0][0]
        for r, s in enumerate(members):
            if any(s[i][1] != s[i + 1][0] for i in range(len(s) - 1)):
                raise SemanticsError(f"member {r} holds a region that is not consecutive")
            if s[-1][1] - s[0][0] != length:
                raise SemanticsError("members hold pieces of different lengths")
            if r and members[r - 1][-1][1] != s[0][0]:
                raise SemanticsError("members' pieces are not consecutive in rank order")
        total = _merge(tuple(p for s in members for p in s))
        return (total,) * k
    if collective is C.BROADCAST:
        if not members[0]:
            raise SemanticsError("the root holds nothing")
        if any(s for s in members[1:]):
            raise SemanticsError("non-root members already hold data")
        return (members[0],) * k
    raise SemanticsError(f"unknown collective {collective!r}")


def apply_step(state: State, collective: ir.Collective, groups: Iterable[Sequence[int]]) -> State:
    """Apply a collective on every group at once (devices outside the groups keep their state)."""
    new = dict(state)
    for g in groups:
        try:
            out = apply(collective, [state[d] for d in g])
        except SemanticsError as e:
            raise SemanticsError(f"{collective} over {list(g)}: {e.reason}") from None
        for d, s in zip(g, out):
            new[d] = s
    return new


def goal_reason(state: Mapping[int, DeviceState], groups: Iterable[Sequence[int]],
                target: ir.Collective = C.ALLREDUCE) -> str | None:
    """None when ``state`` meets ``target`` (DESIGN.md "Collective semantics"), else why not.

    ``allreduce`` and ``all_gather``: every device holds [0, 1) summed over exactly its reduction
    group. ``reduce_scatter``: the k members of each group hold one piece each, summed over the whole
    group, of length 1/k, pairwise disjoint (so together they cover [0, 1)); which member owns which
    piece is free.
    """
    if C(target) is C.REDUCE_SCATTER:
        return _scattered_reason(state, groups)
    for g in groups:
        want = ((ZERO, ONE, frozenset(g)),)
        for d in g:
            if state[d] != want:
                return (f"device {d} ends holding {describe(state[d])}, not "
                        f"{describe(want)}")
    return None


def _scattered_reason(state: Mapping[int, DeviceState], groups: Iterable[Sequence[int]]) -> str | None:
    for g in groups:
        full, k = frozenset(g), len(g)
        taken: list[tuple[Fraction, Fraction, int]] = []
        for d in g:
            s = state[d]
            if len(s) != 1 or s[0][2] != full or s[0][1] - s[0][0] != ONE / k:
                return (f"device {d} ends holding {describe(s)}, not one piece of length 1/{k} summed over "
                        f"{{{', '.join(map(str, sorted(full)))}}}")
            taken.append((s[0][0], s[0][1], d))
        taken.sort()
        for (_, b, d), (a2, _, d2) in zip(taken, taken[1:]):
            if a2 < b:
                return f"devices {d} and {d2} end holding overlapping pieces"
    return None


def assignment(state: Mapping[int, DeviceState], groups: Sequence[Sequence[int]]
               ) -> tuple[tuple[tuple[Fraction, Fraction], ...], ...]:
    """Per group, per member (group order): the one interval it holds (a reduce-scatter's final state)."""
    return tuple(tuple((state[d][0][0], state[d][0][1]) for d in g) for g in groups)


def assigned_state(groups: Sequence[Sequence[int]],
                   owned: Sequence[Sequence[tuple[Fraction, Fraction]]]) -> State:
    """An all-gather's starting state: member r of group g holds ``owned[g][r]`` summed over the group."""
    return {d: ((Fraction(a), Fraction(b), frozenset(g)),) for g, row in zip(groups, owned) for d, (a, b) in zip(g, row)}


def run(steps: Sequence[tuple[ir.Collective, Sequence[Sequence[int]]]],
        groups: Sequence[Sequence[int]], target: ir.Collective = C.ALLREDUCE,
        start: State | None = None) -> State:
    """Run lowered steps from the initial state (or ``start``: an all-gather's, :func:`assigned_state`)
    and check the final state against ``target``; SemanticsError names the failing step (1-based)."""
    state = dict(start) if start is not None else initial_state(d for g in groups for d in g)
    for i, (collective, step_groups) in enumerate(steps, 1):
        try:
            state = apply_step(state, collective, step_groups)
        except SemanticsError as e:
            raise SemanticsError(f"step {i} {e.reason}") from None
    why = goal_reason(state, groups, target)
    if why:
        raise SemanticsError(f"after step {len(steps)}: {why}")
    return state
