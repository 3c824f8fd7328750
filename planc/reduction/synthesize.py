"""Syntax-guided synthesis of reduction programs (P² §3.5).

Programs are enumerated over the instructions of a synthesis hierarchy (every
collective × slice × form, aliases removed: ``lower.distinct_instructions``) on one reduction group laid
out canonically on the hierarchy. A prefix is pruned when

* a step's precondition fails (``semantics.apply``), or
* it can no longer reach the goal in the steps left (information increase):
  a piece whose contributors are not the whole group needs a summing step
  (allreduce / reduce_scatter / reduce); a device holding nothing needs a
  broadcast; a device holding part of the buffer needs an all_gather, or a
  reduce (to drop it) and then a broadcast. The fewest allowed collectives
  that meet these needs bound the steps still needed.

Targets (DESIGN.md "Collective semantics"): allreduce programs (``synthesize``), ZeRO-1's
reduce-scatter programs (``synthesize_reduce_scatter``: each member ends with its own 1/k piece,
the bound being 0 at the goal, 1 before it, and no way on once a device holds a piece summed over
the whole group that is too long or beside a partial sum) and all-gather programs from a given
assignment (``synthesize_all_gather``: the allreduce goal from that start).

Search is depth-first with the suffixes of each ``(state, steps left)``
memoized, so equal states reached by different prefixes are expanded once.
The independent ``check.py`` re-verifies every chosen program on its real groups in the verify
pass (``planc/driver/verify.py``); :func:`disagreement` replays every program found against the checker
(the tests run it on random hierarchies). Results are cached per
``(hierarchy, max_size, collectives, target, start)``: synthesis depends only on the
hierarchy, not on the matrix that produced it.
"""

from __future__ import annotations

import itertools
import math
from operator import itemgetter
from fractions import Fraction
from functools import lru_cache

from planc import ir
from planc.reduction import check, semantics
from planc.reduction.hierarchy import Hierarchy
from planc.reduction.lower import LoweringError, distinct_instructions, instructions, lower_program

C = ir.Collective
_SUMMING = frozenset((C.ALLREDUCE, C.REDUCE_SCATTER, C.REDUCE))

Program = tuple[ir.Instruction, ...]
Assignment = tuple[tuple[Fraction, Fraction], ...]   # canonical device -> the piece it owns

# Bounds that keep synthesis (and ranking its programs under every matrix) fast on any hierarchy.
# The state space grows exponentially with the hierarchy's depth and ``max_size``: six levels of
# two at max_size 5 took ~40 s and ~10,000 programs, 20 levels would never end. Past the budget
# synthesis returns every program of the largest size it finished (shortest first), at most
# MAX_PROGRAMS of them; a hierarchy too large even to lower every instruction once gets none
# (callers then use the flat allreduce). All bounds count work, not time: results stay deterministic.
SEARCH_BUDGET = 1_500_000    # group applications while expanding states
MAX_PROGRAMS = 2_000


class _OverBudget(Exception):
    pass


def _needs(state: tuple, full: frozenset) -> tuple[bool, bool, bool]:
    need_sum = need_bcast = need_gather = False
    for pieces in state:
        if not pieces:
            need_bcast = True
            continue
        if pieces[0][0] != 0 or pieces[-1][1] != 1:
            need_gather = True
        if any(c != full for _, _, c in pieces):
            need_sum = True
    return need_sum, need_bcast, need_gather


@lru_cache(maxsize=None)
def _min_steps_table(allowed: frozenset) -> dict:
    """needs (sum, bcast, gather) → fewest allowed collectives meeting them (None: impossible)."""
    table = {}
    for needs in itertools.product((False, True), repeat=3):
        best = None
        for r in range(len(allowed) + 1):
            for combo in itertools.combinations(sorted(allowed), r):
                s = set(combo)
                ok = ((not needs[0] or s & _SUMMING)
                      and (not needs[1] or C.BROADCAST in s)
                      and (not needs[2] or C.ALL_GATHER in s or {C.REDUCE, C.BROADCAST} <= s))
                if ok:
                    best = r
                    break
            if best is not None:
                break
        table[needs] = best
    return table


def synthesize(hierarchy: Hierarchy, max_size: int = 5,
               collectives: tuple[ir.Collective, ...] = tuple(C)) -> tuple[Program, ...]:
    """Every valid allreduce program of at most ``max_size`` steps, shortest first, then in instruction order."""
    return _named(hierarchy, max_size, tuple(ir.Collective(c) for c in collectives), C.ALLREDUCE, None)


def synthesize_reduce_scatter(hierarchy: Hierarchy, max_size: int = 5,
                              collectives: tuple[ir.Collective, ...] = tuple(C)) -> tuple[Program, ...]:
    """Every valid reduce-scatter program (DESIGN.md: each member ends with its own 1/k of the sum,
    the program choosing who owns which piece) of at most ``max_size`` steps, shortest first."""
    return _named(hierarchy, max_size, tuple(ir.Collective(c) for c in collectives), C.REDUCE_SCATTER, None)


def synthesize_all_gather(hierarchy: Hierarchy, start: Assignment, max_size: int = 5,
                          collectives: tuple[ir.Collective, ...] = tuple(C)) -> tuple[Program, ...]:
    """Every valid all-gather program from ``start`` (canonical device ``d`` of the hierarchy holds
    ``start[d]``, summed over the whole group: a reduce-scatter program's final assignment, see
    :func:`canonical_assignment`) to every device holding [0, 1), of at most ``max_size`` steps."""
    start = tuple((Fraction(a), Fraction(b)) for a, b in start)
    if len(start) != hierarchy.size:
        raise ValueError(f"an assignment of {len(start)} pieces for a hierarchy of {hierarchy.size} devices")
    return _named(hierarchy, max_size, tuple(ir.Collective(c) for c in collectives), C.ALL_GATHER, start)


def canonical_assignment(program: Program, hierarchy: Hierarchy) -> Assignment:
    """The piece each canonical device owns after a reduce-scatter program (raises SemanticsError or
    LoweringError when it is not one)."""
    positions = hierarchy.canonical_positions()
    group = (tuple(range(hierarchy.size)),)
    state = semantics.run(lower_program(program, hierarchy, positions), group, C.REDUCE_SCATTER)
    return semantics.assignment(state, group)[0]


@lru_cache(maxsize=1024)
def _named(hierarchy: Hierarchy, max_size: int, collectives: tuple[ir.Collective, ...], target: ir.Collective,
           start: Assignment | None) -> tuple[Program, ...]:
    found = _synthesize(hierarchy.factors, max_size, collectives, target, start)
    return _rename(found, hierarchy.names)


def _abstract_hierarchy(factors: tuple[int, ...]) -> Hierarchy:
    """The hierarchy with these factors and placeholder level names ``_1 .. _p``."""
    return Hierarchy(tuple((f"_{i}", f) for i, f in enumerate(factors, 1)))


def _rename(programs: tuple[Program, ...], names: tuple[str, ...]) -> tuple[Program, ...]:
    """Programs of the abstract hierarchy spelled with the real level names (same level indices)."""
    mapping = dict(zip(_abstract_hierarchy(tuple(2 for _ in names[1:])).names, names))
    return tuple(
        tuple(ir.Instruction(i.collective, mapping[i.slice], i.form,
                             None if i.form_level is None else mapping[i.form_level])
              for i in p)
        for p in programs)


@lru_cache(maxsize=256)
def _synthesize(factors: tuple[int, ...], max_size: int, collectives: tuple[ir.Collective, ...],
                target: ir.Collective = C.ALLREDUCE, start: Assignment | None = None) -> tuple[Program, ...]:
    """Synthesis on the abstract hierarchy of ``factors`` for ``target`` (from ``start`` for all_gather).

    Lowering, the search and the checker depend on the factors only, never on
    the level names, so hierarchies with equal factors share one search; the
    caller renames the levels (:func:`_rename`).

    States are tuples of interned device-state ids; transitions of a state
    (which instructions apply and to what) are computed once however many
    ``steps left`` it is reached with, and a collective on a group whose
    members hold the same (interned) states is simulated once.
    """
    hierarchy = _abstract_hierarchy(factors)
    if len(instructions(hierarchy, collectives)) * hierarchy.size > SEARCH_BUDGET:
        return ()   # too deep and wide even to lower every instruction once: callers use the flat allreduce
    if target is C.REDUCE_SCATTER and C.REDUCE_SCATTER not in collectives:
        return ()   # only a reduce_scatter makes members hold different non-empty pieces
    devices = tuple(range(hierarchy.size))
    full = frozenset(devices)
    piece = semantics.ONE / len(devices)
    lowered = distinct_instructions(hierarchy, collectives)
    # per instruction its groups, each with a getter of its members' entries of a state (a tuple)
    gathered = [(instr, [(g, itemgetter(*g) if len(g) > 1 else lambda s, d=g[0]: (s[d],)) for g in groups])
                for instr, groups in lowered]
    table = _min_steps_table(frozenset(collectives))

    ids: dict[tuple, int] = {}          # device state -> id
    states: list[tuple] = []            # id -> device state

    def intern(ds: tuple) -> int:
        i = ids.get(ds)
        if i is None:
            i = ids[ds] = len(states)
            states.append(ds)
        return i

    init = (semantics.initial_state(devices) if start is None
            else semantics.assigned_state((devices,), (start,)))
    start_ids = tuple(intern(init[d]) for d in devices)
    goal_id = intern(((semantics.ZERO, semantics.ONE, full),))
    goal = (goal_id,) * len(devices)

    applied: dict[tuple, tuple[int, ...] | None] = {}   # (collective, member ids) -> new ids / None
    sums: dict[tuple[int, ...], int | None] = {}        # member ids -> id of their group sum / None
    empty_id = intern(())

    def apply_group(collective: ir.Collective, members: tuple[int, ...]) -> tuple[int, ...] | None:
        key = (collective, members)
        if key in applied:
            return applied[key]
        if collective in _SUMMING:
            # allreduce, reduce and reduce_scatter share the precondition and the sum
            # (semantics.group_sum); only how the sum is handed out differs (semantics.summed)
            if members in sums:
                total = sums[members]
            else:
                try:
                    total = intern(semantics.group_sum([states[m] for m in members]))
                except semantics.SemanticsError:
                    total = None
                sums[members] = total
            k = len(members)
            if total is None:
                res = None
            elif collective is C.ALLREDUCE:
                res = (total,) * k
            elif collective is C.REDUCE:
                res = (total,) + (empty_id,) * (k - 1)
            else:
                res = tuple(intern(o) for o in semantics.summed(collective, states[total], k))
        else:
            try:
                out = semantics.apply(collective, [states[m] for m in members])
                res = tuple(intern(o) for o in out) if collective is not C.BROADCAST else (intern(out[0]),) * len(out)
            except semantics.SemanticsError:
                res = None
        applied[key] = res
        return res

    needs_of: dict[int, tuple[bool, bool, bool]] = {}  # device-state id -> its needs

    def need(state: tuple[int, ...]) -> int | None:
        acc = [False, False, False]
        for i in set(state):
            n = needs_of.get(i)
            if n is None:
                n = needs_of[i] = _needs((states[i],), full)
            acc[0] |= n[0]
            acc[1] |= n[1]
            acc[2] |= n[2]
        return table[tuple(acc)]

    scattered_of: dict[int, int] = {}   # device-state id -> 0: one whole piece of 1/k; 1: not yet; -1: never

    def scattered(i: int) -> int:
        hit = scattered_of.get(i)
        if hit is None:
            ds = states[i]
            if len(ds) == 1 and ds[0][2] == full and ds[0][1] - ds[0][0] == piece:
                hit = 0
            elif any(c == full for _, _, c in ds) and (
                    sum((b - a for a, b, _ in ds), semantics.ZERO) > piece or any(c != full for _, _, c in ds)):
                # a piece summed over the whole group can never be summed again (its contributors
                # overlap every member's), so its holder can neither shrink nor finish its sum
                hit = -1
            else:
                hit = 1
            scattered_of[i] = hit
        return hit

    def need_scattered(state: tuple[int, ...]) -> int | None:
        """Reduce-scatter target: 0 at the goal, None when it is out of reach, else 1 (a lower bound)."""
        marks = [scattered(i) for i in set(state)]
        if -1 in marks:
            return None
        if any(marks):
            return 1
        if len(set(state)) < len(state):
            return None   # two devices hold the same whole piece: a summing step can never split them
        pieces = sorted(states[i][0][:2] for i in state)
        return 0 if all(x[1] <= y[0] for x, y in zip(pieces, pieces[1:])) else None

    if target is C.REDUCE_SCATTER:
        lower_bound = need_scattered
        is_goal = lambda state: need_scattered(state) == 0   # noqa: E731
    else:
        lower_bound = need
        is_goal = goal.__eq__

    trans: dict[tuple, list[tuple[int, tuple[int, ...]]]] = {}
    per_state = sum(len(groups) for _, groups in lowered)   # group applications to expand one state
    spent = [0]

    def transitions(state: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
        hit = trans.get(state)
        if hit is not None:
            return hit
        spent[0] += per_state
        if spent[0] > SEARCH_BUDGET:
            raise _OverBudget
        out = []
        for i, (instr, groups) in enumerate(gathered):
            c = instr.collective
            new = list(state)
            for g, members_of in groups:
                res = apply_group(c, members_of(state))
                if res is None:
                    break
                for d, x in zip(g, res):
                    new[d] = x
            else:
                out.append((i, tuple(new)))
        trans[state] = out
        return out

    memo: dict[tuple, tuple[tuple[int, ...], ...]] = {}
    bounds: dict[tuple[int, ...], int | None] = {}   # state -> lower_bound(state), however many steps are left

    def suffixes(state: tuple[int, ...], left: int) -> tuple[tuple[int, ...], ...]:
        key = (state, left)
        if key in memo:
            return memo[key]
        found: list[tuple[int, ...]] = [()] if is_goal(state) else []
        n = bounds[state] if state in bounds else bounds.setdefault(state, lower_bound(state))
        if left > 0 and n is not None and n <= left:
            for i, new in transitions(state):
                for rest in suffixes(new, left - 1):
                    found.append((i,) + rest)
        memo[key] = tuple(found)
        return memo[key]

    # Iterative deepening: every program of at most `size` steps, for size = 1, 2, ...; memo and
    # transitions carry over between rounds. A round that would pass SEARCH_BUDGET is abandoned
    # and the last complete round stands (a deterministic bound on the run time, never on time).
    found: tuple[tuple[int, ...], ...] = ()
    for size in range(1, max_size + 1):
        try:
            found = suffixes(start_ids, size)
        except _OverBudget:
            break
        if len(found) >= MAX_PROGRAMS:
            break
    programs = sorted(found, key=lambda p: (len(p), p))[:MAX_PROGRAMS]
    return tuple(tuple(lowered[i][0] for i in p) for p in programs if p)


def disagreement(factors: tuple[int, ...], programs: tuple[Program, ...],
                 target: ir.Collective = C.ALLREDUCE, start: Assignment | None = None) -> str | None:
    """None when the independent checker (``check.py``) accepts every program (spelled on the
    abstract hierarchy of ``factors``, as :func:`_synthesize` returns them) for ``target``, else
    the first program it rejects and why. The compiler does not run this per hierarchy (it costs
    one replay per program and member); the verify pass checks every chosen program on its real
    groups, and the tests run this on the synthesizer's output for random hierarchies."""
    hierarchy = _abstract_hierarchy(tuple(factors))
    positions = hierarchy.canonical_positions()
    group = [tuple(range(hierarchy.size))]
    owned = unit = None
    if start is not None:
        unit = math.lcm(*(x.denominator for ab in start for x in ab))
        owned = [[(int(a * unit), int(b * unit)) for a, b in start]]
    for program in programs:
        steps = [(str(c), g) for c, g in lower_program(program, hierarchy, positions)]
        why = check.check_program(steps, group, unit=unit, target=str(target), owned=owned)
        if why is not None:
            return f"{ir.program_text(program)}: {why}"
    return None


def is_valid(program: Program, hierarchy: Hierarchy) -> bool:
    """Whether a program is valid on the hierarchy (checker only)."""
    positions = hierarchy.canonical_positions()
    try:
        steps = lower_program(program, hierarchy, positions)
    except LoweringError:
        return False
    return check.check_program([(str(c), g) for c, g in steps], [tuple(range(hierarchy.size))]) is None
